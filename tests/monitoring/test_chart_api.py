"""The chart JSON for operating: the 15-minute range, real percentiles from recorded Triton payloads, the
labelled mean where summaries are off, deploy/switch/rollback markers, one version or one deployment."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.deployments.models import Deployment, DeploymentEvent, DeploymentInstance
from apps.fleet.models import Host, TritonInstance
from apps.monitoring.scraper import scrape_all
from apps.monitoring.services import AVERAGE_LABEL
from apps.registry.models import ModelVersion, RegisteredModel

API = "/api/v1/teams/vision/models/classifier/metrics/"


def _event(deployment, kind, version=None, minutes_ago=5):
    event = DeploymentEvent.objects.create(deployment=deployment, kind=kind, message=kind, version=version)
    DeploymentEvent.objects.filter(pk=event.pk).update(
        created_at=timezone.now() - timedelta(minutes=minutes_ago)
    )
    return event


def test_fifteen_minute_range_has_one_point_per_minute(metrics_setup, viewer_client):
    write, (v1, _) = metrics_setup["write"], metrics_setup["versions"]
    write(v1, 2, 60)
    write(v1, 30, 999)  # outside 15 minutes
    data = viewer_client.get(API, {"range": "15m"}).json()
    assert data["range"] == "15m" and data["step_seconds"] == 60 and len(data["timestamps"]) == 15
    assert data["totals"]["requests"] == 60


def test_percentiles_come_from_the_recorded_triton_summaries(db, team, owner, viewer_client, recorded_triton):
    model = RegisteredModel.objects.create(team=team, name="Mlp", slug="mlp", created_by=owner)
    ModelVersion.objects.create(model=model, number=1, state="READY", created_by=owner)
    port = recorded_triton.server_address[1]
    TritonInstance.objects.create(
        host=Host.objects.create(name="recorded", address="127.0.0.1"),
        name="cpu-0", http_port=port, grpc_port=1, metrics_port=port, state="READY", pid=10,
        latency_summaries=True,
    )  # fmt: skip
    scrape_all()  # baseline
    recorded_triton.factor = 2
    scrape_all()

    data = viewer_client.get("/api/v1/teams/vision/models/mlp/metrics/", {"range": "15m"}).json()
    assert data["latency"] == "quantiles" and data["latency_label"] == "p50 / p95 / p99"
    (line,) = data["versions"]
    assert line["latency"] == "quantiles"
    # Recorded: vision__mlp v1 request summary p50 656 us, p95 916 us, p99 916 us (not the mean).
    assert max(v for v in line["p50_ms"] if v is not None) == pytest.approx(0.656)
    assert max(v for v in line["p95_ms"] if v is not None) == pytest.approx(0.916)
    assert max(v for v in line["p99_ms"] if v is not None) == pytest.approx(0.916)
    mean = max(v for v in line["avg_latency_ms"] if v is not None)
    assert mean != pytest.approx(0.916)


def test_without_summaries_the_latency_is_a_labelled_mean_not_a_percentile(metrics_setup, viewer_client):
    write, (v1, _) = metrics_setup["write"], metrics_setup["versions"]
    write(v1, 1, 100)
    data = viewer_client.get(API, {"range": "1h"}).json()
    assert data["latency"] == "average" and data["latency_label"] == AVERAGE_LABEL
    (line,) = data["versions"]
    assert all(v is None for v in line["p99_ms"])
    assert max(v for v in line["avg_latency_ms"] if v is not None) == pytest.approx(1.5)


def test_markers_are_the_deploys_switches_and_rollbacks_in_the_range(metrics_setup, viewer_client):
    model, (v1, v2) = metrics_setup["model"], metrics_setup["versions"]
    deployment = Deployment.objects.create(team=model.team, model=model, active_version=v1)
    _event(deployment, "deployed", v1, minutes_ago=50)
    _event(deployment, "switch_requested", v2, minutes_ago=20)
    _event(deployment, "switch_failed", v2, minutes_ago=19)
    _event(deployment, "serving", v1, minutes_ago=18)  # a state report, not a marker
    _event(deployment, "switched", v2, minutes_ago=120)  # before the 1 h range

    data = viewer_client.get(API, {"range": "1h"}).json()
    assert [(m["kind"], m["label"]) for m in data["markers"]] == [
        ("deployed", "deployed v1"),
        ("switch_requested", "switch v2"),
        ("switch_failed", "rollback v2"),
    ]
    first = data["markers"][0]
    assert data["timestamps"][0] <= first["time"] < data["timestamps"][-1] + 60
    assert first["deployment"] == deployment.pk and first["version"] == 1

    wider = viewer_client.get(API, {"range": "6h"}).json()
    assert "switched" in [m["kind"] for m in wider["markers"]]


def test_one_version_and_one_deployment_can_be_focused(metrics_setup, viewer_client, owner):
    write, model, (v1, v2) = metrics_setup["write"], metrics_setup["model"], metrics_setup["versions"]
    write(v1, 3, 10)
    write(v2, 3, 20)
    assert [v["version"] for v in viewer_client.get(API, {"version": 2}).json()["versions"]] == [2]

    deployment = Deployment.objects.create(team=model.team, model=model, active_version=v2)
    DeploymentInstance.objects.create(deployment=deployment, instance=metrics_setup["instance"])
    _event(deployment, "deployed", v2)
    data = viewer_client.get(API, {"deployment": deployment.pk}).json()
    assert data["deployment"] == deployment.pk and data["totals"]["requests"] == 30
    assert [m["kind"] for m in data["markers"]] == ["deployed"]

    # A deployment of another model is not this chart's: 404, as for an unknown id.
    other = RegisteredModel.objects.create(team=model.team, name="Other", slug="other", created_by=owner)
    elsewhere = Deployment.objects.create(team=model.team, model=other)
    assert viewer_client.get(API, {"deployment": elsewhere.pk}).status_code == 404
    assert viewer_client.get(API, {"range": "2m"}).status_code == 400


def test_outsider_gets_404_for_the_chart_json_and_its_markers(metrics_setup, outsider_client):
    model = metrics_setup["model"]
    deployment = Deployment.objects.create(team=model.team, model=model)
    assert outsider_client.get(API).status_code == 404
    assert outsider_client.get(API, {"deployment": deployment.pk}).status_code == 404
