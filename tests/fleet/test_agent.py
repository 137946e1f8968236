"""Host agents with real tritonserver processes: deploy on two hosts, switch version under load, a broken
version, crash recovery and quarantine."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
import tritonclient.http as httpclient

from apps.deployments import services
from apps.deployments.models import Deployment, DeploymentState, PlacementState
from apps.fleet.models import Host, InstanceState, TritonInstance
from apps.fleet.services import notify_hosts
from apps.registry.models import ModelVersion
from backend_ge import config as gc
from tests.conftest import wait_for
from tests.support.models import expected_output
from tests.support.servers import deployment_settled, instance_key_headers, instance_of, seed_example_3

pytestmark = [pytest.mark.triton, pytest.mark.django_db(transaction=True)]


def test_deploy_to_two_hosts_and_the_seed_client_works_against_each(start_agent, make_ready_version, owner):
    first, second = start_agent("host-a"), start_agent("host-b")
    instances = [instance_of(first), instance_of(second)]
    assert {i.host.name for i in instances} == {"host-a", "host-b"}
    version = make_ready_version()
    deployment = services.deploy_version(
        actor=owner, model=version.model, version=version, instances=instances
    )
    deployment = deployment_settled(deployment)
    assert deployment.state == DeploymentState.SERVING, deployment.last_error
    assert deployment.active_version == version
    for agent in (first, second):
        seed_example_3(agent.url, version.model.triton_model_name())
    assert set(deployment.placements.values_list("state", flat=True)) == {PlacementState.READY}
    assert Host.objects.get(name="host-a").is_online()


def _load(url: str, model_name: str, stop: threading.Event, results: dict) -> None:
    client = httpclient.InferenceServerClient(url=url)
    headers = instance_key_headers(url)
    batch = np.random.default_rng(1).random((1, 3, 224, 224), dtype=np.float32)
    # Paced to at most 200 requests/s, so the count bound (the most the pace allows in the time bound) is never
    # what ends the load on a fast machine.
    deadline = time.monotonic() + 120
    while not stop.is_set() and results["sent"] < 24_000 and time.monotonic() < deadline:
        stop.wait(0.005)
        inputs = [httpclient.InferInput("input", batch.shape, "FP32")]
        inputs[0].set_data_from_numpy(batch)
        results["sent"] += 1
        try:
            out = client.infer(model_name, inputs, headers=headers).as_numpy("output")
            results["last"] = out
        except Exception as exc:  # counted: the test asserts there are none
            results["failures"].append(str(exc))
    results["batch"] = batch


def test_version_switch_under_load_fails_no_request(start_agent, make_ready_version, owner):
    agent = start_agent("host-a")
    instance = instance_of(agent)
    v1 = make_ready_version(scale=1.0)
    v2 = make_ready_version(model=v1.model, scale=2.0)
    deployment = deployment_settled(
        services.deploy_version(actor=owner, model=v1.model, version=v1, instances=[instance])
    )
    name = v1.model.triton_model_name()
    stop, results = threading.Event(), {"sent": 0, "failures": [], "last": None}
    load = threading.Thread(target=_load, args=(agent.url, name, stop, results))
    load.start()
    try:
        wait_for(lambda: results["sent"] > 20, 30, "load to start")
        services.switch_version(actor=owner, deployment=deployment, version=v2)
        deployment = deployment_settled(deployment)
        sent_at_switch = results["sent"]
        wait_for(lambda: results["sent"] > sent_at_switch + 20, 30, "requests after the switch")
    finally:
        stop.set()
        load.join(60)
    assert deployment.state == DeploymentState.SERVING and deployment.active_version == v2, (
        deployment.last_error
    )
    assert results["failures"] == [], results["failures"][:3]
    np.testing.assert_allclose(results["last"], expected_output(2.0, results["batch"]), rtol=1e-4, atol=1e-5)
    kinds = list(deployment.events.values_list("kind", flat=True))
    assert "switched" in kinds and "serving" in kinds


def test_broken_version_fails_the_switch_and_the_old_version_keeps_serving(
    start_agent, make_ready_version, owner
):
    agent = start_agent("host-a")
    instance = instance_of(agent)
    v1 = make_ready_version(scale=1.0)
    broken = make_ready_version(model=v1.model, scale=3.0)
    (broken.servable_dir() / "1" / "model.onnx").write_bytes(b"this is not an onnx model")
    deployment = deployment_settled(
        services.deploy_version(actor=owner, model=v1.model, version=v1, instances=[instance])
    )
    services.switch_version(actor=owner, deployment=deployment, version=broken)
    deployment = deployment_settled(deployment)
    assert deployment.state == DeploymentState.SERVING and deployment.active_version == v1
    assert "failed" in deployment.last_error.lower() and str(instance) in deployment.last_error
    assert deployment.events.filter(kind="switch_failed").exists()
    seed_example_3(agent.url, v1.model.triton_model_name())


def test_killed_tritonserver_is_restarted_with_its_models_within_15_seconds(
    start_agent, make_ready_version, owner
):
    agent = start_agent("host-a", FLEET_RESTART_BASE_DELAY_MS=200)
    instance = instance_of(agent)
    version = make_ready_version()
    deployment_settled(
        services.deploy_version(actor=owner, model=version.model, version=version, instances=[instance])
    )
    old_pid = TritonInstance.objects.get(pk=instance.pk).pid
    os.kill(old_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    client = httpclient.InferenceServerClient(url=agent.url)

    def back():
        row = TritonInstance.objects.get(pk=instance.pk)
        if row.state != InstanceState.READY or row.pid == old_pid:
            return False
        try:
            return client.is_model_ready(version.model.triton_model_name())
        except Exception:
            return False

    wait_for(back, 15, f"the instance and its model to be back\n{agent.output()}")
    assert time.monotonic() - killed_at < 15
    row = TritonInstance.objects.get(pk=instance.pk)
    assert row.restarts == 1 and "exited with code" in row.last_error
    # Served without the python backend's auto-complete stub (and its 1 s sleep) per load.
    with open(f"/proc/{row.pid}/cmdline", "rb") as cmdline:
        assert b"--disable-auto-complete-config" in cmdline.read().split(b"\0")
    seed_example_3(agent.url, version.model.triton_model_name())


# The NPU runtime a GE model imports when it loads: here a stand-in that takes the whole server down, like a
# native crash in a runtime would. Only the stub's import kills, and only a tritonserver parent.
KILLER_ACL = """
import os
import signal

with open(f"/proc/{os.getppid()}/comm") as comm:
    if comm.read().strip().startswith("tritonserver"):
        os.kill(os.getppid(), signal.SIGKILL)
"""


def test_a_model_that_crashes_the_server_at_every_start_quarantines_the_instance(
    start_agent, make_ready_version, owner, team, artifact_root
):
    version = make_ready_version()
    killer = ModelVersion.objects.create(
        model=version.model, number=2, state="READY", signature=version.signature
    )
    # A config a tenant may write (backend ge, EXECUTOR acl) with an .om, so the stub imports the runtime.
    (killer.servable_dir() / "1").mkdir(parents=True)
    (killer.servable_dir() / "1" / "model.om").write_bytes(b"\0" * 4096)
    cfg = gc.parse_config(version.config_text)
    cfg.parameters["EXECUTOR"].string_value = "acl"
    killer.config_text = gc.render_config(cfg)
    (killer.servable_dir() / "config.pbtxt").write_text(killer.config_text)
    killer.save()
    # Beside the fleet root, where the instance's user (an agent as root runs Triton as one) can read it.
    runtime = artifact_root.parent / "killer-runtime"
    runtime.mkdir(mode=0o755)
    (runtime / "acl.py").write_text(KILLER_ACL)
    agent = start_agent(
        "host-a",
        FLEET_RESTART_BASE_DELAY_MS=100,
        FLEET_MAX_CRASHES=3,
        PYTHONPATH=str(runtime),
        AGENT_HEARTBEAT_INTERVAL=0.2,
    )
    host = agent.host
    instance = instance_of(agent)
    deployment = Deployment.objects.create(
        team=team, model=version.model, active_version=killer, state="SERVING"
    )
    deployment.placements.create(instance=instance, served_version=killer, state=PlacementState.READY)
    notify_hosts([host.pk])  # made by hand here: tell the agent, as a decision does
    row = wait_for(
        lambda: (r := TritonInstance.objects.get(pk=instance.pk)).state == InstanceState.QUARANTINED and r,
        90,
        f"quarantine\n{agent.output()}",
    )
    assert len(row.crash_times) == 3 and "quarantined" in row.last_error
    # Quarantined means no more restarts. Unquarantined, the 4th start would come after a back-off of 0.4 s
    # (100 ms doubled per crash: 0.1 * 2 ** (3 - 1)): wait until the still-running agent's own heartbeat says
    # 1.5 s have passed on its side (room for that start and its report), then nothing may have happened.
    after = row.state_changed_at + timedelta(seconds=1.5)
    wait_for(
        lambda: Host.objects.get(pk=host.pk).last_heartbeat_at >= after,
        30,
        f"a heartbeat of the agent 1.5 s after the quarantine\n{agent.output()}",
    )
    assert TritonInstance.objects.get(pk=instance.pk).restarts == row.restarts
    assert host.pk == row.host_id
