"""Rollouts as the API, the agents' reports and the beat task drive them - no agent, no Triton: placements are
moved by hand the way ``hostagent.placement`` reports them, and the instances' metrics ports are closed (a
check then sees no canary traffic). The behaviour with real tritonservers is in test_rollout_live.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.audit.models import AuditEvent
from apps.deployments import reports, rollouts, services
from apps.deployments.models import (
    DeploymentInstance,
    DeploymentState,
    PlacementState,
    Rollout,
    RolloutState,
)
from tests.deployments.helpers import finish, report_canary, serving
from tests.support.models import make_version

pytestmark = pytest.mark.django_db


@pytest.fixture
def enqueued(monkeypatch):
    sent = []
    monkeypatch.setattr(services, "_enqueue", lambda placements: sent.extend(placements))
    return sent


@pytest.fixture
def deployment(owner, version, instance):
    return serving(owner, version, [instance])


@pytest.fixture
def canary(model):
    return make_version(model, 2)


def url(deployment, suffix=""):
    return f"/api/v1/teams/vision/deployments/{deployment.pk}/rollouts/{suffix}"


def start(client, deployment, **body):
    return client.post(url(deployment), {"version": 2, **body}, format="json")


def test_maintainer_starts_a_rollout_at_weight_0_and_every_placement_gets_a_decision(
    maintainer_client, deployment, canary, enqueued, django_capture_on_commit_callbacks
):
    before = deployment.placements.get().generation
    with django_capture_on_commit_callbacks(execute=True):
        response = start(maintainer_client, deployment, steps=[20, 100], step_interval_s=2, min_requests=5)
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["state"] == "RUNNING" and body["current_weight"] == 0 and body["steps"] == [20, 100]
    assert body["stable_version"] == 1 and body["canary_version"] == 2 and body["analyses"] == []
    placement = deployment.placements.get()
    assert placement.generation == before + 1 and placement.state == PlacementState.READY
    assert [p.pk for p in enqueued] == [placement.pk]
    assert deployment.events.filter(kind="rollout_started").exists()
    assert AuditEvent.objects.filter(action="rollout.started", details__canary=2).exists()
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.SERVING  # the stable version serves while the canary loads


@pytest.mark.parametrize(
    ("body", "field", "text"),
    [
        ({"steps": [10, 50]}, "steps", "must be 100"),
        ({"steps": [50, 20, 100]}, "steps", "must increase"),
        ({"steps": [0, 100]}, "steps", ""),
        ({"step_interval_s": 1}, "step_interval_s", "between 2 and"),
        ({"traffic_deadline_s": 5, "step_interval_s": 10}, "traffic_deadline_s", "between 10 and"),
        ({"max_p99_ratio": 0.5}, "max_p99_ratio", "between 1.0 and"),
        ({"max_p99_ms": 200}, "max_p99_ms", "latency summaries"),
        ({"version": 1}, "version", "already the served version"),
        ({"version": 9}, "version", "has no version 9"),
    ],
)
def test_bad_starts_are_400_naming_what_to_fix(owner_client, deployment, canary, enqueued, body, field, text):
    response = start(owner_client, deployment, **body)
    assert response.status_code == 400, response.json()
    assert field in response.json()["fields"]
    assert text in " ".join(response.json()["fields"][field])
    assert not Rollout.objects.exists()


def test_a_p99_gate_is_accepted_when_every_instance_has_latency_summaries(
    owner_client, deployment, canary, instance, enqueued
):
    instance.latency_summaries = True
    instance.save()
    response = start(owner_client, deployment, max_p99_ms=200, max_p99_ratio=2)
    assert response.status_code == 201, response.json()
    assert response.json()["max_p99_ms"] == 200 and response.json()["max_p99_ratio"] == 2


def test_one_live_rollout_per_deployment_and_switch_waits_for_it(
    owner_client, deployment, canary, model, enqueued
):
    assert start(owner_client, deployment).status_code == 201
    make_version(model, 3)
    again = start(owner_client, deployment, version=3)
    assert again.status_code == 400 and "promote or abort it first" in again.json()["message"]
    switch = owner_client.post(
        f"/api/v1/teams/vision/deployments/{deployment.pk}/switch/", {"version": 3}, format="json"
    )
    assert switch.status_code == 400 and "promote or abort it first" in switch.json()["message"]


def test_a_deployment_that_is_not_serving_cannot_start_a_rollout(owner_client, deployment, canary, enqueued):
    deployment.state = DeploymentState.SWITCHING
    deployment.save()
    response = start(owner_client, deployment)
    assert response.status_code == 400 and "a rollout starts from SERVING" in response.json()["message"]


def test_viewers_read_rollouts_but_cannot_act_and_outsiders_get_404(
    owner_client, viewer_client, outsider_client, deployment, canary, enqueued
):
    rollout_id = start(owner_client, deployment).json()["id"]
    assert viewer_client.get(url(deployment)).json()["results"][0]["id"] == rollout_id
    assert viewer_client.get(url(deployment, f"{rollout_id}/")).status_code == 200
    assert start(viewer_client, deployment).status_code == 403
    for verb in ("pause", "resume", "promote", "abort"):
        assert viewer_client.post(url(deployment, f"{rollout_id}/{verb}/")).status_code == 403
        assert outsider_client.post(url(deployment, f"{rollout_id}/{verb}/")).status_code == 404
    assert outsider_client.get(url(deployment)).status_code == 404
    assert outsider_client.get(url(deployment, f"{rollout_id}/")).status_code == 404


def test_weight_leaves_0_only_once_every_ready_placement_serves_the_canary(
    owner, owner_client, deployment, canary, shared_host, enqueued
):
    rollout = rollouts.start_rollout(actor=owner, deployment=deployment, canary=canary, step_interval_s=2)
    assert rollouts.check_rollouts() == {"unloaded": 0, "begun": 0, "checked": 0, "steps": 0}
    report_canary(rollout)
    placement = deployment.placements.get()
    assert placement.canary_version == canary and placement.served_version.number == 1
    detail = owner_client.get(f"/api/v1/teams/vision/deployments/{deployment.pk}/").json()
    assert detail["placements"][0]["served_version"] == 1 and detail["placements"][0]["canary_version"] == 2
    assert rollouts.check_rollouts()["begun"] == 1
    rollout.refresh_from_db()
    assert rollout.current_weight == 10 and rollout.next_check_at > timezone.now()
    assert deployment.events.filter(kind="rollout_step", details__weight=10).exists()


def test_too_little_traffic_waits_then_counts_as_failed_and_rolls_back_with_the_figures(
    owner, deployment, canary, enqueued, django_capture_on_commit_callbacks, settings
):
    settings.ROLLOUT_UNLOAD_DELAY_S = 30
    rollout = rollouts.start_rollout(
        actor=owner, deployment=deployment, canary=canary, step_interval_s=2, traffic_deadline_s=4,
        max_failed_checks=2,
    )  # fmt: skip
    report_canary(rollout)
    rollouts.check_rollouts()
    now = timezone.now()
    # Due, but the window is young: the check waits.
    assert rollouts.check_rollouts(now + timedelta(seconds=2.5))["checked"] == 1
    check = rollout.analyses.get()
    assert check.waiting and not check.passed and check.figures["canary"]["requests"] == 0
    # The same tick again claims nothing: next_check_at moved on.
    assert rollouts.check_rollouts(now + timedelta(seconds=2.5))["checked"] == 0
    Rollout.objects.filter(pk=rollout.pk).update(window_started_at=now - timedelta(seconds=10))
    rollouts.check_rollouts(now + timedelta(seconds=5))
    rollout.refresh_from_db()
    assert rollout.state == RolloutState.RUNNING and rollout.consecutive_failures == 1
    Rollout.objects.filter(pk=rollout.pk).update(window_started_at=now - timedelta(seconds=10))
    with django_capture_on_commit_callbacks(execute=True):
        rollouts.check_rollouts(now + timedelta(seconds=8))
    rollout.refresh_from_db()
    assert rollout.state == RolloutState.ROLLED_BACK and rollout.current_weight == 0
    assert "2 failed checks in a row" in rollout.reason and "canary requests" in rollout.reason
    audit = AuditEvent.objects.get(action="rollout.rolled_back")
    assert audit.details["figures"]["failed_gates"][0]["gate"] == "min_requests"
    event = deployment.events.get(kind="rollout_rolled_back")
    assert event.details["weight"] == 0
    # The canary is unloaded only after the gateway had time to stop routing to it.
    decided = DeploymentInstance.objects.get(deployment=deployment).generation
    assert rollouts.check_rollouts(now + timedelta(seconds=8))["unloaded"] == 0
    with django_capture_on_commit_callbacks(execute=True):
        assert rollouts.check_rollouts(timezone.now() + timedelta(seconds=60))["unloaded"] == 1
    assert DeploymentInstance.objects.get(deployment=deployment).generation == decided + 1
    assert enqueued[-1].deployment_id == deployment.pk


def test_pause_resume_abort(owner_client, owner, deployment, canary, enqueued):
    rollout = rollouts.start_rollout(actor=owner, deployment=deployment, canary=canary, step_interval_s=2)
    report_canary(rollout)
    rollouts.check_rollouts()
    paused = owner_client.post(url(deployment, f"{rollout.pk}/pause/")).json()
    assert paused["state"] == "PAUSED" and paused["current_weight"] == 10 and paused["next_check_at"] is None
    assert rollouts.check_rollouts(timezone.now() + timedelta(seconds=30))["checked"] == 0
    assert owner_client.post(url(deployment, f"{rollout.pk}/pause/")).status_code == 400
    resumed = owner_client.post(url(deployment, f"{rollout.pk}/resume/")).json()
    assert resumed["state"] == "RUNNING" and resumed["next_check_at"] is not None
    aborted = owner_client.post(url(deployment, f"{rollout.pk}/abort/")).json()
    assert (
        aborted["state"] == "ABORTED"
        and aborted["current_weight"] == 0
        and "aborted by olivia" in aborted["reason"]
    )
    assert owner_client.post(url(deployment, f"{rollout.pk}/resume/")).status_code == 400
    actions = list(AuditEvent.objects.filter(action__startswith="rollout.").values_list("action", flat=True))
    assert sorted(actions) == ["rollout.aborted", "rollout.paused", "rollout.resumed", "rollout.started"]


def test_promote_now_switches_the_deployment_to_the_canary(
    owner_client, owner, deployment, canary, instance, enqueued
):
    rollout = rollouts.start_rollout(actor=owner, deployment=deployment, canary=canary, step_interval_s=2)
    report_canary(rollout)
    promoted = owner_client.post(url(deployment, f"{rollout.pk}/promote/")).json()
    assert promoted["state"] == "PROMOTED" and promoted["current_weight"] == 100
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.SWITCHING and deployment.target_version == canary
    # The agent switches (old+new, then new only) and reports: the canary serves alone.
    placement = deployment.placements.get()
    reports.placement_loaded(placement.pk, placement.generation, canary)
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.SERVING and deployment.active_version == canary
    assert deployment.placements.get().canary_version is None
    assert AuditEvent.objects.filter(action="rollout.promoted").exists()


def test_a_canary_that_fails_to_load_rolls_the_rollout_back_and_stable_keeps_serving(
    owner, deployment, canary, version, enqueued
):
    rollout = rollouts.start_rollout(actor=owner, deployment=deployment, canary=canary, step_interval_s=2)
    placement = deployment.placements.get()
    reports.placement_canary_failed(
        placement.pk, placement.generation, "smoke inference failed", canary=canary, still_serving=version
    )
    rollout.refresh_from_db()
    deployment.refresh_from_db()
    assert rollout.state == RolloutState.ROLLED_BACK and "failed to load" in rollout.reason
    assert deployment.state == DeploymentState.SERVING and deployment.active_version == version


def test_undeploy_aborts_a_live_rollout(owner, deployment, canary, enqueued):
    rollout = rollouts.start_rollout(actor=owner, deployment=deployment, canary=canary)
    services.undeploy(actor=owner, deployment=deployment)
    rollout.refresh_from_db()
    assert rollout.state == RolloutState.ABORTED and "undeployed" in rollout.reason


def test_a_stale_canary_report_is_dropped(owner, deployment, canary, instance, enqueued):
    rollout = rollouts.start_rollout(actor=owner, deployment=deployment, canary=canary)
    placement = deployment.placements.get()
    assert not reports.placement_canary_loaded(
        placement.pk, placement.generation - 1, rollout.stable_version, canary
    )
    assert deployment.placements.get().canary_version is None
    finish(deployment, instance)  # settles without change


def test_a_live_rollouts_versions_are_in_use_and_an_ended_rollout_lets_a_deleted_version_go(
    owner_client, owner, deployment, canary, enqueued
):
    versions = "/api/v1/teams/vision/models/classifier/versions/"
    rollout = rollouts.start_rollout(actor=owner, deployment=deployment, canary=canary)
    report_canary(rollout)
    for verb, path in (("post", f"{versions}2/archive/"), ("delete", f"{versions}2/")):
        response = getattr(owner_client, verb)(path)
        assert response.status_code == 409, response.json()
        assert f"deployment #{deployment.pk} is rolling it out as its canary" in response.json()["message"]
    rollouts.abort(actor=owner, rollout=rollout)
    rollouts.check_rollouts(timezone.now() + timedelta(seconds=60))
    placement = deployment.placements.get()
    reports.placement_loaded(
        placement.pk, placement.generation, rollout.stable_version
    )  # the canary unloaded
    assert owner_client.delete(f"{versions}2/").status_code == 204
    body = owner_client.get(url(deployment, f"{rollout.pk}/")).json()
    assert body["canary_version"] is None and body["stable_version"] == 1 and body["state"] == "ABORTED"


def test_the_beat_schedule_runs_the_registered_rollout_task(settings):
    from apps.deployments.tasks import check_rollouts

    entry = settings.CELERY_BEAT_SCHEDULE["check-rollouts"]
    assert entry["task"] == check_rollouts.name
    assert entry["schedule"].total_seconds() == settings.ROLLOUT_TICK_MS / 1000
    assert check_rollouts.apply().get() == {"unloaded": 0, "begun": 0, "checked": 0, "steps": 0}


@pytest.mark.django_db(transaction=True)
def test_two_beats_ticking_at_once_check_a_due_rollout_once(owner, deployment, canary, enqueued):
    import threading

    from django.db import connection, connections

    if connection.vendor != "postgresql":
        pytest.skip("concurrent writers need PostgreSQL (SQLite serializes the whole database)")
    rollout = rollouts.start_rollout(actor=owner, deployment=deployment, canary=canary, step_interval_s=2)
    report_canary(rollout)
    rollouts.check_rollouts()
    due = timezone.now() + timedelta(seconds=3)
    barrier, results = threading.Barrier(4), []

    def beat():
        try:
            barrier.wait(10)
            results.append(rollouts.check_rollouts(due)["checked"])
        finally:
            connections.close_all()

    threads = [threading.Thread(target=beat) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(results) == [0, 0, 0, 1]
    assert rollout.analyses.count() == 1


def test_a_canary_not_loaded_everywhere_within_the_deadline_is_rolled_back(
    owner, deployment, canary, enqueued
):
    rollout = rollouts.start_rollout(
        actor=owner, deployment=deployment, canary=canary, traffic_deadline_s=120
    )
    assert rollouts.check_rollouts(timezone.now() + timedelta(seconds=60))["begun"] == 0
    rollout.refresh_from_db()
    assert rollout.state == RolloutState.RUNNING
    rollouts.check_rollouts(timezone.now() + timedelta(seconds=121))
    rollout.refresh_from_db()
    assert rollout.state == RolloutState.ROLLED_BACK and rollout.current_weight == 0
    assert "not loaded on every instance within 120 s (not on local/cpu-0)" in rollout.reason
