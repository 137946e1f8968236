"""The OpenID Connect side of single sign-on, on mozilla-django-oidc: discovery, the token exchange and the
ID token's checks. The library checks state, nonce and PKCE; it does not check the issuer, the audience or
bound the clock skew, so ``_verify_jws`` does that here. Every refusal is an ``SsoError`` with a message a
person can act on; the views (``frontend.sso``) show it on an error page.
"""

from __future__ import annotations

import threading

import jwt
import requests
from django.conf import settings
from django.contrib.auth import get_user_model
from mozilla_django_oidc.auth import OIDCAuthenticationBackend

from apps.teams import sso


class SsoError(Exception):
    """A sign-in the platform refuses; ``status`` is the HTTP status of the error page."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


_metadata: dict[str, dict] = {}
_metadata_lock = threading.Lock()


def provider_metadata() -> dict:
    """The issuer's discovery document, fetched once per process. Its ``issuer`` must be the configured one
    (OpenID Connect Discovery 1.0, section 4.3), or a document from elsewhere could redirect the sign-in."""
    issuer = settings.OIDC_ISSUER
    with _metadata_lock:
        if issuer in _metadata:
            return _metadata[issuer]
        url = issuer.rstrip("/") + "/.well-known/openid-configuration"
        try:
            response = requests.get(url, timeout=settings.OIDC_TIMEOUT)
            response.raise_for_status()
            document = response.json()
        except (requests.RequestException, ValueError) as exc:
            raise SsoError(f"The identity provider could not be reached ({url}): {exc}", status=502) from None
        if document.get("issuer") != issuer:
            raise SsoError(
                f"The identity provider's discovery document names the issuer {document.get('issuer')!r}, "
                f"not the configured OIDC_ISSUER {issuer!r}.",
                status=502,
            )
        missing = [k for k in ("authorization_endpoint", "token_endpoint", "jwks_uri") if not document.get(k)]
        if missing:
            raise SsoError(
                f"The identity provider's discovery document lacks {', '.join(missing)}.", status=502
            )
        _metadata[issuer] = document
        return document


class PlatformOIDCBackend(OIDCAuthenticationBackend):
    """Signs in with the authorization code the provider sent back; users and memberships by ``apps.teams.sso``."""

    def __init__(self, *args, **kwargs):
        # Not the library's __init__: Django builds every backend for every sign-in, passwords included, and
        # that must not depend on the identity provider answering. Endpoints are read when first used.
        self.OIDC_RP_CLIENT_ID = settings.OIDC_RP_CLIENT_ID
        self.OIDC_RP_CLIENT_SECRET = settings.OIDC_RP_CLIENT_SECRET
        self.OIDC_RP_SIGN_ALGO = settings.OIDC_RP_SIGN_ALGO
        self.OIDC_RP_IDP_SIGN_KEY = None
        self.UserModel = get_user_model()

    @property
    def OIDC_OP_TOKEN_ENDPOINT(self) -> str:  # noqa: N802 - the library's attribute name
        return provider_metadata()["token_endpoint"]

    @property
    def OIDC_OP_USER_ENDPOINT(self) -> str | None:  # noqa: N802
        return provider_metadata().get("userinfo_endpoint")

    @property
    def OIDC_OP_JWKS_ENDPOINT(self) -> str:  # noqa: N802
        return provider_metadata()["jwks_uri"]

    def _verify_jws(self, payload, key):
        try:
            header = jwt.get_unverified_header(payload)
        except jwt.InvalidTokenError:
            raise SsoError("The identity provider's ID token is not a readable JWT.") from None
        if header.get("alg") != self.OIDC_RP_SIGN_ALGO:
            raise SsoError(
                f"The ID token is signed with {header.get('alg')!r}, not the expected {self.OIDC_RP_SIGN_ALGO}."
            )
        issuer = settings.OIDC_ISSUER
        try:
            return jwt.decode(
                payload,
                key,
                algorithms=[self.OIDC_RP_SIGN_ALGO],
                audience=self.OIDC_RP_CLIENT_ID,
                issuer=issuer,
                leeway=settings.OIDC_CLOCK_SKEW_S,
                options={"require": ["exp", "iat", "iss", "aud", "sub"]},
            )
        except jwt.ExpiredSignatureError:
            raise SsoError(
                "The identity provider's ID token has expired. Sign in again; if this repeats, check that the "
                "clocks of the platform and the identity provider agree."
            ) from None
        except jwt.InvalidIssuerError:
            claimed = jwt.decode(payload, options={"verify_signature": False}).get("iss")
            raise SsoError(
                f"The ID token was issued by {claimed!r}, not by the configured issuer {issuer!r}."
            ) from None
        except jwt.InvalidAudienceError:
            raise SsoError("The ID token was issued for another client (its audience is not ours).") from None
        except jwt.ImmatureSignatureError:
            raise SsoError(
                "The ID token is dated in the future: the clocks of the platform and the identity provider "
                "disagree by more than OIDC_CLOCK_SKEW_S."
            ) from None
        except jwt.InvalidTokenError as exc:
            raise SsoError(f"The identity provider's ID token was refused: {exc}.") from None

    def verify_token(self, token, **kwargs):
        try:
            key = self.retrieve_matching_jwk(token)
        except requests.RequestException as exc:
            raise SsoError(f"The identity provider's signing keys could not be fetched: {exc}", 502) from None
        except Exception as exc:  # the library's SuspiciousOperation, or a malformed key set
            raise SsoError(f"No signing key of the identity provider matches the ID token ({exc}).") from None
        payload = self._verify_jws(token, key)
        if "nonce" in kwargs and payload.get("nonce") != kwargs["nonce"]:
            # The token answers another sign-in request than the one this browser started: a replay.
            raise SsoError("The ID token's nonce does not match this sign-in. Sign in again.")
        return payload

    def get_or_create_user(self, access_token, id_token, payload):
        claims = dict(payload)
        if self.OIDC_OP_USER_ENDPOINT and access_token:
            try:
                info = self.get_userinfo(access_token, id_token, payload)
            except requests.RequestException as exc:
                raise SsoError(f"The identity provider's userinfo endpoint failed: {exc}", 502) from None
            if info.get("sub") != payload.get("sub"):
                raise SsoError("The identity provider's userinfo answer is about another account.")
            claims.update(info)
        try:
            return sso.sign_in_user(issuer=settings.OIDC_ISSUER, claims=claims)
        except sso.SsoClaimsError as exc:
            raise SsoError(
                f"No platform account can be made from the identity provider's answer: {exc}."
            ) from None
