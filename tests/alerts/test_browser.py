"""The dashboard and the alerts page in headless Chromium: status at a glance, the firing badge in the top
bar, and a maintainer silencing, adding a channel and editing a rule. Screenshots under var/screenshots/."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.alerts import services
from apps.alerts.models import AlertKind, NotificationChannel, Silence
from apps.deployments.models import PlacementState
from apps.fleet.models import Host
from tests.conftest import SCREENSHOTS, requires_chromium
from tests.support.browser import login

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True), requires_chromium]


def test_dashboard_and_alerts_page_with_the_badge(
    page, live_server, maintainer, serving, record_minute, make_rule
):
    now = timezone.now()
    Host.objects.filter(pk=serving["host"].pk).update(last_heartbeat_at=now + timedelta(minutes=5))
    for minutes_ago in (3, 2, 1):
        record_minute(now - timedelta(minutes=minutes_ago), success=80, failure=20)
    errors = make_rule(AlertKind.ERROR_RATE, name="High error rate", threshold=5, window_minutes=5)
    make_rule(AlertKind.PLACEMENT_FAILED, name="Placement failed")
    serving["placement"].state = PlacementState.FAILED
    serving["placement"].last_error = "Triton: failed to load 'vision__classifier'"
    serving["placement"].save()
    services.evaluate_rules()

    login(page, live_server, maintainer.username)
    page.wait_for_selector("#team-status")
    assert page.locator("#firing-alert-count").inner_text() == "2"
    assert page.locator("#team-status h2").inner_text() == "Needs attention"
    assert page.locator("[data-stat=firing-alerts]").inner_text() == "2"
    assert page.locator("[data-stat=error-rate-1h]").inner_text() == "20.00%"
    assert "failed to load" in page.locator("#status-failed-placements").inner_text()
    page.screenshot(path=str(SCREENSHOTS / "dashboard-status.png"), full_page=True)

    page.click("nav.mainnav >> text=Alerts")
    page.wait_for_url("**/teams/vision/alerts/")
    active = page.locator("#active-alerts tbody")
    assert active.locator("tr[data-state=firing]").count() == 2
    assert "20.0% of 300 requests failed" in active.inner_text()

    # Silence the error-rate rule for an hour: the row says so.
    page.click("#create-silence summary")
    page.select_option("#create-silence select[name=rule]", str(errors.pk))
    page.fill("#create-silence input[name=comment]", "load test")
    page.click("#create-silence button[type=submit]")
    page.wait_for_selector(".flash-success")
    assert Silence.objects.get().rule == errors
    assert page.locator("#active-alerts .alert-silenced").count() == 1

    # Add an email channel.
    page.click("#create-channel summary")
    page.fill("#create-channel input[name=name]", "On call")
    page.select_option("#create-channel select[name=kind]", "email")
    page.fill("#create-channel input[name=emails]", "oncall@example.com")
    page.click("#create-channel button[type=submit]")
    page.wait_for_selector(".flash-success")
    assert NotificationChannel.objects.get().emails == ["oncall@example.com"]

    # Edit the rule's threshold: above the measured 20% the alert resolves at the next evaluation.
    row = page.locator(f"tr[data-rule='{errors.pk}']")
    row.locator("summary").click()
    row.locator("input[name=threshold]").fill("25")
    row.locator("button:has-text('Save')").click()
    page.wait_for_selector(".flash-success")
    errors.refresh_from_db()
    assert errors.threshold == 25
    services.evaluate_rules()
    page.reload()
    assert page.locator("#firing-alert-count").inner_text() == "1"
    assert "High error rate" in page.locator("#alert-history").inner_text()
    page.screenshot(path=str(SCREENSHOTS / "alerts-page.png"), full_page=True)
