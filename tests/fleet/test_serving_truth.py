"""SERVING in the database means Triton serves that model at that version: no missing, no extra model.

The stress test: one real host agent with one CPU instance and a reconcile interval of 300 ms. 32 models are
deployed in bursts while models that are already SERVING are switched to their other version and others are
undeployed; every later round deploys the undeployed models again while more switches and undeploys run.
Five rounds in a row, so a race that shows one time in two cannot hide. "Ready in Triton" is Triton's own
list of available model versions (its statistics API), checked against each model's ready endpoint.

What is compared, and when:

* At the end of every round, once nothing is in flight (no deployment DEPLOYING / SWITCHING / UNDEPLOYING,
  every placement's decision applied), and again three reconcile intervals later, strictly: the set of
  (Triton model name, version) of SERVING deployments equals the set Triton has ready, and a placement is
  READY exactly when its deployment is SERVING. A reconcile that undoes a load, or a stale task that loads or
  unloads after a newer decision, shows up here.
* During the run, between operations (a snapshot of the database, then Triton, then the database again):
  a deployment SERVING with its placement READY and its decision applied, unchanged across both snapshots,
  must be ready in Triton at that version; and every version Triton has ready must belong to a live deployment
  with that version as its active, target or served version, or to a decision not yet applied. Strict
  equality mid-transition is impossible (a load takes a second; during a switch both versions and a
  candidate are loaded), so a transition is allowed exactly where the database says one is in flight.

The second test loses models under the agent (the server is killed, one model's files are gone) and checks
that the database says so within a reconcile interval and recovers by itself.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import requests

from apps.deployments import services
from apps.deployments.models import Deployment, DeploymentInstance, DeploymentState, PlacementState
from apps.fleet.models import InstanceState, TritonInstance
from apps.registry.models import RegisteredModel
from tests.conftest import wait_for
from tests.support.servers import instance_key_headers

pytestmark = [pytest.mark.triton, pytest.mark.django_db(transaction=True)]

MODELS = 32
ROUNDS = 5
SWITCHES = 1  # per round; a switch costs three loads (candidate, old + new, new)
UNDEPLOYS = 2  # per round; the next round deploys them again
RECONCILE_MS = 300
IN_FLIGHT = (DeploymentState.DEPLOYING, DeploymentState.SWITCHING, DeploymentState.UNDEPLOYING)


def snapshot() -> dict[str, dict]:
    """The latest deployment of every model: its state, versions and its (single) placement."""
    rows: dict[str, dict] = {}
    deployments = Deployment.objects.select_related(
        "model__team", "active_version", "target_version"
    ).order_by("created_at", "id")
    placements = {p.deployment_id: p for p in DeploymentInstance.objects.select_related("served_version")}
    for d in deployments:
        p = placements.get(d.pk)
        rows[d.triton_model_name()] = {
            "id": d.pk,
            "state": d.state,
            "active": d.active_version.number if d.active_version else None,
            "target": d.target_version.number if d.target_version else None,
            "served": p.served_version.number if p and p.served_version else None,
            "placement": p.state if p else None,
            "generation": p.generation if p else None,
            "applied": bool(p and p.applied_generation == p.generation),
        }
    return rows


def triton_ready(url: str) -> set[tuple[str, int]]:
    """(name, version) of every model version Triton has available: its statistics API lists exactly those
    (a version leaves the list when its unload starts, and joins it when its load finished). One request, so
    sampling often does not steal the agent's CPU."""
    for _attempt in range(10):
        reply = requests.get(f"http://{url}/v2/models/stats", headers=instance_key_headers(url), timeout=10)
        # Triton lists the live models, then reads each one's statistics: a version whose unload starts in
        # between fails the whole answer with 503 (seen with several loads and unloads at once). Ask again.
        if reply.status_code != 503:
            break
        print(f"statistics answered 503, asked again: {reply.text}")
        time.sleep(0.05)
    assert reply.status_code == 200, f"statistics failed ({reply.status_code}): {reply.text}"
    return {(m["name"], int(m["version"])) for m in reply.json()["model_stats"]}


def ready_endpoint(url: str, name: str, version: int) -> bool:
    return (
        requests.get(f"http://{url}/v2/models/{name}/versions/{version}/ready", timeout=5).status_code == 200
    )


def settled_serving(row: dict) -> bool:
    return (
        row["state"] == DeploymentState.SERVING
        and row["placement"] == PlacementState.READY
        and row["applied"]
        and row["served"] == row["active"]
    )


def check_sample(url: str, names: list[str]) -> None:
    before = snapshot()
    ready = triton_ready(url)
    after = snapshot()
    for name in names:
        a, b = before.get(name), after.get(name)
        if a and b and a == b and settled_serving(a):
            assert (name, a["active"]) in ready, f"{name} is SERVING v{a['active']} but not ready: {a}"
    for name, version in ready:
        if name.endswith("__candidate"):
            base = name.removesuffix("__candidate")
            rows = [r for r in (before.get(base), after.get(base)) if r]
            assert any(r["state"] == DeploymentState.SWITCHING or not r["applied"] for r in rows), (
                f"candidate {name} v{version} is loaded while no switch is in flight: {rows}"
            )
            continue
        rows = [r for r in (before.get(name), after.get(name)) if r]
        assert any(
            r["state"] != DeploymentState.UNDEPLOYED and version in (r["active"], r["target"], r["served"])
            for r in rows
        ) or any(not r["applied"] for r in rows), f"{name} v{version} is ready but not deployed: {rows}"


def quiescent() -> bool:
    return all(r["state"] not in IN_FLIGHT and r["applied"] for r in snapshot().values())


def check_strict(url: str, names: list[str]) -> None:
    rows = snapshot()
    serving = {(n, r["active"]) for n, r in rows.items() if r["state"] == DeploymentState.SERVING}
    ready = triton_ready(url)
    assert serving == ready, f"missing in Triton: {serving - ready}; extra in Triton: {ready - serving}"
    for name, version in serving:
        assert ready_endpoint(url, name, version), f"{name} v{version} is listed but not ready"
    for row in rows.values():
        if row["state"] == DeploymentState.SERVING:
            assert row["placement"] == PlacementState.READY and row["served"] == row["active"], row
        else:
            assert row["placement"] != PlacementState.READY, row


def test_serving_deployments_equal_triton_ready_models_under_concurrent_deploys_switches_undeploys(
    start_agent, make_ready_version, owner, team
):
    team.quota_deployed_models = MODELS + 5
    team.save()
    agent = start_agent("stress", FLEET_RECONCILE_INTERVAL_MS=RECONCILE_MS)
    instance = wait_for(
        lambda: TritonInstance.objects.filter(host__name="stress", state=InstanceState.READY).first(),
        120,
        f"the agent's instance\n{agent.output()}",
    )
    models = []
    for i in range(MODELS):
        v1 = make_ready_version(slug=f"m{i:02d}", scale=1.0 + i)
        make_ready_version(model=v1.model, scale=-1.0 - i)
        models.append(v1.model)
    names = [m.triton_model_name() for m in models]
    rng = random.Random(16)
    undeployed: list[RegisteredModel] = list(models)  # round 1 deploys them all
    # Bounds a hang, not speed: every apply is a real Triton load (3-4 s each on a busy 2-core machine).
    deadline = time.monotonic() + 480
    for round_number in range(ROUNDS):
        deploys = list(undeployed)
        switches, undeploys = SWITCHES, UNDEPLOYS
        undeployed = []
        while deploys or switches or undeploys:
            # Deploys come in bursts; switches and undeploys hit models that are SERVING right now.
            for model in deploys[: rng.randint(1, 4)]:
                version = model.versions.get(number=1)
                services.deploy_version(actor=owner, model=model, version=version, instances=[instance])
                deploys.remove(model)
            serving = list(
                Deployment.objects.filter(state=DeploymentState.SERVING, model__in=models).select_related(
                    "model", "active_version"
                )
            )
            rng.shuffle(serving)
            if serving and switches and rng.random() < 0.5:
                deployment = serving.pop()
                other = 2 if deployment.active_version.number == 1 else 1
                services.switch_version(
                    actor=owner, deployment=deployment, version=deployment.model.versions.get(number=other)
                )
                switches -= 1
            if serving and undeploys and rng.random() < 0.5:
                deployment = serving.pop()
                services.undeploy(actor=owner, deployment=deployment)
                undeployed.append(deployment.model)
                undeploys -= 1
            check_sample(agent.url, names)
            time.sleep(rng.uniform(0.05, 0.4))
        # Keep sampling while the agent works through the queue, then compare strictly.
        while not quiescent():
            assert time.monotonic() < deadline, (
                f"the deployments did not settle in round {round_number}: "
                f"{[(n, r) for n, r in snapshot().items() if r['state'] in IN_FLIGHT or not r['applied']]}"
                f"\n{agent.output()}"
            )
            check_sample(agent.url, names)
            time.sleep(0.2)
        check_strict(agent.url, names)
        time.sleep(3 * RECONCILE_MS / 1000)  # reconcile must not undo anything afterwards
        check_strict(agent.url, names)
        assert Deployment.objects.filter(state=DeploymentState.FAILED).count() == 0, [
            d.last_error for d in Deployment.objects.filter(state=DeploymentState.FAILED)
        ]
        assert Deployment.objects.filter(state=DeploymentState.SERVING).count() == MODELS - UNDEPLOYS


def test_a_model_triton_lost_is_reported_and_reloaded_and_one_that_cannot_be_is_failed_with_the_reason(
    start_agent, make_ready_version, owner, artifact_root
):
    agent = start_agent("truth", FLEET_RECONCILE_INTERVAL_MS=RECONCILE_MS, FLEET_RESTART_BASE_DELAY_MS=200)
    instance = wait_for(
        lambda: TritonInstance.objects.filter(host__name="truth", state=InstanceState.READY).first(),
        120,
        f"the agent's instance\n{agent.output()}",
    )
    good, broken = make_ready_version(slug="good"), make_ready_version(slug="broken", scale=2.0)
    deployments = {
        v.model.slug: services.deploy_version(actor=owner, model=v.model, version=v, instances=[instance])
        for v in (good, broken)
    }
    for deployment in deployments.values():
        wait_for(
            lambda d=deployment: Deployment.objects.get(pk=d.pk).state == DeploymentState.SERVING,
            60,
            f"{deployment} to serve\n{agent.output()}",
        )
    # The broken version's file goes bad in the host's copy (the agent's download cache; same size, so the
    # agent's cheap cache check keeps it - a missing file would be downloaded again), then Triton dies with
    # every model.
    cached = artifact_root.parent / "fleet" / "cache" / str(broken.pk) / "1" / "model.onnx"
    cached.write_bytes(b"\0" * cached.stat().st_size)
    os.kill(TritonInstance.objects.get(pk=instance.pk).pid, signal.SIGKILL)

    wait_for(
        lambda: Deployment.objects.get(pk=deployments["good"].pk).events.filter(kind="reloaded").exists(),
        30,
        f"the good model to be reloaded\n{agent.output()}",
    )
    # Its first failure may be the instance's own (down, before the restart): wait for the reload's.
    row = wait_for(
        lambda: (
            (d := Deployment.objects.get(pk=deployments["broken"].pk)).state == DeploymentState.FAILED
            and "reloading" in d.last_error
            and d
        ),
        30,
        f"the broken model's deployment to fail\n{agent.output()}",
    )
    placement = row.placements.get()
    assert placement.state == PlacementState.FAILED and "reloading" in placement.last_error
    assert placement.last_error in row.last_error
    assert row.events.filter(kind="not_serving").exists()
    good_row = wait_for(
        lambda: (
            (d := Deployment.objects.get(pk=deployments["good"].pk)).state == DeploymentState.SERVING and d
        ),
        30,
        "the good model's deployment to serve again",
    )
    assert good_row.events.filter(kind="not_serving").exists()
    assert good_row.placements.get().state == PlacementState.READY
    ready = triton_ready(agent.url)
    assert ready == {("vision__good", 1)}
    # Still true a few reconcile intervals later: the failed model is retried only after a back-off.
    time.sleep(3 * RECONCILE_MS / 1000)
    assert Deployment.objects.get(pk=row.pk).state == DeploymentState.FAILED
    assert triton_ready(agent.url) == {("vision__good", 1)}
