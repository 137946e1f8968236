"""The rollout panel in headless Chromium: it loads into the deployment page, draws the weight and both versions
with the gate lines from the API, and Pause/Abort work behind a confirmation without a reload."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.deployments import rollouts, services
from apps.deployments.models import RolloutAnalysis, RolloutState
from tests.conftest import SCREENSHOTS, requires_chromium
from tests.deployments.helpers import report_canary, serving
from tests.support.browser import login
from tests.support.models import make_version

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True), requires_chromium]


def test_the_rollout_panel_draws_charts_and_its_controls_work_without_a_reload(
    page, live_server, maintainer, owner, version, instance, model, monkeypatch
):
    monkeypatch.setattr(services, "_enqueue", lambda placements: None)
    deployment = serving(owner, version, [instance])
    rollout = rollouts.start_rollout(actor=owner, deployment=deployment, canary=make_version(model, 2))
    report_canary(rollout)
    rollouts.check_rollouts()
    now = timezone.now()
    for i, (weight, rate) in enumerate([(10, 1.0), (10, 0.995), (25, 0.97)]):
        at = now - timedelta(seconds=60 * (3 - i))
        RolloutAnalysis.objects.create(
            rollout=rollout, checked_at=at, window_start=at - timedelta(seconds=60), weight=weight,
            passed=rate >= 0.99, failed_gates=[] if rate >= 0.99 else [{"gate": "success_rate", "value": rate}],
            figures={"stable": {"requests_per_s": 9.0, "success_rate": 1.0, "p50_ms": 1.0, "p99_ms": 2.0, "queue_ms": 0.1},
                     "canary": {"requests_per_s": 1.0, "success_rate": rate, "p50_ms": 1.5, "p99_ms": 3.0, "queue_ms": 0.2}},
        )  # fmt: skip

    page.clock.install()  # time flows, and the panel's 10 s poll can be run forward below
    login(page, live_server, maintainer.username)
    page.goto(f"{live_server.url}/teams/vision/deployments/{deployment.pk}/")
    page.wait_for_selector("#rollout-state")
    page.wait_for_function("() => window.rolloutCharts && Object.keys(window.rolloutCharts).length === 5")
    charts = page.evaluate(
        """() => Object.fromEntries(Object.entries(window.rolloutCharts).map(([name, u]) => [name, {
            series: u.series.slice(1).map(s => s.label), points: u.data[0].length, data: u.data.slice(1),
        }]))"""
    )
    assert charts["weight"]["data"] == [[10, 10, 25]]
    assert charts["success"]["series"] == ["stable", "canary", "gate ≥"]
    assert charts["success"]["data"][1] == pytest.approx([100.0, 99.5, 97.0])
    assert charts["success"]["data"][2] == pytest.approx([99.0, 99.0, 99.0])  # the gate line
    assert charts["latency"]["series"][:4] == ["stable p50", "stable p99", "canary p50", "canary p99"]
    assert page.locator("#rollout-charts canvas").count() == 5
    page.screenshot(path=str(SCREENSHOTS / "rollout-panel.png"), full_page=True)

    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#rollout-actions button:has-text('Pause')")
    page.wait_for_selector("#rollout-state:has-text('Paused')")
    # Dismissing the confirmation changes nothing.
    page.once("dialog", lambda dialog: dialog.dismiss())
    page.click("#rollout-actions button:has-text('Abort')")
    page.wait_for_timeout(500)
    rollout.refresh_from_db()
    assert rollout.state == RolloutState.PAUSED
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#rollout-actions button:has-text('Abort')")
    page.wait_for_selector("#rollout-state:has-text('Aborted')")
    rollout.refresh_from_db()
    assert rollout.state == RolloutState.ABORTED
    assert page.locator("#rollout-actions").count() == 0
    # The idle panel polls every 10 s, but not while the start form is open: what is typed stays.
    page.click("#rollout-start summary")
    page.fill("#rollout-start input[name=steps]", "5 100")
    polls: list[str] = []
    page.on("request", lambda r: polls.append(r.url) if r.url.endswith("/rollout/") else None)
    page.clock.run_for(11_000)  # past the idle panel's 10 s poll: it would have asked for the panel now
    assert polls == []
    assert page.locator("#rollout-start input[name=steps]").input_value() == "5 100"
    page.click("#rollout-start summary")  # closed: polling resumes
    # A rollout started elsewhere shows up on the page without a reload (the panel polls).
    rollouts.start_rollout(actor=owner, deployment=deployment, canary=make_version(model, 3))
    page.clock.run_for(10_000)  # to the idle panel's next poll
    page.wait_for_selector("#rollout-canary:has-text('v3')", timeout=20_000)
    assert polls, "the panel's poll was not seen (the check above that it does not poll could not fail)"
