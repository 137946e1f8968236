"""The version page's tuning panel in a browser: a maintainer starts a tuning, the panel follows it by
itself until the agent's points arrive and draws the curve, and "Create a version with this config" makes
the recommended version. (The agent's reports come from the test, with the host's credential, as the live
tuning test's real agent sends them.) Screenshot under var/screenshots/."""

from __future__ import annotations

import pytest

from apps.deployments.models import TuningJob, TuningState
from tests.conftest import PASSWORD, SCREENSHOTS, requires_chromium, wait_for
from tests.deployments.tuning_support import BASE, BETTER, credential_of, point, pool, tunable
from tests.fleet.helpers import agent_client

__all__ = ["pool", "tunable"]  # fixtures

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True), requires_chromium]


def test_start_a_tuning_watch_the_curve_appear_and_create_the_version(
    page, live_server, maintainer, tunable, pool
):
    page.goto(f"{live_server.url}/login/")
    page.fill("input[name=username]", maintainer.username)
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_selector(".stats")
    page.goto(f"{live_server.url}/teams/vision/models/classifier/versions/1/")
    assert "the most throughput with p99 <= 20 ms" in page.inner_text("#tuning-objective")
    page.click("#tuning summary:has-text('Tune this version')")
    page.fill("#id_tuning-budget_s", "60")
    page.fill("#id_tuning-max_candidates", "3")
    page.click("#tuning-form button[type=submit]")
    page.wait_for_selector("#tuning-state")
    job = TuningJob.objects.get()
    assert job.state == TuningState.RUNNING and page.inner_text("#tuning-state") == "Running"

    agent = agent_client(credential_of(job.instance.host))
    points = [
        point(BASE, 1, 100, 5),
        point(BASE, 2, 150, 30),
        point(BETTER, 1, 130, 6),
        point(BETTER, 2, 260, 12),
    ]
    for body in (
        {"event": "started"},
        {"event": "finished", "points": points, "stopped": "done", "wall_s": 9.0},
    ):
        assert (
            agent.post(
                f"/agent/v1/tunings/{job.pk}/report", body, content_type="application/json"
            ).status_code
            == 200
        )
    # No reload: the panel refreshes itself while the job is active, and stops once it ended.
    page.wait_for_selector("#tuning-curve svg circle", timeout=20_000)
    assert page.inner_text("#tuning-state") == "Succeeded"
    assert page.locator("#tuning-curve g.series.recommended circle").count() == 2
    assert page.locator("#tuning-curve g.series.current circle").count() == 2
    objective_x = float(page.get_attribute("#tuning-objective-line", "x1"))
    assert 48 < objective_x < 640 - 48  # within the plot: 20 ms lies between the points measured
    assert page.get_attribute("#tuning", "hx-trigger") is None
    assert "2.60x" in page.inner_text("#tuning-message")
    page.screenshot(path=str(SCREENSHOTS / "tuning-curve.png"), full_page=True)
    page.click("#tuning-apply-form button")
    page.wait_for_url("**/versions/2/")
    wait_for(lambda: tunable.model.versions.filter(number=2).exists(), 10, "the recommended version")
    assert "batching max 8, delay 1000 us, preferred 8" in page.inner_text("#serving-settings-current")
