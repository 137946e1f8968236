"""Requests through the gateway survive a killed instance, deploys, switches, undeploys and a gateway restart,
with a plain keep-alive client (no resend, no retry) and without a single HAProxy reload - over HTTP and over
gRPC (``tritonclient.grpc`` through the gateway's gRPC frontend, each message walked by its Lua filter)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from apps.deployments import services as deployment_services
from apps.deployments.models import Deployment, DeploymentState
from apps.fleet.models import TritonInstance
from apps.registry.models import RegisteredModel
from tests.conftest import wait_for
from tests.support.servers import (
    GrpcLoad,
    Load,
    deploy,
    grpc_answers,
    ready_instance,
    requires_haproxy,
    server_row,
    server_status,
    worker_pid,
)

pytestmark = [pytest.mark.triton, requires_haproxy, pytest.mark.django_db(transaction=True)]
under_load = pytest.mark.parametrize("load_class", [Load, GrpcLoad], ids=["http", "grpc"])


@pytest.fixture(autouse=True)
def _no_rate_limit(team):
    # These tests measure failures under load, not the quota (test_http_gateway covers it).
    team.quota_requests_per_second = 1_000_000
    team.save()


@under_load
def test_instance_killed_under_load_fails_no_request(
    owner_client, team, owner, start_agent, make_scaler_version, start_gateway, make_token, artifact_root,
    load_class,
):  # fmt: skip
    _, first = ready_instance(start_agent, "host-a")
    # Two hosts, two host directories (their version caches are their own, as on two machines).
    _, second = ready_instance(start_agent, "host-b", FLEET_ROOT=Path(artifact_root).parent / "fleet-b")
    model = RegisteredModel.objects.create(team=team, name="Scaler", slug="scaler", created_by=owner)
    make_scaler_version(model, 2.0)
    deployment = deploy(owner_client, "vision", "scaler", 1, [first, second])
    gateway = start_gateway()
    _, secret = make_token(name="load")
    backend = f"d{deployment.pk}"
    wait_for(lambda: server_status(gateway, backend, first.api_key) == "UP", 10, "host-a in rotation")
    wait_for(lambda: server_status(gateway, backend, second.api_key) == "UP", 10, "host-b in rotation")
    wait_for(lambda: gateway.infer("vision__scaler", secret)[0] == 200, 10, "the token to be known")
    wait_for(lambda: grpc_answers(gateway, "vision__scaler", secret), 10, "the gRPC twin in rotation")
    worker = worker_pid(gateway)

    with load_class(gateway, "vision__scaler", secret, threads=4, max_seconds=90) as load:
        load.wait_for_requests(300)
        pid = TritonInstance.objects.get(pk=first.pk).pid
        grpc = load_class is GrpcLoad  # the calls go to the slot's gRPC twin
        in_flight = server_row(gateway, backend, first.api_key, grpc)["scur"]  # a sample, just before
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        # Out of rotation: DOWN by the health check, or MAINT when the agent reported the crash first.
        out = ("DOWN", "MAINT")
        wait_for(lambda: server_status(gateway, backend, first.api_key).startswith(out), 2, "host-a out")
        assert time.monotonic() - killed_at <= 2.0
        load.wait_for_requests(300)
        # The agent restarts the instance; it comes back into rotation at run time.
        wait_for(lambda: server_status(gateway, backend, first.api_key) == "UP", 90, "host-a back")
        load.wait_for_requests(100)
    killed = server_row(gateway, backend, first.api_key, grpc)
    print(
        f"killed instance ({load_class.__name__}): {load.total} requests, statuses {dict(load.statuses)}; "
        f"{in_flight} in flight on it just before the kill; the gateway retried {killed['wretr']} and sent "
        f"{killed['wredis']} to the other instance (calls in flight when it died, or refused by it before it "
        "was out of rotation)"
    )
    assert load.failures == [], load.failures[:5]
    # The kill was felt: requests met the dead instance and were sent elsewhere, none failed.
    assert int(killed["wredis"]) > 0
    assert load.closed_by_gateway == 0
    assert load.statuses[200] >= 700
    assert worker_pid(gateway) == worker, "HAProxy was reloaded"


@under_load
def test_deploy_switch_and_undeploy_under_load_fail_no_request_and_never_reload(
    owner_client, owner, team, start_agent, make_scaler_version, start_gateway, make_token, load_class
):
    _, instance = ready_instance(start_agent, "host-a")
    scaler = RegisteredModel.objects.create(team=team, name="Scaler", slug="scaler", created_by=owner)
    other = RegisteredModel.objects.create(team=team, name="Other", slug="other", created_by=owner)
    make_scaler_version(scaler, 2.0)
    make_scaler_version(other, 5.0)
    deployment = deploy(owner_client, "vision", "scaler", 1, [instance])
    gateway = start_gateway()
    _, secret = make_token(name="load")
    wait_for(lambda: gateway.infer("vision__scaler", secret)[0] == 200, 10, "the first request")
    wait_for(lambda: grpc_answers(gateway, "vision__scaler", secret), 10, "the first gRPC request")
    worker = worker_pid(gateway)

    with load_class(gateway, "vision__scaler", secret, threads=3, max_seconds=200) as load:
        load.wait_for_requests(100)
        # Deploying another model takes a free backend slot and adds its servers at run time.
        second = deploy(owner_client, "vision", "other", 1, [instance])
        wait_for(
            lambda: gateway.infer("vision__other", secret)[1].get("outputs"), 10, "the new model's route"
        )
        assert gateway.infer("vision__other", secret)[1]["outputs"][0]["data"][0] == 5.0
        load.wait_for_requests(100)

        # Switching the other model's version: a map and weight change.
        other2 = make_scaler_version(other, 7.0)
        deployment_services.switch_version(actor=owner, deployment=second, version=other2)
        wait_for(
            lambda: Deployment.objects.filter(pk=second.pk, state=DeploymentState.SERVING, active_version=other2)
            .exists(),
            120,
            "the other model's switch to version 2",
        )  # fmt: skip
        wait_for(
            lambda: gateway.infer("vision__other", secret)[1].get("model_version") == "2", 10, "v2 routed"
        )
        load.wait_for_requests(100)

        # Switching the loaded model's own version: the old one answers until the new one took over.
        version2 = make_scaler_version(scaler, 3.0)
        deployment_services.switch_version(actor=owner, deployment=deployment, version=version2)
        wait_for(
            lambda: Deployment.objects.filter(pk=deployment.pk, state=DeploymentState.SERVING, active_version=version2)
            .exists(),
            120,
            "the switch to version 2",
        )  # fmt: skip
        wait_for(lambda: load.outputs[3.0] >= 50, 10, "answers from version 2")

        # Undeploying the other model removes its route and deletes its servers at run time.
        deployment_services.undeploy(actor=owner, deployment=second)
        wait_for(lambda: gateway.infer("vision__other", secret)[0] == 404, 15, "the undeployed model's 404")
        load.wait_for_requests(100)
    print(
        f"deploy/switch/undeploy ({load_class.__name__}): {load.total} requests, statuses {dict(load.statuses)}"
    )
    assert load.failures == [], load.failures[:5]
    assert load.closed_by_gateway == 0
    assert load.outputs[2.0] > 0 and load.outputs[3.0] > 0
    assert worker_pid(gateway) == worker, "HAProxy was reloaded"
    # Pinned again once the switch finished: unversioned requests get the active version.
    status, answer = gateway.infer("vision__scaler", secret)
    assert status == 200 and answer["model_version"] == "2"


def test_gateway_restart_restores_every_route(
    owner_client, owner, team, start_agent, make_scaler_version, start_gateway, make_token
):
    _, instance = ready_instance(start_agent, "host-a")
    for slug, scale in (("scaler", 2.0), ("other", 5.0)):
        model = RegisteredModel.objects.create(team=team, name=slug, slug=slug, created_by=owner)
        make_scaler_version(model, scale)
    _, secret = make_token(name="client")
    gateway = start_gateway()
    # Deployed while the gateway runs: routes and servers added at run time must be in the files too.
    for slug in ("scaler", "other"):
        deploy(owner_client, "vision", slug, 1, [instance])
    for model in ("vision__scaler", "vision__other"):
        wait_for(lambda m=model: gateway.infer(m, secret)[0] == 200, 10, f"{model} through the gateway")
    slots = (gateway.directory / "slots.map").read_text()
    gateway.stop()
    assert gateway.infer("vision__scaler", secret)[0] == 0  # nothing listens any more

    # The written files alone bring every route back (HAProxy started by hand, no database involved)...
    haproxy = subprocess.Popen(
        ["haproxy", "-db", "-f", str(gateway.directory / "haproxy.cfg")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for model in ("vision__scaler", "vision__other"):
            wait_for(lambda m=model: gateway.infer(m, secret)[0] == 200, 10, f"{model} from the files")
        assert gateway.infer("vision__scaler", "tgp_0_wrong")[0] == 401
    finally:
        haproxy.terminate()
        haproxy.wait(10)

    # ... and so does the gateway command, from the database, keeping every deployment's slot.
    restarted = start_gateway()
    for model in ("vision__scaler", "vision__other"):
        wait_for(lambda m=model: restarted.infer(m, secret)[0] == 200, 10, f"{model} after the restart")
    assert (restarted.directory / "slots.map").read_text() == slots
