"""Downsampling and retention with a frozen clock, chart JSON, tenancy of the metrics endpoints, /metrics."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.test import Client

from apps.core.periods import HOUR, MINUTE
from apps.fleet.models import Host, TritonInstance
from apps.monitoring import rollups
from apps.monitoring.models import InstanceMetrics, ModelMetrics, ScrapeState

NOW = datetime(2025, 3, 20, 12, 30, 10, tzinfo=UTC)


@pytest.fixture
def frozen(monkeypatch):
    monkeypatch.setattr("django.utils.timezone.now", lambda: NOW)
    return NOW


def test_minutes_become_hours_after_seven_days_and_everything_goes_after_ninety(
    metrics_setup, frozen, settings
):
    write, (v1, _) = metrics_setup["write"], metrics_setup["versions"]
    eight_days = 8 * 24 * 60
    # Two minutes of one hour 8 days ago, with quantiles weighted 1:3.
    write(v1, eight_days, 10, 2, p99_us=1000.0, quantile_requests=12)
    write(v1, eight_days - 1, 30, 0, p99_us=2000.0, quantile_requests=30)
    write(v1, 60, 5)  # recent: stays a minute row
    write(v1, 91 * 24 * 60, 99)  # older than the retention
    InstanceMetrics.objects.create(
        bucket=NOW - timedelta(days=8),
        instance=metrics_setup["instance"],
        scrapes=4,
        cpu_utilization_sum=2,
        cpu_samples=4,
    )

    result = rollups.downsample()
    assert result["dropped"] == 1

    hours = ModelMetrics.objects.filter(period_seconds=HOUR)
    assert hours.count() == 1
    hour = hours.get()
    assert (hour.success, hour.failure, hour.failure_reasons) == (40, 2, {"BACKEND": 2})
    assert hour.bucket.minute == 0 and hour.p99_us == pytest.approx((1000 * 12 + 2000 * 30) / 42)
    assert list(ModelMetrics.objects.filter(period_seconds=MINUTE).values_list("success", flat=True)) == [5]
    assert InstanceMetrics.objects.get().period_seconds == HOUR

    # Idempotent, and a late minute of an already folded hour is added to it.
    assert rollups.downsample()["folded"] == 0
    write(v1, eight_days - 2, 1)
    rollups.downsample()
    assert ModelMetrics.objects.get(period_seconds=HOUR).success == 41

    settings.METRICS_RETENTION_DAYS = 7  # configurable: now the hourly row is too old
    rollups.downsample()
    assert not ModelMetrics.objects.filter(period_seconds=HOUR).exists()


def test_model_chart_json_has_one_line_per_version(metrics_setup, viewer_client, frozen):
    write, (v1, v2) = metrics_setup["write"], metrics_setup["versions"]
    write(v1, 3, 120, 6, client_errors=4)
    write(v2, 2, 60, 0, p50_us=1000, p95_us=2000, p99_us=3000, quantile_requests=60)
    response = viewer_client.get("/api/v1/teams/vision/models/classifier/metrics/?range=1h")
    assert response.status_code == 200, response.content
    data = response.json()
    assert data["step_seconds"] == 60 and len(data["timestamps"]) == 60
    lines = {v["version"]: v for v in data["versions"]}
    assert set(lines) == {1, 2}
    assert sum(lines[1]["requests_per_second"]) == pytest.approx(126 / 60, abs=1e-3)
    assert max(e for e in lines[1]["error_rate"] if e is not None) == pytest.approx(6 / 126, abs=1e-4)
    assert max(a for a in lines[1]["avg_batch_size"] if a is not None) == pytest.approx(2.0)
    assert data["latency"] == "quantiles" and max(p for p in lines[2]["p99_ms"] if p) == pytest.approx(3.0)
    assert data["totals"] == {
        "requests": 186,
        "success": 180,
        "failure": 6,
        "client_errors": 4,
        "error_rate": pytest.approx(6 / 186, abs=1e-4),  # bad requests are not in the rate
    }
    assert sum(lines[1]["client_errors_per_second"]) == pytest.approx(4 / 60, abs=1e-3)
    assert data["failure_reasons"] == {"BACKEND": 6}

    week = viewer_client.get("/api/v1/teams/vision/models/classifier/metrics/?range=7d").json()
    assert week["step_seconds"] == 3600 and len(week["timestamps"]) == 168
    assert viewer_client.get("/api/v1/teams/vision/models/classifier/metrics/?range=2y").status_code == 400


def test_outsider_gets_404_for_model_metrics_and_sees_none_of_the_teams_traffic(
    metrics_setup, outsider_client, frozen
):
    metrics_setup["write"](metrics_setup["versions"][0], 1, 50)
    assert outsider_client.get("/api/v1/teams/vision/models/classifier/metrics/").status_code == 404
    # The instance is on a shared host: visible, but without the other team's traffic.
    instance = metrics_setup["instance"]
    data = outsider_client.get(f"/api/v1/instances/{instance.pk}/metrics/").json()
    assert sum(data["requests_per_second"]) == 0
    fleet = outsider_client.get("/api/v1/metrics/fleet/").json()
    assert fleet["totals"]["requests"] == 0 and fleet["busiest_models"] == []


def test_instance_and_fleet_metrics_for_a_member(metrics_setup, viewer_client, frozen):
    metrics_setup["write"](metrics_setup["versions"][0], 1, 50, 5)
    instance = metrics_setup["instance"]
    InstanceMetrics.objects.create(
        bucket=NOW.replace(second=0) - timedelta(minutes=1), instance=instance, scrapes=4, scrape_failures=1,
        cpu_utilization_sum=1.0, cpu_samples=4,
    )  # fmt: skip
    data = viewer_client.get(f"/api/v1/instances/{instance.pk}/metrics/").json()
    assert max(data["cpu_percent"][-3:], key=lambda v: v or 0) == 25.0 and sum(data["scrape_failures"]) == 1
    fleet = viewer_client.get("/api/v1/metrics/fleet/?range=6h").json()
    assert fleet["totals"]["requests"] == 55 and fleet["busiest_models"][0]["model"] == "classifier"
    assert fleet["instances_by_state"]["READY"] == 1


def test_a_dedicated_host_of_another_team_is_a_404(metrics_setup, outsider_client, team):
    host = Host.objects.create(name="private", address="127.0.0.1", team=team)
    private = TritonInstance.objects.create(host=host, name="cpu-0", http_port=1, grpc_port=2, metrics_port=3)
    assert outsider_client.get(f"/api/v1/instances/{private.pk}/metrics/").status_code == 404


def test_metrics_pages_render_for_members_and_404_for_outsiders(metrics_setup, viewer, outsider):
    client = Client()
    client.force_login(viewer)
    page = client.get("/teams/vision/models/classifier/metrics/?range=24h")
    assert page.status_code == 200 and b'data-range="24h"' in page.content
    assert client.get("/fleet/metrics/").status_code == 200
    assert client.get("/hosts/metrics-host/instances/cpu-0/metrics/").status_code == 200
    client.force_login(outsider)
    assert client.get("/teams/vision/models/classifier/metrics/").status_code == 404


# ------------------------------------------------------------------------------------------ /metrics
def test_metrics_from_an_allowed_address(db, metrics_setup):
    ScrapeState.objects.create(instance=metrics_setup["instance"], total_failures=3)
    Client().get("/healthz")
    response = Client(REMOTE_ADDR="127.0.0.1").get("/metrics")
    assert response.status_code == 200
    text = response.content.decode()
    assert 'platform_triton_instances{state="READY"} 1.0' in text
    assert 'platform_metrics_scrape_failures_total{host="metrics-host",instance="cpu-0"} 3.0' in text
    assert 'platform_http_requests_total{method="GET",route="healthz",status="200"}' in text
    assert "platform_conversion_job_duration_seconds_bucket" in text
    assert 'platform_conversion_jobs{state="QUEUED"}' in text


def test_metrics_refused_elsewhere_and_open_to_the_token(db, settings):
    settings.METRICS_TOKEN = "s3cret-token"
    outside = Client(REMOTE_ADDR="10.1.2.3")
    assert outside.get("/metrics").status_code == 404
    assert outside.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 403
    assert outside.get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret-token").status_code == 200
    settings.METRICS_ALLOWED_IPS = ["10.1.0.0/16"]
    assert outside.get("/metrics").status_code == 200
    settings.METRICS_TOKEN = ""
    assert outside.get("/metrics", HTTP_AUTHORIZATION="Bearer anything").status_code == 403


def test_targets_json_lists_every_instance_for_file_based_discovery(db, metrics_setup):
    data = Client(REMOTE_ADDR="::1").get("/metrics/targets.json").json()
    assert data == [
        {
            "targets": ["127.0.0.1:18002"],
            "labels": {"host": "metrics-host", "instance": "cpu-0", "__metrics_path__": "/metrics"},
        },
        # The inference gateway's HAProxy exporter.
        {"targets": ["127.0.0.1:8404"], "labels": {"job": "gateway", "__metrics_path__": "/metrics"}},
    ]
    assert Client(REMOTE_ADDR="192.0.2.1").get("/metrics/targets.json").status_code == 404


def test_route_labels_are_route_names_not_paths(metrics_setup, viewer_client):
    viewer_client.get("/api/v1/teams/vision/models/classifier/metrics/")
    text = Client(REMOTE_ADDR="127.0.0.1").get("/metrics").content.decode()
    assert 'route="team-model-metrics"' in text and "classifier" not in text
