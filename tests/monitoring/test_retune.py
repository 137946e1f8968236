"""Re-tune suggestions: a serving version's scraped traffic of the last 15 minutes against the point its
tuning measured (``apps.monitoring.retune``), in the API and on the version page - a suggestion only."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.deployments.models import TuningJob, TuningState
from apps.monitoring import retune
from apps.monitoring.models import ModelMetrics
from backend_ge import config as gc
from backend_ge.tuning import Point
from tests.deployments.tuning_support import BASE, BETTER, pool, tunable
from tests.support.models import make_version

__all__ = ["pool", "tunable"]  # fixtures

pytestmark = pytest.mark.django_db
WINDOW_S = int(retune.WINDOW.total_seconds())


def measured(candidate, concurrency, rps, p99, batch, queue_us) -> dict:
    return {**Point(candidate, concurrency, rps, p99 / 2, p99, 0, batch, queue_us).as_dict(), "at_s": 1.0}


@pytest.fixture
def tuned(tunable, instance):
    """A finished tuning of the version that found its own config (BASE) best: 200 requests/s within the
    20 ms objective at concurrency 2, batches of 4, 0.5 ms in the queue."""
    points = [
        measured(BASE, 1, 120, 4, 2.0, 300),
        measured(BASE, 2, 200, 10, 4.0, 500),
        measured(BASE, 4, 230, 40, 6.0, 9000),  # past the objective: not the tuned point
        measured(BETTER, 1, 100, 5, 1.0, 100),
    ]
    job = TuningJob.objects.create(
        team=tunable.model.team, version=tunable, budget_s=60, max_candidates=3, state=TuningState.SUCCEEDED,
        objective={"p99_ms": 20.0, "rate_rps": None}, points=points, finished_at=timezone.now(),
        result={"recommended": BASE.as_dict(), "default": BASE.as_dict()},
    )  # fmt: skip
    return job


def traffic(version, instance, *, rate: float, batch: float = 4.0, queue_ms: float = 0.5, p99_ms=None):
    """Minute rows over the window with ``rate`` requests/s."""
    now = timezone.now().replace(second=0, microsecond=0)
    per_minute = int(rate * 60)
    for minute in range(1, WINDOW_S // 60):
        ModelMetrics.objects.create(
            bucket=now - timedelta(minutes=minute), team=version.model.team, model=version.model,
            version=version, instance=instance, success=per_minute, inferences=per_minute,
            executions=max(1, int(per_minute / batch)), queue_us=per_minute * queue_ms * 1000,
            p99_us=None if p99_ms is None else p99_ms * 1000, quantile_requests=per_minute if p99_ms else 0,
        )  # fmt: skip


def test_the_tuned_point_is_the_best_within_the_objective(tuned, tunable):
    assert retune.tuned_job(tunable) == tuned
    assert retune.tuned_point(tuned, BASE) == {
        "throughput_rps": 200.0, "p99_ms": 10.0, "avg_batch_size": 4.0, "queue_ms": 0.5, "concurrency": 2,
    }  # fmt: skip
    assert retune.advice(tunable)["state"] == "quiet"  # no traffic yet


@pytest.mark.parametrize(
    ("figures", "state", "words"),
    [
        ({"rate": 150, "batch": 3.5, "queue_ms": 0.6}, "steady", None),
        ({"rate": 300}, "retune", "above the 200.0 the tuned config served"),
        ({"rate": 150, "queue_ms": 5.0}, "retune", "wait 5.00 ms in the queue against 0.50 ms"),
        ({"rate": 150, "p99_ms": 35}, "retune", "live p99 35.0 ms exceeds the objective's 20 ms"),
        ({"rate": 10, "batch": 1.1}, "retune", "forms batches of 1.1 against 4.0"),
    ],
)
def test_traffic_away_from_the_tuned_point_suggests_a_retune(tuned, tunable, instance, figures, state, words):
    traffic(tunable, instance, **figures)
    advice = retune.advice(tunable)
    assert advice["state"] == state, advice
    assert advice["tuning"] == tuned.pk and advice["tuned"]["throughput_rps"] == 200.0
    if words is None:
        assert advice["reasons"] == []
    else:
        assert any(words in reason for reason in advice["reasons"]), advice["reasons"]


def test_a_version_made_from_a_recommendation_is_compared_with_its_tuning(tuned, tunable, instance):
    derived = make_version(tunable.model, 2)
    derived.config_text = gc.render_config(BETTER.apply(gc.parse_config(tunable.config_text)))
    derived.save(update_fields=["config_text"])
    assert retune.advice(derived)["state"] == "untuned"
    TuningJob.objects.filter(pk=tuned.pk).update(derived_version=derived)
    advice = retune.advice(derived)
    assert advice["tuning"] == tuned.pk and advice["tuned"]["throughput_rps"] == 100.0


def test_the_api_and_the_page_show_it_to_the_team_only(
    tuned, tunable, instance, viewer_client, outsider_client, client, viewer
):
    traffic(tunable, instance, rate=300)
    path = "/api/v1/teams/vision/models/classifier/versions/1/tuning-advice/"
    answer = viewer_client.get(path)
    assert answer.status_code == 200 and answer.json()["state"] == "retune"
    assert outsider_client.get(path).status_code == 404
    assert outsider_client.get(path.replace("vision", "speech")).status_code == 404
    client.force_login(viewer)
    page = client.get("/teams/vision/models/classifier/versions/1/").content.decode()
    assert 'id="tuning-advice"' in page and "Re-tuning suggested" in page and "above the 200.0" in page
