from __future__ import annotations

import hmac

from django.utils import timezone
from rest_framework import authentication, exceptions

from apps.core.credentials import HOST_SCHEMES
from apps.teams.models import TOKEN_SCHEME, ApiToken, Membership, hash_token_secret
from apps.teams.services import touch_token_last_used


def parse_token(raw: str) -> tuple[str, str] | None:
    """``tgp_<prefix>_<secret>`` -> (prefix, secret), or None when it is not shaped like our tokens."""
    scheme, sep, rest = raw.partition("_")
    prefix, sep2, secret = rest.partition("_")
    if scheme != TOKEN_SCHEME or not sep or not sep2 or not prefix or not secret:
        return None
    return prefix, secret


class BearerTokenAuthentication(authentication.BaseAuthentication):
    """``Authorization: Bearer tgp_...``. The request runs as the token's creator, narrowed to the token's
    team (see ``apps.teams.models.team_roles``)."""

    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode("latin-1")
        if not header:
            return None
        keyword, _, raw = header.partition(" ")
        if keyword.lower() != self.keyword.lower():
            return None
        raw = raw.strip()
        if raw.partition("_")[0] in HOST_SCHEMES:
            # A host's credential opens the agent API only; to it the management API does not exist.
            raise exceptions.NotFound("Not found.")
        parsed = parse_token(raw)
        if parsed is None:
            raise exceptions.AuthenticationFailed(
                "Malformed API token: expected 'Authorization: Bearer tgp_<prefix>_<secret>'."
            )
        prefix, secret = parsed
        token = ApiToken.objects.select_related("created_by", "team").filter(prefix=prefix).first()
        if token is None or not hmac.compare_digest(token.secret_hash, hash_token_secret(secret)):
            raise exceptions.AuthenticationFailed("Invalid API token.")
        now = timezone.now()
        if token.revoked_at is not None:
            raise exceptions.AuthenticationFailed(f"API token {token.display_prefix} was revoked.")
        if token.is_expired(now):
            raise exceptions.AuthenticationFailed(
                f"API token {token.display_prefix} expired at {token.expires_at:%Y-%m-%d %H:%M} UTC; create a new one."
            )
        if token.inference_only:
            raise exceptions.PermissionDenied(
                f"API token {token.display_prefix} is an inference-only token: it calls models through the "
                "inference gateway and cannot use the management API."
            )
        user = token.created_by
        if not user.is_active or not Membership.objects.filter(team=token.team, user=user).exists():
            raise exceptions.AuthenticationFailed(
                f"API token {token.display_prefix} belongs to a user who is no longer an active member of the team."
            )
        touch_token_last_used(token, now)
        user.api_token = token
        return user, token

    def authenticate_header(self, request) -> str:
        return f'{self.keyword} realm="api"'
