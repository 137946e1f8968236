"""Fixtures for monitoring tests: the fleet's real host agents and READY versions, plus a READY version of
the model whose failures Triton counts (tests/monitoring/builders.py)."""

from __future__ import annotations

import pytest

from apps.registry.models import ModelVersion, RegisteredModel, VersionState
from tests.factories import ready_onnx_version
from tests.fleet.conftest import artifact_root, make_ready_version, start_agent  # noqa: F401 - fixtures
from tests.monitoring.builders import reshaping_onnx


def reshaper_version(model: RegisteredModel, owner, tmp_path) -> ModelVersion:
    """The model's next version, READY: the reshaping ONNX model prepared for the CPU executor."""
    return ready_onnx_version(model, reshaping_onnx(), tmp_path, created_by=owner)


@pytest.fixture
def make_reshaper_version(team, owner, artifact_root, tmp_path):  # noqa: F811 - the imported fixture
    def _make(slug: str = "reshaper") -> ModelVersion:
        model = RegisteredModel.objects.create(team=team, name=slug.title(), slug=slug, created_by=owner)
        return reshaper_version(model, owner, tmp_path)

    return _make


@pytest.fixture
def metrics_setup(team, owner):
    """A model with two versions served on one instance of a shared host, and a writer of minute rows."""
    from datetime import timedelta

    from django.utils import timezone

    from apps.fleet.models import Host, TritonInstance
    from apps.monitoring.models import ModelMetrics

    host = Host.objects.create(name="metrics-host", address="127.0.0.1")
    instance = TritonInstance.objects.create(
        host=host, name="cpu-0", http_port=18000, grpc_port=18001, metrics_port=18002, state="READY"
    )
    model = RegisteredModel.objects.create(team=team, name="Classifier", slug="classifier", created_by=owner)
    versions = [
        ModelVersion.objects.create(model=model, number=n, state=VersionState.READY, created_by=owner)
        for n in (1, 2)
    ]

    def write(version, minutes_ago: int, success: int, failure: int = 0, now=None, **fields) -> ModelMetrics:
        bucket = (now or timezone.now()).replace(second=0, microsecond=0) - timedelta(minutes=minutes_ago)
        return ModelMetrics.objects.create(
            bucket=bucket,
            team=team,
            model=model,
            version=version,
            instance=instance,
            success=success,
            failure=failure,
            failure_reasons={"BACKEND": failure} if failure else {},
            inferences=success + failure,
            executions=max(1, (success + failure) // 2),
            request_us=(success + failure) * 1500.0,
            queue_us=(success + failure) * 200.0,
            **fields,
        )

    return {"host": host, "instance": instance, "model": model, "versions": versions, "write": write}
