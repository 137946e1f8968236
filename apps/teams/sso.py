"""Single sign-on accounts: a verified set of OpenID Connect claims becomes a platform user, and its group claim
becomes team memberships.

Protocol work (discovery, tokens, signatures) is in ``apps.teams.oidc``; this module only ever sees claims that
were already verified. Memberships granted from the claim (``MembershipSource.SSO``) follow it at every sign-in:
created, re-roled, or removed when the group is gone. Memberships granted in the platform are left alone.
"""

from __future__ import annotations

import logging
import re

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from apps.audit.services import record
from apps.teams.models import ROLE_RANK, Membership, MembershipSource, Role, SsoIdentity, Team

logger = logging.getLogger(__name__)
User = get_user_model()

_USERNAME_UNSAFE = re.compile(r"[^\w.@+-]")


class SsoClaimsError(Exception):
    """The provider's claims cannot make an account (no subject, an unusable name)."""


def teams_from_claims(claims: dict) -> dict[str, Role]:
    """The team slug -> role that the group claim grants. Values without the prefix are someone else's
    groups and are ignored; an unknown role is ignored (logged); the highest role wins when a team is named
    twice."""
    raw = claims.get(settings.OIDC_GROUPS_CLAIM) or []
    if isinstance(raw, str):  # some providers send a single group as a string
        raw = [raw]
    prefix = settings.OIDC_GROUP_PREFIX
    granted: dict[str, Role] = {}
    for value in raw:
        if not isinstance(value, str) or not value.startswith(prefix):
            continue
        slug, sep, role_name = value[len(prefix) :].rpartition(":")
        try:
            role = Role(role_name)
        except ValueError:
            role = None
        if not sep or not slug or role is None:
            logger.warning("single sign-on: ignoring group %r (expected %s<team>:<role>)", value, prefix)
            continue
        if slug not in granted or ROLE_RANK[role] > ROLE_RANK[granted[slug]]:
            granted[slug] = role
    return granted


def _free_username(wanted: str, subject: str) -> str:
    """The provider's username if no platform account has it; else it with a suffix from the subject. An
    existing local account is never taken over by a provider account that happens to share its name."""
    base = _USERNAME_UNSAFE.sub("-", wanted)[:120] or "sso-user"
    if not User.objects.filter(username=base).exists():
        return base
    for length in (8, 16, 32):
        candidate = f"{base}-{_USERNAME_UNSAFE.sub('', subject)[:length] or 'sso'}"
        if not User.objects.filter(username=candidate).exists():
            return candidate
    raise SsoClaimsError(f"no free username for {wanted!r}")


def sign_in_user(*, issuer: str, claims: dict):
    """The platform user for these verified claims: created at the first sign-in, its email and name kept
    up to date, its memberships synchronised with the group claim. Returns the user."""
    subject = claims.get("sub")
    if not isinstance(subject, str) or not subject:
        raise SsoClaimsError("the identity provider sent no subject (sub) for the account")
    email = claims.get("email") if isinstance(claims.get("email"), str) else ""
    with transaction.atomic():
        identity = (
            SsoIdentity.objects.select_for_update()
            .select_related("user")
            .filter(issuer=issuer, subject=subject)
            .first()
        )
        if identity is None:
            wanted = claims.get(settings.OIDC_USERNAME_CLAIM)
            if not isinstance(wanted, str) or not wanted.strip():
                wanted = email.split("@")[0] if email else f"sso-{subject}"
            # No password given: an unusable one, so the account signs in through the provider only.
            user = User.objects.create_user(_free_username(wanted.strip(), subject), email=email)
            identity = SsoIdentity.objects.create(user=user, issuer=issuer, subject=subject)
            record(
                actor=user, team=None, action="user.created_by_sso", target=user, details={"issuer": issuer}
            )
        user = identity.user
        changed = []
        if email and user.email != email:
            user.email = email
            changed.append("email")
        for field, claim in (("first_name", "given_name"), ("last_name", "family_name")):
            value = claims.get(claim)
            if isinstance(value, str) and getattr(user, field) != value[:150]:
                setattr(user, field, value[:150])
                changed.append(field)
        if changed:
            user.save(update_fields=changed)
        identity.last_sign_in_at = timezone.now()
        identity.save(update_fields=["last_sign_in_at"])
        sync_memberships(user, teams_from_claims(claims))
    return user


def sync_memberships(user, granted: dict[str, Role]) -> None:
    """Make the user's single sign-on memberships those of ``granted``, each change audited in its team."""
    teams = {team.slug: team for team in Team.objects.filter(slug__in=granted)}
    for slug in granted.keys() - teams.keys():
        logger.warning("single sign-on: %s's group names team %r, which does not exist", user, slug)
    current = {
        m.team.slug: m
        for m in Membership.objects.select_for_update().select_related("team").filter(user=user)
    }
    details = {"user": user.get_username(), "source": "sso"}
    for slug, role in granted.items():
        team = teams.get(slug)
        if team is None:
            continue
        membership = current.get(slug)
        if membership is None:
            membership = Membership.objects.create(
                team=team, user=user, role=role, source=MembershipSource.SSO
            )
            record(
                actor=None,
                team=team,
                action="member.added",
                target=membership,
                details={**details, "role": role},
            )
        elif membership.role != role or membership.source != MembershipSource.SSO:
            # The claim names this team: the membership is the provider's from now on, with its role.
            old = membership.role
            membership.role, membership.source = role, MembershipSource.SSO
            membership.save(update_fields=["role", "source"])
            if old != role:
                record(
                    actor=None,
                    team=team,
                    action="member.role_changed",
                    target=membership,
                    details={**details, "from": old, "to": role},
                )
    for slug, membership in current.items():
        if membership.source == MembershipSource.SSO and slug not in granted:
            record(
                actor=None,
                team=membership.team,
                action="member.removed",
                target=membership,
                details={**details, "role": membership.role, "reason": "no longer in the provider's group"},
            )
            membership.delete()
