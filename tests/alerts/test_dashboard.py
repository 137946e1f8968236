"""The dashboard answers "is everything serving?" and the models list says which version serves where;
"latest" is the latest READY version."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.alerts import services
from apps.alerts.models import AlertKind
from apps.conversions.models import ConversionJob, JobState
from apps.deployments.models import PlacementState
from apps.fleet.models import Host, InstanceState
from apps.registry.models import VersionState
from tests.support.models import make_version

pytestmark = pytest.mark.django_db


def test_dashboard_shows_deployments_alerts_failures_fleet_and_traffic(
    client, viewer, serving, record_minute, make_rule
):
    now = timezone.now()
    for minutes_ago in (30, 20, 10):
        record_minute(now - timedelta(minutes=minutes_ago), success=95, failure=5)
    record_minute(now - timedelta(hours=3), success=1000, failure=0)  # outside the hour
    serving["placement"].state = PlacementState.FAILED
    serving["placement"].last_error = "Triton: failed to load model"
    serving["placement"].save()
    make_rule(AlertKind.PLACEMENT_FAILED, name="Placement failed")
    services.evaluate_rules()
    failed = make_version(serving["model"], 2, state=VersionState.FAILED)
    job = ConversionJob.objects.create(
        version=failed, state=JobState.FAILED, error="onnx: bad graph", finished_at=now
    )
    Host.objects.filter(pk=serving["host"].pk).update(last_heartbeat_at=now - timedelta(minutes=5))
    serving["instance"].state = InstanceState.QUARANTINED
    serving["instance"].save()

    client.force_login(viewer)
    page = client.get("/").content.decode()

    assert "Needs attention" in page
    assert 'data-stat="live-deployments">1<' in page and 'data-deployments-state="serving">1 serving<' in page
    assert 'data-stat="firing-alerts">1<' in page and "Triton: failed to load model" in page
    assert 'data-stat="requests-1h">300<' in page and 'data-stat="error-rate-1h">5.00%<' in page
    assert f"/teams/vision/conversions/{job.pk}/" in page and "onnx: bad graph" in page
    assert "/hosts/local/" in page and "status-offline" in page and "Quarantined" in page
    assert "/teams/vision/models/classifier/metrics/" in page


def test_dashboard_of_a_healthy_team_says_everything_is_serving(client, viewer, serving):
    Host.objects.filter(pk=serving["host"].pk).update(last_heartbeat_at=timezone.now())
    client.force_login(viewer)
    page = client.get("/").content.decode()
    assert "Everything is serving" in page and 'data-stat="firing-alerts">0<' in page


def test_models_list_shows_latest_ready_version_and_where_it_serves(client, viewer, serving):
    make_version(serving["model"], 2, state=VersionState.FAILED)  # a rejected upload used up v2
    assert serving["model"].latest_version() == serving["version"]
    client.force_login(viewer)
    page = client.get("/teams/vision/models/").content.decode()
    row = page[page.index('data-model="classifier"') :]
    row = row[: row.index("</tr>")]
    assert "v1" in row and "Failed" not in row
    assert "v1 on local/cpu-0" in row and f"/teams/vision/deployments/{serving['deployment'].pk}/" in row
