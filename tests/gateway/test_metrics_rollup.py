"""Gateway rows without HAProxy: the admin socket's table parsed (recorded from HAProxy 2.6.12), pooled
backends mapped to their deployment, hourly downsampling and retention like the model rows, the staff-only
gateway-wide figures on the fleet API and the dashboard."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.urls import reverse

from apps.core.periods import HOUR, MINUTE
from apps.deployments.models import Deployment, DeploymentState
from apps.gateway.metrics import (
    _counted_refusals,
    _owner,
    _refusals,
    gateway_series,
    parse_counts_table,
    read_slot_owners,
    summary,
)
from apps.gateway.models import GatewayMetrics
from apps.monitoring import rollups
from tests.conftest import client_for
from tests.factories import UserFactory
from tests.support.models import make_version

# `show table gateway_counts` from HAProxy 2.6.12 after 7 requests (see apps.gateway.rules for the stages);
# the format of the seventh counter (400s) as HAProxy prints it, with its count added.
RECORDED_TABLE = """# table: gateway_counts, type: string, size:102400, used:3
0x55fd5fac8aa8: key=all use=0 exp=0 gpc0=7 gpc1=6 gpc2=3 gpc3=0 gpc4=0 gpc5=2 gpc6=1 gpc7=0
0x7f042c042928: key=d7 use=0 exp=0 gpc0=0 gpc1=5 gpc2=3 gpc3=0 gpc4=0 gpc5=2 gpc6=1 gpc7=0
0x7f042c042a10: key=x../etc use=1 exp=0 gpc0=9 gpc1=9 gpc2=9 gpc3=9 gpc4=9 gpc5=9 gpc6=9 gpc7=9
"""


def test_the_recorded_table_parses_into_stage_counts_and_refusals():
    counts = parse_counts_table(RECORDED_TABLE)
    assert counts == {
        "*": {"g0": 7, "g1": 6, "g2": 3, "g3": 0, "g4": 0, "g5": 2, "g6": 1, "g7": 0},
        "d7": {"g0": 0, "g1": 5, "g2": 3, "g3": 0, "g4": 0, "g5": 2, "g6": 1, "g7": 0},
    }  # a key that is not a deployment is ignored
    assert _refusals(counts["*"], gateway_wide=True) == {
        "responses_401": 3,
        "responses_404": 3,  # one off the allow-list, two answered by an instance
        "responses_429": 3,
        "responses_400": 1,  # a bad request, answered by an instance
    }
    assert _refusals(counts["d7"], gateway_wide=False) == {
        "responses_401": 2,
        "responses_404": 2,
        "responses_429": 3,
        "responses_400": 1,
    }


def test_a_refusal_seen_between_two_stages_of_one_request_is_not_counted_twice():
    # With several HAProxy threads a scrape can read a request's stage 1 before its stage 2: one 401 too
    # many for a moment. What was counted is remembered, so the sum over the scrapes stays exact.
    before = {"counted_responses_401": 0, "counted_responses_404": 0, "counted_responses_429": 0}
    added = []
    for g1, g2 in ((11, 10), (11, 11), (12, 11), (14, 12)):  # in flight, passed, a 401, a 401 and a pass
        values = {"g0": g1, "g1": g1, "g2": g2, "g3": g2, "g4": g2, "g5": 0}
        added.append(_counted_refusals(values, before, False, gateway_wide=False)["responses_401"])
        before = values
    assert added == [1, 0, 0, 1] and sum(added) == 2  # two real 401s in all, the first counted early
    # A restart counts from zero again.
    values = {"g0": 1, "g1": 1, "g2": 0, "g3": 0, "g4": 0, "g5": 0}
    assert _counted_refusals(values, before, True, gateway_wide=False)["responses_401"] == 1


def test_pooled_backends_count_for_the_deployment_that_owns_them(settings, tmp_path):
    settings.GATEWAY_DIR = tmp_path
    (tmp_path / "slots.map").write_text("s0 d12\ns1 d12c\ns2 garbage\n")
    slots = read_slot_owners()
    assert slots == {"s0": "d12", "s1": "d12c"}
    assert [_owner(key, slots) for key in ("s0", "s1", "s2", "s9", "d5", "d5c", "*")] == [
        12,
        12,
        False,
        False,
        5,
        5,
        None,
    ]


@pytest.fixture
def deployment(team, owner, model):
    return Deployment.objects.create(
        team=team,
        model=model,
        active_version=make_version(model, 1),
        state=DeploymentState.SERVING,
        created_by=owner,
    )


def _row(deployment, bucket, **counts):
    return GatewayMetrics.objects.create(
        period_seconds=MINUTE, bucket=bucket, deployment=deployment, **counts
    )


@pytest.mark.django_db
def test_old_minutes_fold_into_hours_and_expire_like_the_model_rows(deployment, settings):
    settings.METRICS_MINUTE_RETENTION_DAYS, settings.METRICS_RETENTION_DAYS = 1, 90
    now = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    old = datetime(2026, 11, 27, 9, 0, tzinfo=UTC)
    for minute in range(3):
        _row(deployment, old + timedelta(minutes=minute), requests=10, responses_401=1, time_ms_sum=50.0)
        _row(None, old + timedelta(minutes=minute), requests=20, responses_404=2, responses_429=3)
    recent = _row(deployment, now - timedelta(minutes=5), requests=4)
    _row(None, now - timedelta(days=100), requests=1)  # past METRICS_RETENTION_DAYS

    result = rollups.downsample(now)
    assert result["dropped"] >= 1
    hour = GatewayMetrics.objects.get(period_seconds=HOUR, deployment=deployment)
    assert (hour.bucket, hour.requests, hour.responses_401, hour.time_ms_sum) == (old, 30, 3, 150.0)
    wide = GatewayMetrics.objects.get(period_seconds=HOUR, deployment=None)
    assert (wide.requests, wide.responses_404, wide.responses_429) == (60, 6, 9)
    assert not GatewayMetrics.objects.filter(
        period_seconds=MINUTE, bucket__lt=now - timedelta(days=1)
    ).exists()
    assert GatewayMetrics.objects.filter(pk=recent.pk).exists()
    assert GatewayMetrics.objects.count() == 3

    # Idempotent; a minute of the same hour arriving later is added to the hour.
    _row(deployment, old + timedelta(minutes=30), requests=5)
    rollups.downsample(now)
    rollups.downsample(now)
    assert GatewayMetrics.objects.get(period_seconds=HOUR, deployment=deployment).requests == 35
    # The 7-day chart reads the hourly rows.
    window = rollups.Window.ending(rollups.RANGES["7d"], now)
    lines = gateway_series(GatewayMetrics.objects.filter(deployment=deployment), window)
    assert lines["totals"]["requests"] == 39 and lines["totals"]["responses_401"] == 3
    assert lines["avg_ms"][window.index(old)] == round(150.0 / 35, 3)
    assert summary(GatewayMetrics.objects.filter(deployment=deployment))["requests"] == 39


@pytest.mark.django_db
def test_gateway_wide_figures_are_for_platform_staff_only(client, owner, deployment):
    now = datetime.now(UTC).replace(second=0, microsecond=0)
    _row(None, now, requests=9, responses_401=4, responses_404=3, responses_429=2, responses_5xx=1)
    _row(deployment, now, requests=2)
    staff = UserFactory(username="ops", is_staff=True)
    data = client_for(staff).get(reverse("fleet-metrics"), {"range": "15m"}).json()["gateway"]
    assert data["totals"]["requests"] == 9 and data["totals"]["responses_401"] == 4
    assert client_for(owner).get(reverse("fleet-metrics")).json()["gateway"] is None

    client.force_login(staff)
    page = client.get("/").content.decode()
    assert '<dd id="gateway-wide-refused">4 / 3 / 2</dd>' in page
    assert 'id="chart-gateway"' in client.get("/fleet/metrics/").content.decode()
    client.force_login(owner)
    assert "gateway-wide" not in client.get("/").content.decode()
    assert 'id="chart-gateway"' not in client.get("/fleet/metrics/").content.decode()
