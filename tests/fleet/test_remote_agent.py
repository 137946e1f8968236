"""Agents on other machines hold only the platform's URL and their host's credential: they download each placed
version over the agent API (sha256-verified), deploy, switch, restart a crashed server and report - with
neither a database nor a broker URL - and a revoked host gets no more work."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from apps.deployments import services
from apps.deployments.models import Deployment, DeploymentState, PlacementState
from apps.fleet import services as fleet_services
from apps.fleet.models import InstanceState, TritonInstance
from hostagent.client import ArtifactDownloadError, CredentialRefused, PlatformClient, VersionSpec
from tests.conftest import wait_for
from tests.support.servers import PLATFORM_ONLY_ENV, seed_example_3

pytestmark = pytest.mark.django_db(transaction=True)


def ready_instance(agent) -> TritonInstance:
    return wait_for(
        lambda: TritonInstance.objects.filter(host__name=agent.name, state=InstanceState.READY).first(),
        120,
        f"the instance of {agent.name} to be READY\n{agent.output()}",
    )


def settled(deployment: Deployment, timeout: float = 120) -> Deployment:
    return wait_for(
        lambda: Deployment.objects.filter(
            pk=deployment.pk, state__in=[DeploymentState.SERVING, DeploymentState.FAILED], target_version=None
        ).first(),
        timeout,
        "the deployment to settle",
    )


@pytest.mark.triton
def test_an_agent_without_database_or_broker_deploys_switches_restarts_and_reports(
    start_agent, make_ready_version, owner, artifact_root
):
    agent = start_agent("remote")
    environ = Path(f"/proc/{agent.process.pid}/environ").read_bytes().split(b"\0")
    names = {entry.split(b"=", 1)[0].decode() for entry in environ if entry}
    assert not set(PLATFORM_ONLY_ENV) & names
    instance = ready_instance(agent)
    first = make_ready_version()
    deployment = settled(
        services.deploy_version(actor=owner, model=first.model, version=first, instances=[instance])
    )
    assert deployment.state == DeploymentState.SERVING, f"{deployment.last_error}\n{agent.output()}"
    cached = artifact_root.parent / "fleet" / "cache" / str(first.pk) / "1" / "model.onnx"
    assert cached.read_bytes() == (first.servable_dir() / "1" / "model.onnx").read_bytes()
    seed_example_3(agent.url, first.model.triton_model_name())

    second = make_ready_version(model=first.model, scale=2.0)
    deployment = settled(services.switch_version(actor=owner, deployment=deployment, version=second))
    assert deployment.active_version == second, f"{deployment.last_error}\n{agent.output()}"

    old_pid = TritonInstance.objects.get(pk=instance.pk).pid
    os.kill(old_pid, signal.SIGKILL)
    restarted = wait_for(
        lambda: (
            TritonInstance.objects.filter(pk=instance.pk, state=InstanceState.READY, restarts=1)
            .exclude(pid=old_pid)
            .first()
        ),
        60,
        f"the killed server to be restarted\n{agent.output()}",
    )
    assert "exited with code" in restarted.last_error
    wait_for(
        lambda: deployment.placements.filter(state=PlacementState.READY, served_version=second).exists(),
        60,
        "the restarted server to serve the switched version again",
    )
    # Nothing opened a database on the host: Django would have created its SQLite file on first use.
    assert not (agent.var_dir / "db.sqlite3").exists()
    assert not list(agent.var_dir.glob("*.sqlite3*"))
    assert oct(agent.credential_file.stat().st_mode & 0o777) == "0o600"


@pytest.mark.triton
def test_a_revoked_host_is_refused_and_gets_no_more_work(start_agent, make_ready_version, owner):
    agent = start_agent("revoked")
    instance = ready_instance(agent)
    fleet_services.revoke_host(actor=None, host=agent.host)
    version = make_ready_version()
    deployment = services.deploy_version(
        actor=owner, model=version.model, version=version, instances=[instance]
    )
    wait_for(lambda: "no more work" in agent.output(), 15, f"the agent to be refused\n{agent.output()}")
    # Nothing may happen: an agent that still took work would fetch the new state within its poll interval
    # (FLEET_POLL_INTERVAL_MS, 1 s) and report the placement LOADING at once; two intervals.
    time.sleep(2)
    placement = deployment.placements.get()
    assert placement.state == PlacementState.PENDING and placement.applied_generation == 0


def test_a_download_that_does_not_match_its_sha256_is_discarded(
    live_server, make_ready_version, owner, tmp_path
):
    host, token = fleet_services.create_host(actor=None, name="edge", address="127.0.0.1")
    _, credential = fleet_services.join_host(token)
    instance = fleet_services.create_instance(
        actor=None, host=host, name="cpu-0", http_port=18100, grpc_port=18101, metrics_port=18102
    )
    version = make_ready_version()
    services.deploy_version(actor=owner, model=version.model, version=version, instances=[instance])
    client = PlatformClient(live_server.url, credential)
    _, state = client.desired_state(None)
    entry = state["versions"][str(version.pk)]
    files = [f | {"sha256": "0" * 64} if f["path"] == "1/model.onnx" else f for f in entry["files"]]
    spec = VersionSpec(pk=version.pk, number=1, label=str(version), model_name="m", config_text="",
                       signature={}, instance_limit=1, files=files)  # fmt: skip
    cache = tmp_path / "cache"
    with pytest.raises(
        ArtifactDownloadError, match=r"1/model.onnx does not match its sha256; download discarded"
    ):
        client.download_version(spec, cache)
    assert not (cache / str(version.pk)).exists()
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".lock-")] == []  # no temp dir left
    good = VersionSpec(**{**spec.__dict__, "files": entry["files"]})
    assert (client.download_version(good, cache) / "1" / "model.onnx").is_file()

    # A file lost from the cache is downloaded again instead of being served as missing.
    cached = cache / str(version.pk) / "1" / "model.onnx"
    cached.unlink()
    assert client.download_version(good, cache) == cache / str(version.pk)
    assert cached.read_bytes() == (version.servable_dir() / "1" / "model.onnx").read_bytes()

    # Several downloads of the same version at once (two instances, or two agents sharing the cache): each
    # gets the complete directory and none replaces it under another's feet.
    shutil.rmtree(cache / str(version.pk))
    seen: list[bytes] = []

    def download_and_read() -> None:
        seen.append((client.download_version(good, cache) / "1" / "model.onnx").read_bytes())

    threads = [threading.Thread(target=download_and_read) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert seen == [cached.read_bytes()] * 4


@pytest.mark.servers
def test_a_revoked_host_given_a_new_join_token_joins_again_and_its_old_credential_stays_dead(
    live_server, tmp_path, artifact_root
):
    import subprocess

    from apps.fleet.models import Host
    from hostagent.client import save_credential
    from tests.support.servers import ROOT, agent_command, agent_env

    host, token = fleet_services.create_host(actor=None, name="again", address="127.0.0.1")
    _, old = fleet_services.join_host(token)
    credential_file = tmp_path / "host-credential"
    save_credential(credential_file, old)
    fleet_services.revoke_host(actor=None, host=host)
    new_token = fleet_services.issue_join_token(actor=None, host=host)
    env = agent_env(tmp_path / "var", artifact_root.parent / "fleet")
    log = tmp_path / "again.log"
    with log.open("wb") as out:
        agent = subprocess.Popen(
            agent_command(live_server.url, new_token, credential_file),
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            wait_for(
                lambda: Host.objects.get(pk=host.pk).is_online(),
                60,
                f"the host's heartbeat\n{log.read_text()}",
            )
        finally:
            agent.send_signal(signal.SIGTERM)
            agent.wait(60)
    assert credential_file.read_text().strip() != old
    assert Host.objects.get(pk=host.pk).identity == "joined"
    with pytest.raises(CredentialRefused):
        PlatformClient(live_server.url, old, retries=0).desired_state(None)
