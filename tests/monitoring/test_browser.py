"""The model metrics page in headless Chromium draws its charts from the API after traffic."""

from __future__ import annotations

import pytest

from tests.conftest import SCREENSHOTS, requires_chromium

pytestmark = [
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    requires_chromium,
]


def login(page, live_server, username: str) -> None:
    page.goto(f"{live_server.url}/login/")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", "correct horse battery staple")
    page.click("button[type=submit]")
    page.wait_for_selector("nav.mainnav")


def test_model_metrics_page_draws_a_line_per_version_with_data(page, live_server, metrics_setup, viewer):
    write, (v1, v2) = metrics_setup["write"], metrics_setup["versions"]
    # A rollout: v1 serves, then v2 takes over, with Triton's quantiles on.
    for minute in range(30, 10, -1):
        write(v1, minute, 300, 3, p50_us=900, p95_us=1800, p99_us=2500, quantile_requests=303)
    for minute in range(10, 0, -1):
        write(v2, minute, 360, 0, p50_us=700, p95_us=1200, p99_us=1600, quantile_requests=360)

    login(page, live_server, viewer.username)
    page.goto(f"{live_server.url}/teams/vision/models/classifier/metrics/?range=1h")
    page.wait_for_selector("#metrics[data-loaded=true]")
    charts = page.evaluate(
        """() => Object.fromEntries(Object.entries(window.metricsCharts).map(([id, u]) => [id, {
            points: u.data[0].length,
            series: u.series.slice(1).map(s => s.label),
            nonNull: u.data.slice(1).map(values => values.filter(v => v !== null && v > 0).length),
        }]))"""
    )
    assert set(charts) == {"chart-requests", "chart-latency", "chart-queue", "chart-batch", "chart-errors"}
    assert charts["chart-requests"]["series"] == ["v1", "v2"]
    assert charts["chart-requests"]["points"] == 60
    assert charts["chart-requests"]["nonNull"] == [20, 10]  # the minutes each version served
    assert charts["chart-latency"]["series"][:3] == ["v1 p50", "v1 p95", "v1 p99"]
    assert charts["chart-errors"]["nonNull"] == [20, 0]
    assert page.locator("#chart-requests canvas").count() == 1
    assert "9660 requests, 60 failed (BACKEND 60)" in page.locator(".metric-totals").inner_text()
    page.screenshot(path=str(SCREENSHOTS / "model-metrics.png"), full_page=True)

    # The 7-day range reads the same rows in hourly points.
    page.click(".range-picker >> text=7d")
    page.wait_for_selector("#metrics[data-loaded=true]")
    assert page.evaluate("() => window.metricsCharts['chart-requests'].data[0].length") == 168

    page.goto(f"{live_server.url}/fleet/metrics/")
    page.wait_for_selector("#metrics[data-loaded=true]")
    assert page.locator("#busiest tr[data-model=classifier]").count() == 1
    page.screenshot(path=str(SCREENSHOTS / "fleet-metrics.png"), full_page=True)
