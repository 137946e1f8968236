"""Tuning jobs on the platform (no servers): starting one over the API with every bad input a 400 naming the
field, its scratch replica placed in room of its own (counted in ``reserved_mb``, one job per instance),
queued with the reason and timed out, the desired state and file access of its host only, the agent's
reports (the recommendation read from the points by the platform), cancel, and the recommended version."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.audit.models import AuditEvent
from apps.deployments import agent_api, reserved, services, tuning_jobs
from apps.deployments.models import TuningJob, TuningState
from apps.fleet.models import Host, Pool, TritonInstance
from apps.registry.models import VersionState
from backend_ge import config as gc
from backend_ge.tuning import Candidate
from tests.deployments.tuning_support import BASE, BETTER, credential_of, point, pool, start, tunable, url
from tests.fleet.helpers import agent_client
from tests.support.models import make_version

__all__ = ["pool", "tunable"]  # fixtures

pytestmark = pytest.mark.django_db


def test_a_maintainer_starts_a_tuning_placed_in_room_of_its_own(maintainer_client, tunable, pool):
    response = start(maintainer_client, pool="cpu", max_instances=2, budget_s=60)
    assert response.status_code == 201, response.json()
    job = TuningJob.objects.get(pk=response.json()["id"])
    assert job.state == TuningState.RUNNING and job.instance is not None
    assert job.reserved_mb == 600 and job.objective == {"p99_ms": 20.0, "rate_rps": None}
    assert TritonInstance.objects.get(pk=job.instance_id).reserved_mb == 600
    assert reserved.reserved_drift() == {}
    assert response.json()["progress"] == 0 and response.json()["points"] == []
    assert AuditEvent.objects.filter(action="tuning.started").count() == 1
    # A replica of another model is not placed into the room the job holds.
    other = make_version(
        type(tunable.model).objects.create(team=tunable.model.team, name="Other", slug="other"), 1
    )
    other.footprint_mb = 500
    other.save(update_fields=["footprint_mb"])
    deployment = services.deploy_version(actor=None, model=other.model, version=other, replicas=2, pool=pool)
    used = set(deployment.placements.values_list("instance_id", flat=True))
    assert job.instance_id not in used
    assert reserved.reserved_drift() == {}


@pytest.mark.parametrize(
    ("change", "body", "field"),
    [
        ("state", {}, "version"),
        ("objective", {}, "objective_p99_ms"),
        (None, {"budget_s": 5}, "budget_s"),
        (None, {"budget_s": 999_999}, "budget_s"),
        (None, {"max_candidates": 0}, "max_candidates"),
        (None, {"max_instances": 10_000}, "max_instances"),
        (None, {"pool": "nope"}, "pool"),
        (None, {"version": 7}, "version"),
        (None, {"model": "../x"}, "model"),
        (None, {"budget_s": "soon"}, "budget_s"),
    ],
)
def test_bad_input_is_a_400_naming_the_field_and_starts_nothing(
    maintainer_client, tunable, pool, change, body, field
):
    if change == "state":
        tunable.state = VersionState.CONVERTING
        tunable.save(update_fields=["state"])
    elif change == "objective":
        tunable.model.objective_p99_ms = None
        tunable.model.save(update_fields=["objective_p99_ms"])
    response = start(maintainer_client, **body)
    assert response.status_code == 400 and field in response.json()["fields"], response.json()
    assert not TuningJob.objects.exists()


def test_another_teams_pool_a_second_job_and_roles(
    maintainer_client, viewer_client, outsider_client, tunable, pool, other_team
):
    Pool.objects.create(name="theirs", team=other_team)
    assert "pool" in start(maintainer_client, pool="theirs").json()["fields"]
    assert start(viewer_client).status_code == 403
    assert start(outsider_client).status_code == 404
    assert start(maintainer_client).status_code == 201
    second = start(maintainer_client)
    assert second.status_code == 400 and "already" in second.json()["fields"]["version"][0]
    assert outsider_client.get(url()).status_code == 404
    assert viewer_client.get(url()).json()["count"] == 1
    job = TuningJob.objects.get()
    assert outsider_client.get(f"{url('speech')}{job.pk}/").status_code == 404


def test_no_room_stays_queued_with_the_reason_and_times_out(maintainer_client, tunable, pool, settings):
    response = start(maintainer_client, max_instances=4)  # 1200 MiB: more than any instance has
    job = TuningJob.objects.get(pk=response.json()["id"])
    assert job.state == TuningState.QUEUED
    assert "no instance of pool cpu has 1200 MiB free" in job.reason
    assert tuning_jobs.tick()["tunings_placed"] == 0
    TuningJob.objects.filter(pk=job.pk).update(created_at=timezone.now() - timedelta(seconds=3600))
    settings.TUNING_QUEUE_TIMEOUT_S = 60
    assert tuning_jobs.tick()["tunings_timed_out"] == 1
    job.refresh_from_db()
    assert job.state == TuningState.TIMED_OUT and "without room" in job.reason and job.finished_at


def test_one_job_per_instance_the_next_waits(maintainer_client, tunable, pool):
    first = tunable
    second = make_version(tunable.model, 2)
    second.config_text, second.footprint_mb = first.config_text, 100
    second.save(update_fields=["config_text", "footprint_mb"])
    third = make_version(tunable.model, 3)
    third.config_text, third.footprint_mb = first.config_text, 100
    third.save(update_fields=["config_text", "footprint_mb"])
    jobs = [start(maintainer_client, version=n).json() for n in (1, 2, 3)]
    assert [j["state"] for j in jobs] == ["RUNNING", "RUNNING", "QUEUED"]
    assert len({j["instance"] for j in jobs[:2]}) == 2
    assert "every instance of pool" in jobs[2]["reason"]
    tuning_jobs.cancel(actor=None, job=TuningJob.objects.get(pk=jobs[0]["id"]))  # never started: ends now
    assert tuning_jobs.tick()["tunings_placed"] == 1
    assert reserved.reserved_drift() == {}


def test_its_host_alone_gets_the_job_and_the_files(maintainer_client, tunable, pool):
    job = TuningJob.objects.get(pk=start(maintainer_client).json()["id"])
    host = job.instance.host
    mine = agent_client(credential_of(host))
    state = mine.get("/agent/v1/desired-state").json()
    assert [t["id"] for t in state["tunings"]] == [job.pk]
    assert state["tunings"][0]["objective"] == {"p99_ms": 20.0, "rate_rps": None}
    assert str(tunable.pk) in state["versions"]
    other = Host.objects.filter(pool=pool).exclude(pk=host.pk).get()
    theirs = agent_client(credential_of(other))
    assert theirs.get("/agent/v1/desired-state").json()["tunings"] == []
    assert theirs.get(f"/agent/v1/versions/{tunable.pk}/manifest").status_code == 404
    body = {"event": "started"}
    assert (
        theirs.post(f"/agent/v1/tunings/{job.pk}/report", body, content_type="application/json").status_code
        == 404
    )
    # Its own host may download the version's files (this row has none to serve), no other host may.
    assert agent_api._placed_version(host, tunable.pk) == tunable
    assert agent_api._placed_version(other, tunable.pk) is None


def report(client, job, **body):
    return client.post(f"/agent/v1/tunings/{job.pk}/report", body, content_type="application/json")


def test_reports_fill_the_curve_and_the_platform_reads_the_recommendation(maintainer_client, tunable, pool):
    job = TuningJob.objects.get(pk=start(maintainer_client).json()["id"])
    agent = agent_client(credential_of(job.instance.host))
    assert report(agent, job, event="started").json() == {"accepted": True, "cancel": False}
    points = [
        point(BASE, 1, 100, 5),
        point(BASE, 2, 150, 30, at=60.0),
        point(BETTER, 1, 120, 6),
        point(BETTER, 2, 240, 12),
    ]
    assert report(agent, job, event="points", points=points[:2], log="base measured").status_code == 200
    job.refresh_from_db()
    assert job.state == TuningState.RUNNING and len(job.points) == 2 and job.progress() == 20  # 60 of 300 s
    # The agent claims nothing about the verdict: it sends figures; a point out of range is a 400.
    bad = {**points[2], "p99_ms": float("1e300")}
    assert report(agent, job, event="points", points=[bad]).status_code == 400
    hostile = {**points[2], "candidate": {**BETTER.as_dict(), "instance_count": 10_000}}
    assert report(agent, job, event="points", points=[hostile]).status_code == 400
    answer = report(agent, job, event="finished", points=points[2:], stopped="done", wall_s=42.0)
    assert answer.status_code == 200
    job.refresh_from_db()
    assert job.state == TuningState.SUCCEEDED and job.finished_at
    assert Candidate.from_dict(job.result["recommended"]) == BETTER
    assert job.result["tuned_over_default"] == pytest.approx(240 / 100)
    assert len(job.result["points"]) == 4 and job.result["wall_s"] == 42.0
    assert "recommended" in job.reason
    assert TritonInstance.objects.get(pk=job.instance_id).reserved_mb == 0
    assert reserved.reserved_drift() == {}
    # Ended: a late report is refused, so the agent stops.
    assert report(agent, job, event="points", points=[]).status_code == 409
    detail = maintainer_client.get(f"{url()}{job.pk}/").json()
    assert (
        detail["recommended"] == BETTER.as_dict() and len(detail["points"]) == 4 and detail["progress"] == 100
    )
    assert "base measured" in detail["log"]


def test_cancel_a_measuring_job_reaches_its_agent(maintainer_client, tunable, pool):
    job = TuningJob.objects.get(pk=start(maintainer_client).json()["id"])
    agent = agent_client(credential_of(job.instance.host))
    report(agent, job, event="started")
    response = maintainer_client.post(f"{url()}{job.pk}/cancel/")
    assert response.status_code == 200 and response.json()["cancel_requested"] is True
    assert agent.get("/agent/v1/desired-state").json()["tunings"][0]["cancel"] is True
    assert report(agent, job, event="points", points=[point(BASE, 1, 100, 5)]).json()["cancel"] is True
    report(agent, job, event="finished", stopped="cancelled", wall_s=3.0)
    job.refresh_from_db()
    assert job.state == TuningState.CANCELLED and len(job.points) == 1
    again = maintainer_client.post(f"{url()}{job.pk}/cancel/")
    assert again.status_code == 400 and "state" in again.json()["fields"]


def test_a_failure_and_a_silent_agent_end_the_job_and_release_its_memory(
    maintainer_client, tunable, pool, settings
):
    job = TuningJob.objects.get(pk=start(maintainer_client, budget_s=30).json()["id"])
    agent = agent_client(credential_of(job.instance.host))
    report(agent, job, event="failed", error="load failed: tritonserver said no")
    job.refresh_from_db()
    assert job.state == TuningState.FAILED and "tritonserver said no" in job.reason
    job = TuningJob.objects.get(pk=start(maintainer_client, budget_s=30).json()["id"])
    settings.TUNING_REPORT_GRACE_S = 10
    TuningJob.objects.filter(pk=job.pk).update(started_at=timezone.now() - timedelta(seconds=41))
    assert tuning_jobs.tick()["tunings_timed_out"] == 1
    job.refresh_from_db()
    assert (
        job.state == TuningState.TIMED_OUT and TritonInstance.objects.get(pk=job.instance_id).reserved_mb == 0
    )
    assert agent.get("/agent/v1/desired-state").json()["tunings"] == []


def test_the_recommendation_becomes_a_version(maintainer_client, make_scaler_version, model, pool):
    model.objective_p99_ms = 50
    model.save(update_fields=["objective_p99_ms"])
    version = make_scaler_version(model)
    job = TuningJob.objects.get(pk=start(maintainer_client, version=version.number).json()["id"])
    base = Candidate.from_config(gc.parse_config(version.config_text))
    assert maintainer_client.post(f"{url()}{job.pk}/create-version/").status_code == 400  # nothing yet
    agent = agent_client(credential_of(job.instance.host))
    report(agent, job, event="started")
    better = Candidate(True, base.max_batch_size, 2000, (base.max_batch_size,), 1)
    points = [point(base, 1, 100, 5), point(better, 1, 300, 5)]
    report(agent, job, event="finished", points=points, stopped="done", wall_s=10.0)
    response = maintainer_client.post(f"{url()}{job.pk}/create-version/", {"note": "tuned"}, format="json")
    assert response.status_code == 201, response.json()
    derived = model.versions.get(number=response.json()["version"])
    assert derived.state == VersionState.READY and derived.note == "tuned"
    assert Candidate.from_config(gc.parse_config(derived.config_text)) == better


def test_no_version_when_the_current_config_measured_best(maintainer_client, tunable, pool):
    job = TuningJob.objects.get(pk=start(maintainer_client).json()["id"])
    agent = agent_client(credential_of(job.instance.host))
    report(agent, job, event="started")
    points = [point(BASE, 1, 300, 5), point(BETTER, 1, 100, 5)]
    report(agent, job, event="finished", points=points, stopped="done", wall_s=5.0)
    job.refresh_from_db()
    assert Candidate.from_dict(job.result["recommended"]) == BASE
    assert "the current config is the best measured" in job.result["message"]
    response = maintainer_client.post(f"{url()}{job.pk}/create-version/")
    assert response.status_code == 400 and "nothing to create" in response.json()["fields"]["tuning"][0]
    assert tunable.model.versions.count() == 1


def test_a_cancel_its_agent_never_confirms_ends_after_the_grace(maintainer_client, tunable, pool, settings):
    job = TuningJob.objects.get(pk=start(maintainer_client, budget_s=3600).json()["id"])
    agent = agent_client(credential_of(job.instance.host))
    report(agent, job, event="started")
    maintainer_client.post(f"{url()}{job.pk}/cancel/")
    settings.TUNING_REPORT_GRACE_S = 10
    assert tuning_jobs.tick()["tunings_timed_out"] == 0  # it may still confirm
    TuningJob.objects.filter(pk=job.pk).update(reported_at=timezone.now() - timedelta(seconds=11))
    assert tuning_jobs.tick()["tunings_timed_out"] == 1
    job.refresh_from_db()
    assert job.state == TuningState.CANCELLED and "did not confirm" in job.reason
    assert TritonInstance.objects.get(pk=job.instance_id).reserved_mb == 0
