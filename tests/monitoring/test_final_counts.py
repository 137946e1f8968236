"""Final counts read just before an unload: folded exactly once, whatever the order of reports and scrapes.

Readings are Prometheus text in Triton's format, parsed by the scraper's own parser; the real-Triton test of a
switch and an undeploy is in ``test_final_counts_live.py``.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db.models import Sum

from apps.deployments.models import Deployment, DeploymentInstance, DeploymentState
from apps.fleet.models import Host, TritonInstance
from apps.monitoring.models import ModelMetrics, ScrapeState
from apps.monitoring.scraper import Fetched, ModelNames, record_scrape
from apps.monitoring.services import record_final_counts
from apps.registry.models import ModelVersion, RegisteredModel
from backend_ge import triton_metrics

pytestmark = pytest.mark.django_db
T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
NAME = "vision__mlp"


def text(counts: dict[str, int], name: str = NAME) -> str:
    """Triton's /metrics for ``{version: successful requests}`` (one failure per 10 successes, BACKEND)."""
    lines = ["# TYPE nv_inference_request_success counter"]
    lines += [f'nv_inference_request_success{{model="{name}",version="{v}"}} {n}' for v, n in counts.items()]
    lines += ["# TYPE nv_inference_request_failure counter"]
    lines += [
        f'nv_inference_request_failure{{model="{name}",reason="BACKEND",version="{v}"}} {n // 10}'
        for v, n in counts.items()
    ]
    lines += ["# TYPE nv_inference_count counter"]
    lines += [f'nv_inference_count{{model="{name}",version="{v}"}} {n + n // 10}' for v, n in counts.items()]
    return "\n".join(lines) + "\n"


@pytest.fixture
def setup(team, owner):
    return served_mlp(team, owner)


def served_mlp(team, owner) -> dict:
    """Versions 1 and 2 of vision's mlp, the first served on an instance whose server is pid 100."""
    host = Host.objects.create(name="fc-host", address="127.0.0.1")
    instance = TritonInstance.objects.create(
        host=host, name="cpu-0", http_port=1, grpc_port=2, metrics_port=3, state="READY", pid=100
    )
    model = RegisteredModel.objects.create(team=team, name="Mlp", slug="mlp", created_by=owner)
    versions = {
        n: ModelVersion.objects.create(model=model, number=n, state="READY", created_by=owner) for n in (1, 2)
    }
    deployment = Deployment.objects.create(
        team=team, model=model, active_version=versions[1], state=DeploymentState.SERVING
    )
    DeploymentInstance.objects.create(deployment=deployment, instance=instance, served_version=versions[1])
    return {"instance": instance, "versions": versions, "model": model}


def scrape(instance, counts: dict[str, int], at: datetime, server: str = "100") -> None:
    reading = triton_metrics.parse_metrics(text(counts))
    record_scrape(Fetched(instance, at, server, reading), ModelNames.load(), now=at)


def report(counts: dict[str, int], at: datetime, server: str = "100", versions=None) -> dict:
    return {
        "model": NAME,
        "versions": versions if versions is not None else sorted(counts),
        "server_id": server,
        "read_at": at.isoformat(),
        "metrics": text(counts),
        "statistics": [],
    }


def counted(version) -> tuple[int, int]:
    sums = ModelMetrics.objects.filter(version=version).aggregate(s=Sum("success"), f=Sum("failure"))
    return sums["s"] or 0, sums["f"] or 0


def test_a_report_before_the_next_scrape_counts_the_rest_once_even_when_sent_twice(setup):
    instance, v1 = setup["instance"], setup["versions"][1]
    scrape(instance, {"1": 0}, T0)
    scrape(instance, {"1": 100}, T0 + timedelta(seconds=15))
    final = report({"1": 140}, T0 + timedelta(seconds=20))
    assert record_final_counts(instance.pk, final, now=T0 + timedelta(seconds=21)) == 1
    assert counted(v1) == (140, 14)
    # A retry of the same report (the agent did not see the answer) counts nothing.
    record_final_counts(instance.pk, final, now=T0 + timedelta(seconds=22))
    assert counted(v1) == (140, 14)
    # A scrape that still sees the version (the unload was not done yet) counts only what came after.
    scrape(instance, {"1": 142}, T0 + timedelta(seconds=25))
    assert counted(v1) == (142, 14)
    # Unloaded: the next scrape has no v1 at all, and the report again changes nothing.
    scrape(instance, {}, T0 + timedelta(seconds=40))
    record_final_counts(instance.pk, final, now=T0 + timedelta(seconds=41))
    assert counted(v1) == (142, 14)


def test_a_report_arriving_after_the_scrape_that_found_the_version_gone_counts_from_the_last_reading(setup):
    instance, v1 = setup["instance"], setup["versions"][1]
    scrape(instance, {"1": 0}, T0)
    scrape(instance, {"1": 100}, T0 + timedelta(seconds=15))
    scrape(instance, {"2": 5}, T0 + timedelta(seconds=30))  # v1 is gone; its last 40 are still to come
    state = ScrapeState.objects.get(instance=instance)
    assert state.retired[f"{NAME}|1"]["counters"]["success"] == 100
    record_final_counts(
        instance.pk, report({"1": 140}, T0 + timedelta(seconds=20)), now=T0 + timedelta(seconds=31)
    )
    assert counted(v1) == (140, 14)


def test_a_report_older_than_a_scrape_that_saw_more_counts_nothing(setup):
    instance, v1 = setup["instance"], setup["versions"][1]
    scrape(instance, {"1": 0}, T0)
    scrape(instance, {"1": 150}, T0 + timedelta(seconds=30))
    record_final_counts(
        instance.pk, report({"1": 140}, T0 + timedelta(seconds=20)), now=T0 + timedelta(seconds=31)
    )
    assert counted(v1) == (150, 15)


def test_a_version_loaded_and_unloaded_between_two_scrapes_is_counted_whole_and_once(setup):
    instance, v2 = setup["instance"], setup["versions"][2]
    scrape(instance, {"1": 0}, T0)
    record_final_counts(
        instance.pk, report({"2": 30}, T0 + timedelta(seconds=5)), now=T0 + timedelta(seconds=6)
    )
    assert counted(v2) == (30, 3)
    scrape(instance, {"1": 0, "2": 31}, T0 + timedelta(seconds=15))  # the unload came after this scrape
    assert counted(v2) == (31, 3)


def test_after_a_restart_a_report_of_the_new_process_is_not_counted_again_by_its_first_scrape(setup):
    instance, v1 = setup["instance"], setup["versions"][1]
    scrape(instance, {"1": 0}, T0)
    scrape(instance, {"1": 50}, T0 + timedelta(seconds=15))
    # The server restarted (pid 200), served 20, and v1 is unloaded before the scraper read the new process.
    record_final_counts(
        instance.pk,
        report({"1": 20}, T0 + timedelta(seconds=20), server="200"),
        now=T0 + timedelta(seconds=21),
    )
    assert counted(v1) == (70, 7)
    scrape(instance, {"1": 22}, T0 + timedelta(seconds=30), server="200")
    assert counted(v1) == (72, 7)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model": "../etc"}, "model must be"),
        ({"versions": [1]}, "versions must be"),
        ({"server_id": "pid; rm"}, "server_id must be"),
        ({"read_at": "yesterday"}, "read_at must be"),
        ({"metrics": "x" * (600 * 1024)}, "metrics must be"),
        ({"metrics": 'nv_inference_count{model="vision__mlp" 3\n'}, "do not parse"),
        ({"statistics": "all"}, "statistics must be"),
        # Counts that no tritonserver reports: out of bigint's range, beyond float, NaN, negative.
        *[
            ({"metrics": text({"1": 5}).replace(" 5\n", f" {value}\n")}, "is not a count")
            for value in (10**30, 2**63, "1e300", "NaN", "+Inf", -5)
        ],
        *[
            ({"statistics": [{"name": NAME, "version": "1", "batch_stats": [batch]}]}, message)
            for batch, message in (
                ({"batch_size": 1, "compute_infer": {"count": 10**400}}, "is not a count"),
                ({"batch_size": 1, "compute_infer": {"count": "5"}}, "is not a number"),
                ({"batch_size": "x" * 10_000, "compute_infer": {"count": 1}}, "is not a batch size"),
                ({"batch_size": 0, "compute_infer": {"count": 1}}, "is not a batch size"),
            )
        ],
        ({"read_at": (T0 - timedelta(hours=2)).isoformat()}, "too old"),
    ],
)
def test_a_malformed_report_is_refused_with_what_to_fix(setup, change, message):
    instance = setup["instance"]
    scrape(instance, {"1": 0}, T0)
    with pytest.raises(ValueError, match=message):
        record_final_counts(instance.pk, {**report({"1": 5}, T0), **change}, now=T0 + timedelta(seconds=1))
    assert counted(setup["versions"][1]) == (0, 0)


def test_a_host_cannot_fold_counts_of_a_model_not_placed_on_its_instance(setup, team, owner):
    other = RegisteredModel.objects.create(team=team, name="Other", slug="other", created_by=owner)
    ModelVersion.objects.create(model=other, number=1, state="READY", created_by=owner)
    forged = {**report({"1": 5}, T0), "model": "vision__other", "metrics": text({"1": 5}, "vision__other")}
    with pytest.raises(ValueError, match="not placed"):
        record_final_counts(setup["instance"].pk, forged, now=T0 + timedelta(seconds=1))
    # Lines of another model inside a report are ignored, not folded.
    mixed = {**report({"1": 5}, T0), "metrics": text({"1": 5}) + text({"1": 9}, "vision__other")}
    record_final_counts(setup["instance"].pk, mixed, now=T0 + timedelta(seconds=1))
    assert ModelMetrics.objects.filter(model=other).count() == 0
    assert counted(setup["versions"][1]) == (5, 0)
