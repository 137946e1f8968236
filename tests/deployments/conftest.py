"""Rows for deployment tests that need no tritonserver: hosts, instances and READY versions with a signature
(the classifier of seed example 3: input [N,3,224,224] -> output [N,1000])."""

from __future__ import annotations

import pytest
from django.utils import timezone

from apps.fleet.models import Host, InstanceState, TritonInstance
from apps.registry.models import ModelVersion, RegisteredModel, VersionState
from tests.fleet.conftest import artifact_root, make_ready_version, start_agent  # noqa: F401 - shared fixtures
from tests.gateway.conftest import gateway_env, start_gateway  # noqa: F401 - shared fixtures

CLASSIFIER_SIGNATURE = {
    "inputs": [{"name": "input", "dtype": "FP32", "dims": [3, 224, 224], "format": "NCHW"}],
    "outputs": [{"name": "output", "dtype": "FP32", "dims": [1000], "format": ""}],
    "batched": True,
}


@pytest.fixture
def shared_host(db):
    return Host.objects.create(name="local", address="127.0.0.1", last_heartbeat_at=timezone.now())


def add_instance(host: Host, name: str = "cpu-0", port: int = 18100) -> TritonInstance:
    return TritonInstance.objects.create(
        host=host,
        name=name,
        http_port=port,
        grpc_port=port + 1,
        metrics_port=port + 2,
        state=InstanceState.READY,
    )


@pytest.fixture
def instance(shared_host):
    return add_instance(shared_host)


@pytest.fixture
def model(team, owner):
    return RegisteredModel.objects.create(team=team, name="Classifier", slug="classifier", created_by=owner)


def make_version(model: RegisteredModel, number: int = 1, state: str = VersionState.READY) -> ModelVersion:
    return ModelVersion.objects.create(
        model=model, number=number, state=state, signature=CLASSIFIER_SIGNATURE, config_text=""
    )


@pytest.fixture
def version(model):
    return make_version(model, 1)
