"""Against a real host agent and tritonserver: a tuning job measures its version on the pool's instance
under a scratch name while a serving replica of the same model keeps answering there, records every point,
is cancelled and cleaned up, and its recommendation becomes a version."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from apps.deployments import reserved
from apps.deployments.models import Deployment, DeploymentState, TuningJob, TuningState
from apps.fleet.models import InstanceState, Pool, TritonInstance
from apps.registry.models import RegisteredModel, VersionState
from backend_ge import bench
from backend_ge import config as gc
from backend_ge.tuning import Candidate
from tests.conftest import wait_for

pytestmark = [pytest.mark.triton, pytest.mark.django_db(transaction=True)]
TUNINGS = "/api/v1/teams/vision/tunings/"


def scratch_gone(instance: TritonInstance, name: str, fleet: Path) -> bool:
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(f"http://127.0.0.1:{instance.http_port}/v2/models/{name}/ready", timeout=5)
        loaded = True
    except urllib.error.HTTPError:
        loaded = False
    return not loaded and not list(fleet.rglob(f"repository/{name}"))


def test_a_tuning_measures_beside_a_serving_replica_is_cancelled_and_recommends_a_version(
    owner_client,
    owner,
    team,
    start_agent,
    make_scaler_version,
    artifact_root,
    make_token,
    live_server,
    tmp_path,
):
    Pool.objects.create(name="cpu", memory_budget_mb=4000)
    fleet = Path(artifact_root).parent / "fleet-host-t"
    agent = start_agent("host-t", labels={"pool": "cpu"}, AGENT_HEARTBEAT_INTERVAL="0.5", FLEET_ROOT=fleet)
    instance = wait_for(
        lambda: TritonInstance.objects.filter(host__name="host-t", state=InstanceState.READY).first(),
        120,
        f"the pool's instance to be READY\n{agent.output()}",
    )
    model = RegisteredModel.objects.create(
        team=team, name="Scaler", slug="scaler", created_by=owner, objective_p99_ms=200
    )
    version = make_scaler_version(model, 2.0)
    response = owner_client.post(
        "/api/v1/teams/vision/deployments/", {"model": "scaler", "version": 1, "pool": "cpu"}, format="json"
    )
    assert response.status_code == 201, response.json()
    wait_for(
        lambda: Deployment.objects.filter(state=DeploymentState.SERVING).exists(),
        120,
        f"the replica to serve\n{agent.output()}",
    )
    headers = instance.key_headers()

    # A first job, cancelled once it measured: the agent stops, unloads the scratch replica, reports.
    first = owner_client.post(TUNINGS, {"model": "scaler", "version": 1, "budget_s": 300}, format="json")
    assert first.status_code == 201, first.json()
    job = TuningJob.objects.get(pk=first.json()["id"])
    assert job.state == TuningState.RUNNING and job.instance_id == instance.pk
    name = job.scratch_name()
    wait_for(lambda: len(TuningJob.objects.get(pk=job.pk).points) >= 1, 120, f"points\n{agent.output()}")
    assert owner_client.post(f"{TUNINGS}{job.pk}/cancel/").status_code == 200
    wait_for(
        lambda: TuningJob.objects.get(pk=job.pk).state == TuningState.CANCELLED,
        120,
        f"the cancel to reach the agent\n{agent.output()}",
    )
    wait_for(lambda: scratch_gone(instance, name, fleet), 30, f"the scratch replica to go\n{agent.output()}")

    # A second job, from tgp as a pipeline runs it, goes to the end within its budget and creates the
    # recommended version; the serving replica answers throughout.
    _, secret = make_token(name="tuning")
    env = {**os.environ, "TGP_URL": live_server.url, "TGP_TOKEN": secret, "XDG_CONFIG_HOME": str(tmp_path)}
    command = [sys.executable, "-m", "tgp", "tune", "scaler", "-v", "1", "--budget-s", "60",
               "--max-candidates", "3", "--max-instances", "2", "--wait", "--create-version", "-o", "json"]  # fmt: skip
    tgp = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    job = wait_for(lambda: TuningJob.objects.filter(state=TuningState.RUNNING).first(), 30, "tgp's job")
    version.refresh_from_db()  # its footprint was measured when the replica loaded
    assert job.reserved_mb == 2 * version.footprint_estimate_mb()
    assert reserved.tuning_held([instance.pk]) == {instance.pk: job.reserved_mb}
    served = []
    url = f"127.0.0.1:{instance.http_port}"
    for _ in range(60):  # bounded: at most 60 calls of 50 requests while it measures
        if tgp.poll() is not None:
            break
        served.append(bench.run(url, "vision__scaler", requests=50, warmup=1, headers=headers)["errors"])
    out, err = tgp.communicate(timeout=150)
    assert tgp.returncode == 0, err
    answer = json.loads(out)
    job.refresh_from_db()
    assert answer["id"] == job.pk and answer["state"] == "SUCCEEDED" and job.state == TuningState.SUCCEEDED
    assert f"tuning {job.pk}: scaler v1 RUNNING" in err  # progress on stderr, JSON alone on stdout
    assert served and sum(served) == 0  # the replica never failed a request while the job measured
    assert job.points and all(p["errors"] == 0 for p in job.points)
    assert job.result["wall_s"] <= 60 and len({str(p["candidate"]) for p in job.points}) <= 3
    assert job.result["recommended"] is not None, job.result
    assert (job.finished_at - job.started_at).total_seconds() <= 60 + 30
    wait_for(lambda: scratch_gone(instance, job.scratch_name(), fleet), 30, "the scratch replica to go")
    assert reserved.tuning_held([instance.pk]) == {} and reserved.reserved_drift() == {}

    # The recommended version is READY at once and rolls out like any other (none when the version's own
    # config measured best: the search keeps a move only when it beats the noise).
    recommended = Candidate.from_dict(job.result["recommended"])
    if recommended == Candidate.from_config(gc.parse_config(version.config_text)):
        assert answer["created_version"] is None
        return
    derived = model.versions.get(number=answer["created_version"])
    assert derived.state == VersionState.READY
    assert Candidate.from_config(gc.parse_config(derived.config_text)) == recommended
    deployment = Deployment.objects.get(model=model)
    switched = owner_client.post(
        f"/api/v1/teams/vision/deployments/{deployment.pk}/switch/",
        {"version": derived.number},
        format="json",
    )
    assert switched.status_code == 200, switched.json()
    wait_for(
        lambda: Deployment.objects.filter(
            pk=deployment.pk, state=DeploymentState.SERVING, active_version=derived
        ).exists(),
        120,
        f"the recommended version to serve\n{agent.output()}",
    )
    assert bench.run(url, "vision__scaler", requests=20, warmup=1, headers=headers)["errors"] == 0
