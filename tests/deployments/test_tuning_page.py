"""The version page's tuning panel: a maintainer starts a tuning (bad input: 400 with the message, nothing
started), follows it, sees the curve with the current and recommended configs and the objective, cancels,
and creates the recommended version; viewers see it all and change nothing."""

from __future__ import annotations

import re

import pytest

from apps.deployments.models import TuningJob, TuningState
from backend_ge import config as gc
from backend_ge.tuning import Candidate
from tests.deployments.tuning_support import BASE, BETTER, credential_of, point, pool, tunable
from tests.fleet.helpers import agent_client

__all__ = ["pool", "tunable"]  # fixtures

pytestmark = pytest.mark.django_db
PAGE = "/teams/vision/models/classifier/versions/1/"


def post(client, **data):
    return client.post(PAGE, data)


def finish(job: TuningJob, points: list[dict]) -> None:
    agent = agent_client(credential_of(job.instance.host))
    for body in (
        {"event": "started"},
        {"event": "finished", "points": points, "stopped": "done", "wall_s": 9.0},
    ):
        response = agent.post(f"/agent/v1/tunings/{job.pk}/report", body, content_type="application/json")
        assert response.status_code == 200, response.json()


def test_start_follow_and_apply_from_the_page(client, maintainer, tunable, pool):
    client.force_login(maintainer)
    page = client.get(PAGE).content.decode()
    assert 'id="tuning-form"' in page and "the most throughput with p99 &lt;= 20 ms" in page
    bad = post(client, op="tune", **{"tuning-pool": "", "tuning-budget_s": 5, "tuning-max_candidates": 3,
                                     "tuning-max_instances": 1})  # fmt: skip
    assert bad.status_code == 400 and "greater than or equal to 30" in bad.content.decode()
    assert not TuningJob.objects.exists()
    answer = post(client, op="tune", **{"tuning-pool": "cpu", "tuning-budget_s": 60, "tuning-max_candidates": 3,
                                        "tuning-max_instances": 1})  # fmt: skip
    assert answer.status_code == 302
    job = TuningJob.objects.get()
    assert job.state == TuningState.RUNNING and job.pool.name == "cpu"
    page = client.get(PAGE).content.decode()
    assert (
        'id="tuning-state"' in page and 'hx-trigger="every 3s"' in page and 'id="tuning-cancel-form"' in page
    )
    assert 'id="tuning-form"' not in page  # one job per version at a time

    finish(
        job,
        [
            point(BASE, 1, 100, 5),
            point(BASE, 2, 150, 30),
            point(BETTER, 1, 130, 6),
            point(BETTER, 2, 260, 12),
        ],
    )
    page = client.get(PAGE).content.decode()
    assert "every 3s" not in page
    svg = re.search(r'<svg[^>]*class="tuning-curve".*?</svg>', page, re.S).group(0)
    assert svg.count("<circle") == 4 and 'id="tuning-objective-line"' in svg
    assert 'class="series current"' in svg and 'class="series recommended"' in svg
    assert "recommended: batching max 8, delay 1000 us, preferred 8" in page and "2.60x" in page
    assert post(client, op="tune_apply", tuning=job.pk).status_code == 302
    derived = tunable.model.versions.order_by("-number").first()
    assert derived.number == 2
    assert Candidate.from_config(gc.parse_config(derived.config_text)) == BETTER


def test_cancel_and_the_objective_missing(client, maintainer, tunable, pool):
    client.force_login(maintainer)
    post(client, op="tune", **{"tuning-budget_s": 60, "tuning-max_candidates": 3, "tuning-max_instances": 1})
    job = TuningJob.objects.get()
    assert post(client, op="tune_cancel", tuning=job.pk).status_code == 302
    assert TuningJob.objects.get().state == TuningState.CANCELLED  # its agent had not started it
    assert post(client, op="tune_cancel", tuning="99999").status_code == 302  # no such job: a message
    tunable.model.objective_p99_ms = None
    tunable.model.save(update_fields=["objective_p99_ms"])
    page = client.get(PAGE).content.decode()
    assert "No latency objective" in page and 'id="tuning-form"' not in page
    refused = post(
        client, op="tune", **{"tuning-budget_s": 60, "tuning-max_candidates": 3, "tuning-max_instances": 1}
    )
    assert refused.status_code == 400 and "latency objective first" in refused.content.decode()


def test_viewers_see_the_panel_and_change_nothing(client, viewer, tunable, pool):
    client.force_login(viewer)
    page = client.get(PAGE).content.decode()
    assert 'id="tuning"' in page and 'id="tuning-form"' not in page
    refused = post(
        client, op="tune", **{"tuning-budget_s": 60, "tuning-max_candidates": 3, "tuning-max_instances": 1}
    )
    assert refused.status_code == 403 and not TuningJob.objects.exists()
