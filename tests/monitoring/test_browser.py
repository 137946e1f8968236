"""The model metrics page in headless Chromium draws its charts from the API after traffic."""

from __future__ import annotations

import re

import pytest

from tests.conftest import SCREENSHOTS, requires_chromium
from tests.support.browser import login

pytestmark = [
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    requires_chromium,
]


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
    assert set(charts) == {
        "chart-requests",
        "chart-latency",
        "chart-queue",
        "chart-batch",
        "chart-errors",
        "chart-gateway",
    }
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


def test_deployment_page_draws_its_charts_with_markers_ranges_live_refresh_and_a_24_hour_utc_axis(
    page, live_server, metrics_setup, viewer
):
    from datetime import timedelta

    from django.utils import timezone

    from apps.deployments.models import Deployment, DeploymentEvent, DeploymentInstance, DeploymentState
    from apps.gateway.models import GatewayMetrics

    write, model, (v1, v2) = metrics_setup["write"], metrics_setup["model"], metrics_setup["versions"]
    deployment = Deployment.objects.create(
        team=model.team, model=model, active_version=v2, state=DeploymentState.SERVING
    )
    DeploymentInstance.objects.create(
        deployment=deployment, instance=metrics_setup["instance"], served_version=v2
    )
    for kind, version, minutes in (("deployed", v1, 40), ("switch_requested", v2, 10), ("switched", v2, 9)):
        event = DeploymentEvent.objects.create(
            deployment=deployment, kind=kind, message=kind, version=version
        )
        DeploymentEvent.objects.filter(pk=event.pk).update(
            created_at=timezone.now() - timedelta(minutes=minutes)
        )
    for minute in range(40, 10, -1):
        write(v1, minute, 120, 0, p50_us=900, p95_us=1800, p99_us=2500, quantile_requests=120)
    for minute in range(10, 1, -1):
        write(v2, minute, 180, 2, p50_us=700, p95_us=1200, p99_us=1600, quantile_requests=182)

    def gateway_minute(minutes_ago: int, **counts) -> None:
        bucket = timezone.now().replace(second=0, microsecond=0) - timedelta(minutes=minutes_ago)
        GatewayMetrics.objects.create(deployment=deployment, bucket=bucket, **counts)

    for minute in range(10, 1, -1):
        gateway_minute(
            minute,
            requests=182,
            responses_401=6,
            responses_429=12,
            responses_400=3,
            time_ms_sum=182 * 2.5,
            requests_interactive=152,
            requests_batch=30,
        )

    page.clock.install()  # the 15 s refresh timer runs on the test's clock
    login(page, live_server, viewer.username)
    page.goto(f"{live_server.url}/teams/vision/deployments/{deployment.pk}/")
    page.wait_for_selector("#metrics[data-loaded=true]")
    charts = page.evaluate(
        "() => Object.fromEntries(Object.entries(window.metricsCharts).map(([id, u]) => [id, u.series.slice(1).map(s => s.label)]))"
    )
    assert set(charts) == {"chart-requests", "chart-latency", "chart-errors", "chart-gateway"}
    assert charts["chart-latency"] == [
        *("v1 p50", "v1 p95", "v1 p99", "v2 p50", "v2 p95", "v2 p99"),
        "gateway mean",  # the time at the gateway beside Triton's
    ]
    assert charts["chart-gateway"] == [
        "requests",
        "401",
        "404",
        "429",
        "400 bad request",
        "5xx",
        "batch class",
    ]
    assert page.evaluate("() => Math.max(...window.metricsCharts['chart-gateway'].data[7])") == 0.5
    assert page.evaluate("() => Math.max(...window.metricsCharts['chart-gateway'].data[4])") == 0.2
    assert page.evaluate("() => Math.max(...window.metricsCharts['chart-latency'].data[7])") == 2.5
    assert page.evaluate("() => Math.max(...window.metricsCharts['chart-gateway'].data[5])") == 0.05
    assert (
        "27 × 400 (bad requests); refused 54 × 401, 0 × 404, 108 × 429; by priority class 1368 interactive, 270 batch"
        in page.locator(".metric-totals").inner_text()
    )
    assert page.locator(".latency-title").inner_text() == "Latency p50 / p95 / p99 (ms)"
    markers = page.locator("#chart-requests .chart-marker")
    assert markers.count() == 3
    assert markers.locator("span").all_inner_texts() == ["deployed v1", "switch v2", "switched v2"]
    assert "UTC" in markers.nth(2).locator("span").get_attribute("title")

    # One clock: 24-hour UTC ticks on the time axis, and UTC in the legend.
    # uPlot draws the axes on the canvas; axis._values holds the tick labels it drew.
    ticks = page.evaluate("() => window.metricsCharts['chart-requests'].axes[0]._values.filter(Boolean)")
    assert ticks and all(re.fullmatch(r"([01]\d|2[0-3]):[0-5]\d", t) for t in ticks), ticks
    legend_time = page.evaluate(
        "() => { const u = window.metricsCharts['chart-requests']; return u.series[0].value(u, 1700000000); }"
    )
    assert legend_time == "2023-11-14 22:13 UTC"
    page.screenshot(path=str(SCREENSHOTS / "deployment-metrics.png"), full_page=True)

    # The range buttons switch in place: 15 one-minute points, only the markers of those 15 minutes.
    page.click("#deployment-metrics .range-picker >> text=15m")
    page.wait_for_selector("#metrics[data-loaded=true]")
    assert page.evaluate("() => window.metricsCharts['chart-requests'].data[0].length") == 15
    assert page.locator("#deployment-metrics .range-picker a.active").inner_text() == "15m"
    assert "range=15m" in page.url
    assert page.locator("#chart-requests .chart-marker").count() == 2

    # Live refresh: every 15 s while on, new rows show without reloading; off stops it.
    loads = int(page.locator("#metrics").get_attribute("data-loads"))
    write(v2, 1, 600)
    gateway_minute(1, requests=600, responses_429=120)
    page.clock.run_for(16_000)
    page.wait_for_function(f"() => Number(document.querySelector('#metrics').dataset.loads) > {loads}")
    assert page.evaluate("() => Math.max(...window.metricsCharts['chart-requests'].data[2])") == 10.0
    assert page.evaluate("() => Math.max(...window.metricsCharts['chart-gateway'].data[4])") == 2.0

    page.uncheck("input[data-refresh]")
    assert page.locator("#metrics").get_attribute("data-live") == "off"
    stopped = int(page.locator("#metrics").get_attribute("data-loads"))
    page.clock.run_for(46_000)
    page.wait_for_timeout(500)
    assert int(page.locator("#metrics").get_attribute("data-loads")) == stopped
    page.check("input[data-refresh]")  # back on: redraws at once
    page.wait_for_function(f"() => Number(document.querySelector('#metrics').dataset.loads) > {stopped}")
