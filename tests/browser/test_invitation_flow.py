"""Inviting a member in headless Chromium: the owner invites from the team settings page, the invited user
accepts on their dashboard and is a member with the invited role."""

import pytest

from apps.teams.models import Membership, Role, TeamInvitation
from tests.conftest import SCREENSHOTS, requires_chromium
from tests.factories import UserFactory

pytestmark = [pytest.mark.browser, requires_chromium]

PASSWORD = "correct horse battery staple"


def _sign_in(page, live_server, username: str) -> None:
    page.goto(f"{live_server.url}/login/")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(f"{live_server.url}/")


def test_owner_invites_and_the_invited_user_accepts_on_the_dashboard(page, live_server, owner, team):
    nina = UserFactory(username="nina", email="nina@example.com")

    _sign_in(page, live_server, "olivia")
    page.goto(f"{live_server.url}/teams/vision/settings/")
    page.click("#members details summary")
    page.fill("#members details input[name=user]", "Nina@Example.com")
    page.select_option("#members details select[name=role]", "maintainer")
    page.click("#members details button[type=submit]")
    page.wait_for_selector("tr[data-invitation='nina@example.com']")
    assert "if an account with the username or email" in page.content()
    assert page.locator("tr[data-member='nina']").count() == 0
    page.screenshot(path=str(SCREENSHOTS / "invitation-pending.png"), full_page=True)

    page.context.clear_cookies()
    _sign_in(page, live_server, "nina")
    invitation = TeamInvitation.objects.get(team=team)
    row = page.locator(f"tr[data-invitation='{invitation.pk}']")
    assert "Vision" in row.inner_text() and "maintainer" in row.inner_text()
    page.screenshot(path=str(SCREENSHOTS / "invitation-dashboard.png"), full_page=True)
    row.locator("button", has_text="Accept").click()
    page.wait_for_selector("text=You joined Vision as maintainer.")
    assert page.locator("tr[data-invitation]").count() == 0
    assert Membership.objects.get(team=team, user=nina).role == Role.MAINTAINER
