"""Rules against recorded metric rows and platform rows, with a frozen clock: pending -> firing after the
rule's "for", resolved when the condition clears, silences hold back notifications."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.alerts import services
from apps.alerts.models import (
    Alert,
    AlertKind,
    AlertRule,
    AlertState,
    NotificationChannel,
    NotificationDelivery,
    Silence,
)
from apps.conversions.models import ConversionJob, JobState
from apps.deployments import services as deployment_services
from apps.deployments.models import PlacementState
from apps.fleet.models import Device, Host, InstanceState
from apps.monitoring.models import DeviceMetrics
from apps.registry.models import VersionState

pytestmark = pytest.mark.django_db


def only_alert(rule) -> Alert | None:
    alerts = list(Alert.objects.filter(rule=rule))
    assert len(alerts) <= 1
    return alerts[0] if alerts else None


def test_error_rate_goes_pending_then_firing_after_for_then_resolved(
    serving, record_minute, make_rule, clock
):
    rule = make_rule(AlertKind.ERROR_RATE, threshold=5, window_minutes=5, for_seconds=120)
    for minutes_ago in (3, 2, 1):
        record_minute(clock - timedelta(minutes=minutes_ago), success=90, failure=10)  # 10% errors

    services.evaluate_rules(now=clock)
    alert = only_alert(rule)
    assert alert.state == AlertState.PENDING and alert.value == pytest.approx(10.0)
    assert alert.subject == f"deployment:{serving['deployment'].pk}" and "10.0% of 300" in alert.summary

    services.evaluate_rules(now=clock + timedelta(seconds=60))
    assert only_alert(rule).state == AlertState.PENDING  # 60 s < for 120 s

    record_minute(clock, success=90, failure=10)
    services.evaluate_rules(now=clock + timedelta(seconds=120))
    alert = only_alert(rule)
    assert alert.state == AlertState.FIRING and alert.fired_at == clock + timedelta(seconds=120)

    # The window moves past the failures; new minutes are clean: resolved, kept as history.
    later = clock + timedelta(minutes=10)
    for minutes_ago in (3, 2, 1):
        record_minute(later - timedelta(minutes=minutes_ago), success=100)
    services.evaluate_rules(now=later)
    alert = only_alert(rule)
    assert alert.state == AlertState.RESOLVED and alert.resolved_at == later


def test_a_pending_alert_that_clears_before_its_for_never_fires(serving, record_minute, make_rule, clock):
    rule = make_rule(AlertKind.ERROR_RATE, threshold=5, window_minutes=2, for_seconds=600)
    record_minute(clock - timedelta(minutes=1), success=50, failure=50)
    services.evaluate_rules(now=clock)
    assert only_alert(rule).state == AlertState.PENDING
    services.evaluate_rules(now=clock + timedelta(minutes=5))
    assert only_alert(rule) is None


def test_error_rate_below_threshold_or_without_traffic_raises_nothing(
    serving, record_minute, make_rule, clock
):
    rule = make_rule(AlertKind.ERROR_RATE, threshold=5, window_minutes=5)
    services.evaluate_rules(now=clock)
    assert only_alert(rule) is None
    record_minute(clock - timedelta(minutes=1), success=99, failure=1)
    services.evaluate_rules(now=clock)
    assert only_alert(rule) is None


def test_error_rate_judges_server_failures_only_and_names_the_bad_requests_beside(
    serving, record_minute, make_rule, clock
):
    rule = make_rule(AlertKind.ERROR_RATE, threshold=5, window_minutes=5)
    # A client sending 1,000 malformed requests a minute (400s) is not an outage.
    record_minute(clock - timedelta(minutes=1), success=100, client_errors=1000)
    services.evaluate_rules(now=clock)
    assert only_alert(rule) is None
    # Server failures fire, at their rate of the requests the model took; the bad requests are named beside.
    record_minute(clock - timedelta(minutes=2), success=80, failure=20)
    services.evaluate_rules(now=clock)
    alert = only_alert(rule)
    assert alert.value == pytest.approx(10.0)
    assert "10.0% of 200 requests failed (server errors)" in alert.summary
    assert "1000 bad requests (400) not counted" in alert.summary


def test_p99_rule_reads_the_latency_summaries(serving, record_minute, make_rule, clock):
    rule = make_rule(AlertKind.P99_LATENCY, threshold=250, window_minutes=5)
    record_minute(clock - timedelta(minutes=2), success=100, p99_ms=200, mean_ms=20)
    services.evaluate_rules(now=clock)
    assert only_alert(rule) is None
    record_minute(clock - timedelta(minutes=1), success=300, p99_ms=400, mean_ms=20)
    services.evaluate_rules(now=clock)
    alert = only_alert(rule)
    # Weighted by the requests each minute's quantiles cover: (100*200 + 300*400) / 400 = 350 ms.
    assert alert.state == AlertState.FIRING and alert.value == pytest.approx(350.0)


def test_no_traffic_fires_only_on_a_deployment_that_had_some(serving, record_minute, make_rule, clock):
    rule = make_rule(AlertKind.NO_TRAFFIC, window_minutes=10)
    services.evaluate_rules(now=clock)
    assert only_alert(rule) is None  # never had traffic: nothing to miss

    record_minute(clock - timedelta(minutes=12), success=5)
    services.evaluate_rules(now=clock - timedelta(minutes=5))
    assert only_alert(rule) is None  # quiet for 6 min < 10
    services.evaluate_rules(now=clock)
    alert = only_alert(rule)
    assert alert.state == AlertState.FIRING and alert.value == pytest.approx(11.0)

    record_minute(clock, success=1)
    services.evaluate_rules(now=clock + timedelta(seconds=30))
    assert only_alert(rule).state == AlertState.RESOLVED


def test_fleet_rules_fire_on_failed_placement_quarantined_instance_and_offline_host(
    serving, make_rule, clock
):
    placement_rule = make_rule(AlertKind.PLACEMENT_FAILED)
    instance_rule = make_rule(AlertKind.INSTANCE_DOWN)
    host_rule = make_rule(AlertKind.HOST_OFFLINE)
    Host.objects.filter(pk=serving["host"].pk).update(last_heartbeat_at=clock)
    services.evaluate_rules(now=clock)
    assert Alert.objects.count() == 0

    serving["placement"].state = PlacementState.FAILED
    serving["placement"].last_error = "failed to load 'vision__classifier': out of memory"
    serving["placement"].save()
    serving["instance"].state = InstanceState.QUARANTINED
    serving["instance"].save()
    services.evaluate_rules(now=clock + timedelta(minutes=2))  # the heartbeat is 2 min old: offline

    assert "out of memory" in only_alert(placement_rule).summary
    assert only_alert(instance_rule).labels["state"] == "QUARANTINED"
    assert only_alert(host_rule).subject == f"host:{serving['host'].pk}"
    assert {a.state for a in Alert.objects.all()} == {AlertState.FIRING}


def test_conversion_failed_fires_until_a_rerun_succeeds(team, owner, serving, make_rule, clock):
    rule = make_rule(AlertKind.CONVERSION_FAILED, window_minutes=60)
    version = serving["version"]
    version.state = VersionState.FAILED
    version.save()
    job = ConversionJob.objects.create(
        version=version, state=JobState.FAILED, error="ATC E10001: invalid input shape", finished_at=clock
    )
    services.evaluate_rules(now=clock)
    alert = only_alert(rule)
    assert alert.state == AlertState.FIRING and f"#{job.pk}" in alert.summary and "E10001" in alert.summary
    version.state = VersionState.READY
    version.save()
    services.evaluate_rules(now=clock + timedelta(minutes=1))
    assert only_alert(rule).state == AlertState.RESOLVED


def test_npu_hbm_rule_reads_device_rollups(serving, make_rule, clock):
    rule = make_rule(AlertKind.NPU_HBM, threshold=90, window_minutes=5)
    device = Device.objects.create(host=serving["host"], npu_id=0, name="310P3", hbm_total_mb=1000)
    DeviceMetrics.objects.create(
        bucket=clock - timedelta(minutes=1), device=device, samples=4, hbm_used_mb_sum=3800, hbm_samples=4,
        hbm_total_mb=1000,
    )  # fmt: skip
    services.evaluate_rules(now=clock)
    alert = only_alert(rule)
    assert alert.state == AlertState.FIRING and alert.value == pytest.approx(95.0)
    assert alert.labels["device"] == "local/npu0.0"


def test_firing_and_resolving_queue_deliveries_unless_silenced(
    serving, record_minute, make_rule, team, owner, clock
):
    rule = make_rule(AlertKind.ERROR_RATE, threshold=5, window_minutes=5)
    other = make_rule(AlertKind.PLACEMENT_FAILED)
    channel = NotificationChannel.objects.create(
        team=team, name="ops", kind="email", emails=["ops@example.com"]
    )
    silence = services.create_silence(
        actor=owner, team=team, rule=rule, ends_at=timezone.now() + timedelta(hours=1)
    )
    Silence.objects.filter(pk=silence.pk).update(
        starts_at=clock - timedelta(minutes=1)
    )  # the frozen clock's past
    record_minute(clock - timedelta(minutes=1), success=1, failure=9)
    serving["placement"].state = PlacementState.FAILED
    serving["placement"].save()

    services.evaluate_rules(now=clock)

    assert only_alert(rule).state == AlertState.FIRING  # silenced alerts still fire and show
    deliveries = list(NotificationDelivery.objects.all())
    assert [(d.rule_id, d.channel_id, d.status) for d in deliveries] == [(other.pk, channel.pk, "firing")]

    serving["placement"].state = PlacementState.READY
    serving["placement"].save()
    services.evaluate_rules(now=clock + timedelta(minutes=1))
    resolved = NotificationDelivery.objects.exclude(pk=deliveries[0].pk).get()
    assert resolved.status == "resolved" and resolved.payload["alerts"][0]["status"] == "resolved"


def test_deploying_creates_the_default_rules_once_per_team(
    team, owner, shared_host, django_capture_on_commit_callbacks
):
    from apps.registry.models import RegisteredModel
    from tests.support.models import add_instance, make_version

    instance = add_instance(shared_host)
    for slug in ("first", "second"):
        model = RegisteredModel.objects.create(team=team, name=slug, slug=slug, created_by=owner)
        with django_capture_on_commit_callbacks(execute=False):
            deployment_services.deploy_version(
                actor=owner, model=model, version=make_version(model, 1), instances=[instance]
            )
    kinds = sorted(AlertRule.objects.filter(team=team).values_list("kind", flat=True))
    assert kinds == sorted(AlertKind.values)
    assert AlertRule.objects.get(team=team, kind=AlertKind.ERROR_RATE).for_seconds == 120


def test_evaluation_queries_do_not_grow_with_the_number_of_rules(
    serving, record_minute, make_rule, clock, django_assert_max_num_queries
):
    record_minute(clock - timedelta(minutes=1), success=1, failure=9)
    for kind in AlertKind.values:
        make_rule(kind, threshold=1, window_minutes=5)
    services.evaluate_rules(now=clock)  # opens the alerts
    for index in range(40):
        make_rule(AlertKind.ERROR_RATE, name=f"copy {index}", threshold=1, window_minutes=5)
        make_rule(AlertKind.HOST_OFFLINE, name=f"host {index}")
    with django_assert_max_num_queries(25):
        result = services.evaluate_rules(now=clock + timedelta(minutes=1))
    assert result.rules == len(AlertKind.values) + 80 and result.fired >= 40


def test_beat_schedules_the_evaluation_every_minute_and_the_task_runs(settings, serving, make_rule):
    from serving_platform.celery import app

    make_rule(AlertKind.PLACEMENT_FAILED)
    serving["placement"].state = PlacementState.FAILED
    serving["placement"].save()
    entry = settings.CELERY_BEAT_SCHEDULE["evaluate-alert-rules"]
    assert entry["schedule"] == timedelta(minutes=1) and entry["task"] in app.tasks
    result = app.tasks[entry["task"]].apply().get()
    assert result["rules"] == 1 and result["fired"] == 1
    assert Alert.objects.get().state == AlertState.FIRING
