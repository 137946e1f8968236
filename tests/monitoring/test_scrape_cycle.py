"""One scrape cycle over several instances: a hung instance costs the others nothing and is counted."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from apps.fleet.models import Host, TritonInstance
from apps.monitoring.models import InstanceMetrics, ModelMetrics, ScrapeState
from apps.monitoring.scraper import scrape_all
from apps.registry.models import ModelVersion, RegisteredModel

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def silent_port():
    """A port that accepts connections and never answers: a hung tritonserver."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield sock.getsockname()[1]
    sock.close()


def test_a_hung_instance_is_a_counted_failure_and_the_others_are_scraped(
    db, settings, team, owner, recorded_triton, silent_port
):
    settings.METRICS_SCRAPE_TIMEOUT = 1
    model = RegisteredModel.objects.create(team=team, name="Mlp", slug="mlp", created_by=owner)
    version = ModelVersion.objects.create(model=model, number=1, state="READY", created_by=owner)
    reshaper = RegisteredModel.objects.create(team=team, name="Reshaper", slug="reshaper", created_by=owner)
    ModelVersion.objects.create(model=reshaper, number=1, state="READY", created_by=owner)
    # The recorded payloads are of team "vision": the fixture team's slug.
    assert model.triton_model_name() == "vision__mlp"
    port = recorded_triton.server_address[1]
    good = TritonInstance.objects.create(
        host=Host.objects.create(name="good", address="127.0.0.1"),
        name="cpu-0", http_port=port, grpc_port=1, metrics_port=port, state="READY", pid=10,
    )  # fmt: skip
    hung = TritonInstance.objects.create(
        host=Host.objects.create(name="hung", address="127.0.0.1"),
        name="cpu-0", http_port=silent_port, grpc_port=1, metrics_port=silent_port, state="READY", pid=11,
    )  # fmt: skip

    first = scrape_all()
    assert (first.instances, first.failures, first.rows) == (2, 1, 0)  # the good one: a baseline

    recorded_triton.factor = 3
    started = time.monotonic()
    second = scrape_all()
    assert time.monotonic() - started < 5  # bounded by the timeout, not by the hung instance
    assert second.failures == 1 and "hung/cpu-0" in second.errors
    mlp = ModelMetrics.objects.get(version=version, instance=good)
    assert (mlp.success, mlp.failure) == (40, 0)
    # The reshaper's 2x3 new backend failures were Triton "successes": moved to the failures.
    other = ModelMetrics.objects.get(model=reshaper)
    assert (other.success, other.failure, other.failure_reasons) == (14 - 6, 6, {"BACKEND": 6})
    # The candidate's traffic is a switch's smoke test, not the model's.
    assert ModelMetrics.objects.count() == 2
    assert ScrapeState.objects.get(instance=hung).consecutive_failures == 2
    assert InstanceMetrics.objects.filter(instance=hung).values_list("scrape_failures", flat=True)[0] >= 1
    assert InstanceMetrics.objects.filter(instance=good, cpu_samples__gt=0).exists()
