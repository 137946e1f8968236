"""Steps browser tests share."""

from __future__ import annotations

from tests.conftest import PASSWORD


def sign_in(page, url: str, username: str = "olivia") -> None:
    """Sign in through the login page (the owner persona unless ``username`` is given)."""
    page.goto(f"{url}/login/")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_selector("h1")


def login(page, live_server, username: str) -> None:
    """Sign in as ``username`` and wait for the main navigation."""
    page.goto(f"{live_server.url}/login/")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_selector("nav.mainnav")
