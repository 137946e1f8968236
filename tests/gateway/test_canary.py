"""The canary split during a live rollout, through real HAProxy to real tritonservers serving two versions,
over HTTP and over gRPC (where the gateway pins the chosen version by rewriting the message).

Two instances: ``a`` serves the stable version 1 (x2) and the canary version 2 (x3) and reports the canary;
``b`` serves only version 1. Requests that name no version go to the canary with the rollout's weight, a
request naming a version gets it, canary-routed requests only reach ``a``, and a weight change is a map change
at run time (no reload, nothing dropped).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from apps.deployments.models import (
    Deployment,
    DeploymentInstance,
    DeploymentState,
    PlacementState,
    Rollout,
    RolloutState,
)
from apps.fleet.models import Host, InstanceState, TritonInstance
from apps.gateway.haproxy import AdminSocket
from apps.registry.models import RegisteredModel
from backend_ge.runtime import TritonServer
from hostagent.repository import materialize_model
from tests.conftest import wait_for
from tests.support.servers import Load, grpc_answers, requires_haproxy, server_status, slot_of, worker_pid

pytestmark = [pytest.mark.triton, requires_haproxy, pytest.mark.django_db(transaction=True)]

STABLE, CANARY = 2.0, 3.0  # the first output of each version for the input [1, 2, 3, 4]


@pytest.fixture
def rollout(team, owner, make_scaler_version, tmp_path):
    team.quota_requests_per_second = 1_000_000
    team.save()
    model = RegisteredModel.objects.create(team=team, name="Scaler", slug="scaler", created_by=owner)
    v1, v2 = make_scaler_version(model, STABLE), make_scaler_version(model, CANARY)
    host = Host.objects.create(name="canary-host", address="127.0.0.1")
    deployment = Deployment.objects.create(
        team=team, model=model, active_version=v1, state=DeploymentState.SERVING, created_by=owner
    )
    servers = []
    for name, versions in (("a", {1: v1, 2: v2}), ("b", {1: v1})):
        repository = tmp_path / f"repository-{name}"
        served = {number: version.servable_dir() for number, version in versions.items()}
        materialize_model(repository, "vision__scaler", served, v1.config_text)
        instance = TritonInstance(host=host, name=f"cpu-{name}", http_port=0, grpc_port=0, metrics_port=0)
        server = TritonServer(
            repository, workdir=tmp_path / f"triton-{name}", api_key=instance.api_key, open_apis=("health",),
            load_models=["vision__scaler"], exit_timeout=10,
        )  # fmt: skip
        servers.append(server.start(timeout=120))
        instance.http_port, instance.grpc_port, instance.metrics_port = (
            server.http_port, server.grpc_port, server.metrics_port
        )  # fmt: skip
        instance.state = InstanceState.READY
        instance.save()
        DeploymentInstance.objects.create(
            deployment=deployment, instance=instance, served_version=v1, state=PlacementState.READY,
            canary_version=v2 if 2 in versions else None,
        )  # fmt: skip
    rollout = Rollout.objects.create(
        deployment=deployment, stable_version=v1, canary_version=v2, current_weight=30, created_by=owner
    )
    yield rollout
    for server in servers:
        server.stop()


def routed_weight(gateway, model: str) -> int:
    """The canary weight HAProxy routes by now (its runtime map, not the file)."""
    answer = AdminSocket(gateway.directory / "admin.sock").ask(f"show map {gateway.directory}/models.map")
    for line in answer.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] == model:
            return int(parts[2].split("/")[6])
    return -1


def set_weight(rollout: Rollout, gateway, weight: int) -> None:
    rollout.current_weight = weight
    rollout.save(update_fields=["current_weight", "updated_at"])  # the gateway is poked on commit
    wait_for(lambda: routed_weight(gateway, "vision__scaler") == weight, 10, f"weight {weight} in the map")


def first_outputs(gateway, secret: str, count: int, version: int | None = None) -> Counter:
    outputs = Counter()
    for _ in range(count):
        status, answer = gateway.infer("vision__scaler", secret, version)
        outputs[answer["outputs"][0]["data"][0] if status == 200 else f"status {status}"] += 1
    return outputs


def test_canary_split_follows_the_rollout_weight(rollout, start_gateway, make_token):
    gateway = start_gateway()
    _, secret = make_token(name="canary")
    deployment = f"d{rollout.deployment_id}"
    a, b = (p.instance for p in rollout.deployment.placements.order_by("instance__name"))
    wait_for(lambda: server_status(gateway, f"{deployment}c", a.api_key) == "UP", 15, "the canary server")
    wait_for(lambda: server_status(gateway, deployment, b.api_key) == "UP", 15, "the stable servers")
    wait_for(lambda: gateway.infer("vision__scaler", secret)[0] == 200, 10, "the token to be known")
    # Only the placement that reports the canary is in the canary's backend.
    assert server_status(gateway, f"{deployment}c", b.api_key) == "absent"
    assert slot_of(gateway, f"{deployment}c") != slot_of(gateway, deployment)
    worker = worker_pid(gateway)

    # 30 %: measured over 600 requests (4 standard deviations of tolerance each way).
    outputs = first_outputs(gateway, secret, 600)
    assert set(outputs) == {STABLE, CANARY}, outputs
    share = outputs[CANARY] / 600
    print(f"canary share at weight 30: {share:.3f} ({dict(outputs)})")
    assert 0.22 <= share <= 0.38, outputs

    # A request naming a version gets that version, whatever the weight.
    assert first_outputs(gateway, secret, 40, version=2) == {CANARY: 40}
    assert first_outputs(gateway, secret, 40, version=1) == {STABLE: 40}

    # 0 % and 100 % are exact (rand(100) draws 0..99).
    set_weight(rollout, gateway, 0)
    assert first_outputs(gateway, secret, 200) == {STABLE: 200}
    assert first_outputs(gateway, secret, 20, version=2) == {CANARY: 20}
    set_weight(rollout, gateway, 100)
    assert first_outputs(gateway, secret, 200) == {CANARY: 200}
    assert first_outputs(gateway, secret, 20, version=1) == {STABLE: 20}

    # Weight changes under load: map changes at run time, nothing dropped.
    with Load(gateway, "vision__scaler", secret, threads=3, max_seconds=90) as load:
        for weight in (10, 50, 90, 0, 100, 25):
            set_weight(rollout, gateway, weight)
            load.wait_for_requests(150)
    print(f"weight changes under load: {load.total} requests, statuses {dict(load.statuses)}")
    assert load.failures == [], load.failures[:5]
    assert load.closed_by_gateway == 0
    assert load.outputs[STABLE] > 0 and load.outputs[CANARY] > 0
    assert worker_pid(gateway) == worker, "HAProxy was reloaded"

    # The rollout ends: every unversioned request is stable again and the canary's backend is emptied.
    rollout.state = RolloutState.ABORTED
    rollout.current_weight = 0
    rollout.save()
    wait_for(lambda: routed_weight(gateway, "vision__scaler") == 0, 10, "the route without a canary")
    assert first_outputs(gateway, secret, 100) == {STABLE: 100}
    wait_for(lambda: slot_of(gateway, f"{deployment}c") == "absent", 10, "the canary's slot released")
    assert worker_pid(gateway) == worker, "HAProxy was reloaded"


def test_no_canary_traffic_while_no_placement_serves_it(rollout, start_gateway, make_token):
    # The agent has not reported the canary anywhere yet: the rollout's weight is not applied.
    DeploymentInstance.objects.filter(deployment=rollout.deployment).update(canary_version=None)
    gateway = start_gateway()
    _, secret = make_token(name="canary")
    wait_for(lambda: gateway.infer("vision__scaler", secret)[0] == 200, 15, "the stable route")
    assert routed_weight(gateway, "vision__scaler") == 0
    assert first_outputs(gateway, secret, 100) == {STABLE: 100}
    # No canary backend at all: a request naming version 2 goes where the stable version is served.
    assert slot_of(gateway, f"d{rollout.deployment_id}c") == "absent"


def grpc_first_outputs(client, secret: str, count: int, version: str = "") -> Counter:
    data = np.array([[1.0, 2.0, 3.0, 4.0]], dtype=np.float32)
    item = grpcclient.InferInput("input", list(data.shape), "FP32")
    item.set_data_from_numpy(data)
    outputs = Counter()
    for _ in range(count):
        try:
            result = client.infer(
                "vision__scaler", [item], model_version=version, headers={"authorization": f"Bearer {secret}"}
            )
            outputs[float(result.as_numpy("output")[0][0])] += 1
        except InferenceServerException as exc:
            outputs[exc.status()] += 1
    return outputs


def test_grpc_canary_split_follows_the_rollout_weight(rollout, start_gateway, make_token):
    gateway = start_gateway()
    _, secret = make_token(name="canary")
    deployment = f"d{rollout.deployment_id}"
    a, b = (p.instance for p in rollout.deployment.placements.order_by("instance__name"))
    wait_for(lambda: server_status(gateway, f"{deployment}c", a.api_key) == "UP", 15, "the canary server")
    wait_for(lambda: server_status(gateway, deployment, b.api_key) == "UP", 15, "the stable servers")
    wait_for(lambda: grpc_answers(gateway, "vision__scaler", secret), 15, "the first gRPC answer")
    client = grpcclient.InferenceServerClient(gateway.grpc_url)

    # 30 % over 2,000 unversioned calls, within 5 points (the binomial's standard deviation is 1 point).
    outputs = grpc_first_outputs(client, secret, 2000)
    share = outputs[CANARY] / 2000
    print(f"gRPC canary share at weight 30: {share:.3f} ({dict(outputs)})")
    assert set(outputs) == {STABLE, CANARY}, outputs
    assert 0.25 <= share <= 0.35, outputs

    # A call naming a version gets it, whatever the weight.
    assert grpc_first_outputs(client, secret, 50, version="2") == {CANARY: 50}
    assert grpc_first_outputs(client, secret, 50, version="1") == {STABLE: 50}

    # 0 % and 100 % are exact: the pin the gateway writes into the message decides, not Triton's default.
    set_weight(rollout, gateway, 0)
    assert grpc_first_outputs(client, secret, 200) == {STABLE: 200}
    assert grpc_first_outputs(client, secret, 20, version="2") == {CANARY: 20}
    set_weight(rollout, gateway, 100)
    assert grpc_first_outputs(client, secret, 200) == {CANARY: 200}
    assert grpc_first_outputs(client, secret, 20, version="1") == {STABLE: 20}
    client.close()
