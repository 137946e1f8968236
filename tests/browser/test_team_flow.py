"""The UI shell in headless Chromium: log in, switch team, create a token and see it once, see the audit
event. Screenshots land under var/screenshots/ (ignored by git)."""

import pytest

from apps.teams.models import ApiToken, Membership, Role
from tests.conftest import SCREENSHOTS, requires_chromium

pytestmark = [pytest.mark.browser, requires_chromium]


def test_login_switch_team_create_token_once_and_see_audit(page, live_server, owner, team, other_team):
    Membership.objects.create(team=other_team, user=owner, role=Role.OWNER)

    page.goto(f"{live_server.url}/")
    assert "/login/" in page.url
    page.fill("input[name=username]", "olivia")
    page.fill("input[name=password]", "correct horse battery staple")
    page.click("button[type=submit]")
    page.wait_for_selector(".stats")
    page.screenshot(path=str(SCREENSHOTS / "dashboard.png"), full_page=True)
    current = page.locator("#team-switcher").input_value()

    # Switch to the other team; the dashboard follows.
    target = "vision" if current == "speech" else "speech"
    page.select_option("#team-switcher", target)
    page.wait_for_function(f"document.querySelector('#team-switcher').value === '{target}'")
    page.wait_for_selector("h1")
    assert page.locator("h1").first.inner_text() == ("Vision" if target == "vision" else "Speech")

    # Team settings: create a token and see its secret exactly once.
    page.click("nav.mainnav >> text=Team")
    page.wait_for_url(f"**/teams/{target}/settings/")
    page.click("#create-token summary")
    page.fill("#create-token input[name=name]", "Browser token")
    page.click("#create-token button[type=submit]")
    secret = page.locator("#new-token-secret").inner_text()
    token = ApiToken.objects.get(name="Browser token")
    assert secret.startswith(token.display_prefix + "_") and token.team.slug == target
    page.screenshot(path=str(SCREENSHOTS / "token-created.png"), full_page=True)
    page.reload()
    assert page.locator("#new-token-secret").count() == 0
    assert secret not in page.content()
    assert page.locator(f"tr[data-token='{token.display_prefix}']").count() == 1

    # Revoke it through htmx: the row updates in place.
    page.once("dialog", lambda dialog: dialog.accept())
    page.click(f"tr[data-token='{token.display_prefix}'] button")
    page.wait_for_selector(f"tr[data-token='{token.display_prefix}'] .status-revoked")

    # The audit log shows both events.
    page.click("nav.mainnav >> text=Audit log")
    page.wait_for_url(f"**/teams/{target}/audit/")
    table = page.locator("#audit-table").inner_text()
    assert "token.created" in table and "token.revoked" in table and "Browser token" in table
    page.screenshot(path=str(SCREENSHOTS / "audit-log.png"), full_page=True)
