"""Single sign-on through a real OpenID Connect provider (npm's oidc-provider) in headless Chromium: the
redirect flow with state, nonce and PKCE, users created at the first sign-in, teams and roles from the group
claim (and taken back at the next sign-in), sign-out, and the error pages of a tampered state, an expired
ID token and an issuer mismatch. One test: each sign-in costs the provider and the browser a few round trips."""

from __future__ import annotations

import re
from urllib.parse import urljoin

import pytest

from apps.audit.models import AuditEvent
from apps.teams.models import Membership, MembershipSource, Role, SsoIdentity
from tests.conftest import SCREENSHOTS, requires_chromium
from tests.factories import TeamFactory
from tests.oidc.helpers import provider_installed

pytestmark = [
    pytest.mark.browser,
    pytest.mark.servers,
    requires_chromium,
    pytest.mark.skipif(
        not provider_installed(), reason="node or tests/oidc/provider/node_modules missing: make install"
    ),
]

ALICE = {"preferred_username": "alice", "email": "alice@corp.example", "given_name": "Alice"}


def _sign_in_with_sso(page, live_server) -> None:
    page.goto(f"{live_server.url}/login/")
    page.click("#sso-sign-in")


def _provider_answer(page, live_server) -> str:
    """The URL the provider sends the browser back to, for a sign-in started in the page's browser context,
    without following it (Playwright cannot rewrite a redirect, so the test takes the redirects itself, with
    the context's cookies)."""
    url = f"{live_server.url}/login/sso/"
    for _ in range(8):
        location = page.context.request.get(url, max_redirects=0).headers.get("location", "")
        assert location, f"{url} did not redirect"
        url = location if "://" in location else urljoin(url, location)
        if url.startswith(f"{live_server.url}/login/sso/callback/"):
            return url
    raise AssertionError(f"the provider never sent the browser back (last: {url})")


def test_sign_in_through_the_provider_maps_groups_and_refuses_bad_answers(
    page, live_server, oidc_provider, settings
):
    vision = TeamFactory(name="Vision", slug="vision")
    nlp = TeamFactory(name="NLP", slug="nlp")
    groups = ["tgp:vision:maintainer", "tgp:nlp:viewer", "tgp:unknown-team:owner", "payroll"]
    oidc_provider.control(login="sub-alice", accounts={"sub-alice": {**ALICE, "groups": groups}})

    # First sign-in: the button, the provider's redirects, back signed in as a new user with the claim's teams.
    page.goto(f"{live_server.url}/login/")
    assert page.locator("#sso-sign-in").inner_text() == "Sign in with Test IdP"
    page.click("#sso-sign-in")
    page.wait_for_selector("nav.mainnav")
    assert page.url == f"{live_server.url}/"
    page.screenshot(path=str(SCREENSHOTS / "sso-signed-in.png"), full_page=True)
    identity = SsoIdentity.objects.select_related("user").get(
        issuer=oidc_provider.issuer, subject="sub-alice"
    )
    alice = identity.user
    assert (alice.username, alice.email, alice.first_name) == ("alice", "alice@corp.example", "Alice")
    assert not alice.has_usable_password()
    roles = {m.team.slug: (m.role, m.source) for m in Membership.objects.filter(user=alice)}
    assert roles == {
        "vision": (Role.MAINTAINER, MembershipSource.SSO),
        "nlp": (Role.VIEWER, MembershipSource.SSO),
    }
    assert AuditEvent.objects.filter(action="member.added", team=vision, details__source="sso").exists()

    # Sign-out ends the platform session.
    page.click("text=Log out alice")
    page.wait_for_url(re.compile(r"/login/"))
    page.goto(f"{live_server.url}/")
    assert "/login/" in page.url

    # The provider drops NLP and makes her a Vision owner: the next sign-in follows, audited.
    oidc_provider.control(
        login="sub-alice", accounts={"sub-alice": {**ALICE, "groups": ["tgp:vision:owner"]}}
    )
    _sign_in_with_sso(page, live_server)
    page.wait_for_selector("nav.mainnav")
    roles = {m.team.slug: m.role for m in Membership.objects.filter(user=alice)}
    assert roles == {"vision": Role.OWNER}
    removed = AuditEvent.objects.get(action="member.removed", team=nlp)
    assert removed.details == {
        "user": "alice",
        "source": "sso",
        "role": "viewer",
        "reason": "no longer in the provider's group",
    }
    changed = AuditEvent.objects.get(action="member.role_changed", team=vision)
    assert (changed.details["from"], changed.details["to"]) == ("maintainer", "owner")
    assert SsoIdentity.objects.filter(subject="sub-alice").count() == 1  # the same account, not a new one

    # A tampered state: the provider's answer is sent back with another state - refused, not signed in.
    page.click("text=Log out alice")
    page.wait_for_url(re.compile(r"/login/"))

    callback = _provider_answer(page, live_server)
    page.goto(re.sub(r"state=[^&]+", "state=forged", callback))
    assert "state does not match" in page.inner_text("#sso-error")
    page.goto(f"{live_server.url}/")
    assert "/login/" in page.url

    # An expired ID token (signed by the provider, exp an hour ago): refused with the reason.
    oidc_provider.control(
        login="sub-alice",
        accounts={"sub-alice": {**ALICE, "groups": ["tgp:vision:owner"]}},
        id_token_expired=True,
    )
    _sign_in_with_sso(page, live_server)
    page.wait_for_selector("#sso-error")
    assert "ID token has expired" in page.inner_text("#sso-error")
    page.screenshot(path=str(SCREENSHOTS / "sso-expired-token.png"), full_page=True)
    page.goto(f"{live_server.url}/")
    assert "/login/" in page.url

    # An issuer mismatch: the platform is configured with another spelling of the provider's address, whose
    # discovery document names the provider's own issuer - refused before the browser leaves for it.
    host = "localhost" if "127.0.0.1" in oidc_provider.issuer else "127.0.0.1"
    settings.OIDC_ISSUER = re.sub(r"//[^:/]+", f"//{host}", oidc_provider.issuer, count=1)
    assert oidc_provider.issuer != settings.OIDC_ISSUER
    _sign_in_with_sso(page, live_server)
    page.wait_for_selector("#sso-error")
    assert "discovery document names the issuer" in page.inner_text("#sso-error")
    page.goto(f"{live_server.url}/")
    assert "/login/" in page.url
