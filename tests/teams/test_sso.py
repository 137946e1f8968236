"""Single sign-on without a provider: the group claim's mapping, accounts from claims, the ID token's checks
(issuer, expiry with the bounded skew, audience) and the sign-in pages' answers. The real redirect flow is in
tests/oidc."""

from __future__ import annotations

import time

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from django.core.exceptions import ImproperlyConfigured

from apps.audit.models import AuditEvent
from apps.teams import sso
from apps.teams.models import Membership, MembershipSource, Role
from apps.teams.oidc import PlatformOIDCBackend, SsoError
from serving_platform.env import env_int
from tests.factories import MembershipFactory, TeamFactory, UserFactory

ISSUER = "https://idp.example"


@pytest.fixture
def sso_on(settings):
    settings.OIDC_ISSUER = ISSUER
    settings.OIDC_ENABLED = True
    settings.OIDC_RP_CLIENT_ID = "platform"
    settings.OIDC_RP_CLIENT_SECRET = "secret"
    settings.OIDC_PROVIDER_NAME = "Corp SSO"
    return settings


def test_group_claim_maps_prefixed_values_to_teams_and_the_highest_role(settings):
    claims = {
        "groups": [
            "tgp:vision:viewer",
            "tgp:vision:owner",
            "tgp:nlp:maintainer",
            "tgp:bad:admin",
            "tgp:",
            "hr",
        ]
    }
    assert sso.teams_from_claims(claims) == {"vision": Role.OWNER, "nlp": Role.MAINTAINER}
    assert sso.teams_from_claims({"groups": "tgp:nlp:viewer"}) == {"nlp": Role.VIEWER}
    assert sso.teams_from_claims({}) == {}
    settings.OIDC_GROUPS_CLAIM, settings.OIDC_GROUP_PREFIX = "roles", "platform/"
    assert sso.teams_from_claims({"roles": ["platform/vision:viewer"], "groups": ["tgp:nlp:owner"]}) == {
        "vision": Role.VIEWER
    }


@pytest.mark.django_db
def test_a_user_whose_claims_name_no_team_gets_none_and_local_memberships_stay(settings):
    vision, nlp = TeamFactory(slug="vision"), TeamFactory(slug="nlp")
    UserFactory(username="bob")  # a local account with the provider's username is never taken over
    bob = sso.sign_in_user(issuer=ISSUER, claims={"sub": "s-1", "preferred_username": "bob", "groups": ["x"]})
    assert bob.username == "bob-s-1"
    assert not bob.has_usable_password()
    assert not Membership.objects.filter(user=bob).exists()

    MembershipFactory(team=nlp, user=bob, role=Role.VIEWER)  # granted in the platform
    sso.sign_in_user(issuer=ISSUER, claims={"sub": "s-1", "groups": ["tgp:vision:maintainer"]})
    sso.sign_in_user(issuer=ISSUER, claims={"sub": "s-1", "groups": []})
    assert list(Membership.objects.filter(user=bob).values_list("team__slug", "source")) == [
        ("nlp", MembershipSource.LOCAL)
    ]
    actions = list(AuditEvent.objects.filter(team=vision).values_list("action", flat=True))
    assert sorted(actions) == ["member.added", "member.removed"]
    with pytest.raises(sso.SsoClaimsError, match="no subject"):
        sso.sign_in_user(issuer=ISSUER, claims={"preferred_username": "eve"})


@pytest.fixture
def signing_key():
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _token(key, **overrides) -> str:
    now = int(time.time())
    claims = {"iss": ISSUER, "aud": "platform", "sub": "s-1", "iat": now, "exp": now + 300, **overrides}
    return jwt.encode({k: v for k, v in claims.items() if v is not None}, key, algorithm="RS256")


def test_id_token_checks_issuer_expiry_with_bounded_skew_and_audience(sso_on, signing_key):
    backend = PlatformOIDCBackend()
    public = signing_key.public_key()
    assert backend._verify_jws(_token(signing_key), public)["sub"] == "s-1"
    sso_on.OIDC_CLOCK_SKEW_S = 60
    now = int(time.time())
    assert backend._verify_jws(_token(signing_key, exp=now - 30), public)  # within the skew
    with pytest.raises(SsoError, match="ID token has expired"):
        backend._verify_jws(_token(signing_key, exp=now - 120), public)
    with pytest.raises(SsoError, match="issued by 'https://evil.example', not by the configured issuer"):
        backend._verify_jws(_token(signing_key, iss="https://evil.example"), public)
    with pytest.raises(SsoError, match="another client"):
        backend._verify_jws(_token(signing_key, aud="someone-else"), public)
    with pytest.raises(SsoError, match="dated in the future"):
        backend._verify_jws(_token(signing_key, iat=now + 600), public)
    with pytest.raises(SsoError, match="refused"):
        backend._verify_jws(_token(signing_key, exp=None), public)
    with pytest.raises(SsoError, match="not the expected RS256"):
        backend._verify_jws(jwt.encode({"sub": "x"}, "k" * 32, algorithm="HS256"), public)


def test_clock_skew_setting_is_bounded(monkeypatch):
    monkeypatch.setenv("OIDC_CLOCK_SKEW_S", "3600")
    # Its bound is declared with it (serving_platform.config_reference), as every setting's is.
    with pytest.raises(ImproperlyConfigured, match="above the maximum 300"):
        env_int("OIDC_CLOCK_SKEW_S")
    monkeypatch.setenv("OIDC_CLOCK_SKEW_S", "300")
    assert env_int("OIDC_CLOCK_SKEW_S") == 300


@pytest.mark.django_db
def test_sign_in_pages_without_and_with_single_sign_on(client, settings, sso_on):
    sso_on.OIDC_ENABLED = False
    assert client.get("/login/sso/").status_code == 404
    assert "Sign in with" not in client.get("/login/").content.decode()

    sso_on.OIDC_ENABLED = True
    page = client.get("/login/").content.decode()
    assert "Sign in with Corp SSO" in page and 'name="password"' in page
    # An answer for a sign-in this browser never started.
    response = client.get("/login/sso/callback/", {"code": "c", "state": "forged"})
    assert response.status_code == 400
    assert "state does not match" in response.content.decode()
    response = client.get(
        "/login/sso/callback/", {"error": "access_denied", "error_description": "No access"}
    )
    assert response.status_code == 400 and "did not sign you in: No access" in response.content.decode()

    settings.LOCAL_SIGN_IN = False
    page = client.get("/login/").content.decode()
    assert "Sign in with Corp SSO" in page and 'name="password"' not in page
    UserFactory(username="olga")
    response = client.post("/login/", {"username": "olga", "password": "correct horse battery staple"})
    assert response.status_code == 403 and "Passwords are turned off" in response.content.decode()
