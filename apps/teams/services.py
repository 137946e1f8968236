"""Business actions on teams, members and tokens. Each runs in one transaction with its audit event."""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.db.models import Q
from django.http import Http404
from django.utils import timezone
from django.utils.text import slugify

from apps.audit.services import record
from apps.core import priority
from apps.teams.models import (
    TOKEN_SCHEME,
    ApiToken,
    Membership,
    Role,
    Team,
    TeamInvitation,
    hash_token_secret,
    normalise_invitee,
)

User = get_user_model()


def check_slug_free(slug: str) -> None:
    if Team.objects.filter(slug=slug).exists():
        raise ValidationError(
            {"slug": [f"A team with the slug '{slug}' already exists; choose another slug."]}
        )


def create_team(*, actor, name: str, slug: str | None = None) -> Team:
    """Create a team with the actor as its first owner."""
    name = name.strip()
    if not name:
        raise ValidationError({"name": ["Give the team a name."]})
    slug = slug or slugify(name)[:50].strip("-")
    if not slug:
        raise ValidationError({"slug": ["Could not derive a slug from the name; give one explicitly."]})
    with transaction.atomic():
        check_slug_free(slug)
        team = Team(name=name, slug=slug)
        team.full_clean(validate_unique=False)
        team.save()
        Membership.objects.create(team=team, user=actor, role=Role.OWNER)
        record(
            actor=actor, team=team, action="team.created", target=team, details={"name": name, "slug": slug}
        )
    return team


def rename_team(*, actor, team: Team, name: str) -> Team:
    name = name.strip()
    if not name:
        raise ValidationError({"name": ["Give the team a name."]})
    with transaction.atomic():
        old = team.name
        team.name = name
        team.save(update_fields=["name"])
        record(actor=actor, team=team, action="team.renamed", target=team, details={"from": old, "to": name})
    return team


def _check_priority_class(field: str, value, allow_blank: bool) -> str:
    if value == "" and allow_blank:
        return ""
    if value not in priority.CLASSES:
        also = ', or "" for the team\'s default' if allow_blank else ""
        raise ValidationError({field: [f"Use one of {', '.join(priority.CLASSES)}{also}."]})
    return value


def set_default_priority_class(*, actor, team: Team, priority_class: str) -> Team:
    """The class of the team's tokens that name none (owners: Action.MANAGE, checked by the caller)."""
    priority_class = _check_priority_class("default_priority_class", priority_class, allow_blank=False)
    with transaction.atomic():
        old = team.default_priority_class
        if old == priority_class:
            return team
        team.default_priority_class = priority_class
        team.save(update_fields=["default_priority_class"])
        record(
            actor=actor,
            team=team,
            action="team.priority_class_changed",
            target=team,
            details={"from": old, "to": priority_class},
        )
    return team


def set_token_priority_class(*, actor, token: ApiToken, priority_class: str) -> ApiToken:
    """A token's class ("" follows the team's default); the gateway applies it from its next sync."""
    priority_class = _check_priority_class("priority_class", priority_class, allow_blank=True)
    with transaction.atomic():
        old = token.priority_class
        if old == priority_class:
            return token
        token.priority_class = priority_class
        token.save(update_fields=["priority_class"])
        record(
            actor=actor,
            team=token.team,
            action="token.priority_class_changed",
            target=token,
            details={"name": token.name, "from": old, "to": priority_class},
        )
    return token


# The gateway's rate counters are 32-bit and a team above this is a capacity question, not a quota.
MAX_REQUESTS_PER_SECOND = 100_000


def may_change_quotas(actor) -> bool:
    """Quotas are the platform's to give: platform staff in a session (``apps.fleet.models.is_platform_staff``'s
    rule), never a team owner or an API token."""
    return bool(actor.is_staff and getattr(actor, "api_token", None) is None)


def check_requests_per_second(value) -> int:
    """A whole number of requests per second within 1..``MAX_REQUESTS_PER_SECOND``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_REQUESTS_PER_SECOND:
        raise ValidationError(
            {
                "quota_requests_per_second": [
                    f"Give a whole number of requests per second from 1 to {MAX_REQUESTS_PER_SECOND}, "
                    f"not {value!r}."
                ]
            }
        )
    return value


def set_request_rate_quota(*, actor, team: Team, requests_per_second: int) -> Team:
    """Change the team's gateway rate limit; the gateway applies it at its next sync (the save pokes it)."""
    if not may_change_quotas(actor):
        raise PermissionDenied("Only platform staff change a team's quotas.")
    requests_per_second = check_requests_per_second(requests_per_second)
    with transaction.atomic():
        team = Team.objects.select_for_update().get(pk=team.pk)
        old = team.quota_requests_per_second
        if old == requests_per_second:
            return team
        team.quota_requests_per_second = requests_per_second
        team.save(update_fields=["quota_requests_per_second"])
        record(
            actor=actor,
            team=team,
            action="team.quota_changed",
            target=team,
            details={"quota": "requests_per_second", "from": old, "to": requests_per_second},
        )
    return team


def _find_user(identifier: str):
    identifier = identifier.strip()
    user = (
        User.objects.filter(Q(username=identifier) | Q(email__iexact=identifier)).first()
        if identifier
        else None
    )
    if user is None:
        raise ValidationError({"user": [f"No user with the username or email '{identifier}'."]})
    return user


def _check_role(role: str) -> Role:
    try:
        return Role(role)
    except ValueError:
        choices = ", ".join(Role.values)
        raise ValidationError({"role": [f"'{role}' is not a role; use one of: {choices}."]}) from None


def may_learn_accounts(actor) -> bool:
    """Whether ``actor`` may learn which accounts exist: platform staff in a session (the rule of
    ``apps.fleet.models.is_platform_staff``), never a team owner or an API token."""
    return bool(actor.is_staff and getattr(actor, "api_token", None) is None)


def member_request_message(*, team: Team, user_identifier: str, role: str) -> str:
    """What a team owner is told after asking to add someone: the same whether the account exists or not."""
    return (
        f"Invitation recorded: if an account with the username or email "
        f"'{normalise_invitee(user_identifier)}' exists, its user can accept joining {team.name} as "
        f"{Role(role).value} within {settings.TEAM_INVITATION_DAYS} days."
    )


def add_member(*, actor, team: Team, user_identifier: str, role: str) -> Membership:
    """Add an existing account to the team at once. Only for platform staff (``may_learn_accounts``): it tells
    whether the account exists; everyone else invites (``invite_member``)."""
    if not may_learn_accounts(actor):
        raise PermissionDenied("Only platform staff add members directly; team owners invite them.")
    role = _check_role(role)
    user = _find_user(user_identifier)
    with transaction.atomic():
        if Membership.objects.filter(team=team, user=user).exists():
            raise ValidationError({"user": [f"{user.get_username()} is already a member of {team.name}."]})
        membership = Membership.objects.create(team=team, user=user, role=role)
        record(
            actor=actor,
            team=team,
            action="member.added",
            target=membership,
            details={"user": user.get_username(), "role": role},
        )
    return membership


def invite_member(*, actor, team: Team, user_identifier: str, role: str) -> TeamInvitation:
    """Record a pending invitation for a username or email, without looking up whether the account exists
    (nor whether it is already a member): the owner's answer must be the same either way. Inviting the same
    person again while an invitation is pending returns that invitation (with the new role)."""
    role = _check_role(role)
    invitee = normalise_invitee(user_identifier)
    if not invitee:
        raise ValidationError({"user": ["Give a username or email."]})
    if len(invitee) > TeamInvitation._meta.get_field("invitee").max_length:
        raise ValidationError({"user": ["That username or email is too long."]})
    with transaction.atomic():
        # Lock the team row so two concurrent invitations of the same person cannot both be created.
        Team.objects.select_for_update().filter(pk=team.pk).first()
        invitation = TeamInvitation.objects.pending().filter(team=team, invitee=invitee).first()
        if invitation is not None:
            if invitation.role != role:
                invitation.role = role
                invitation.save(update_fields=["role"])
                record(
                    actor=actor,
                    team=team,
                    action="member.invited",
                    target=invitation,
                    details={"invitee": invitee, "role": role, "again": True},
                )
            return invitation
        invitation = TeamInvitation.objects.create(
            team=team,
            invitee=invitee,
            role=role,
            invited_by=actor,
            expires_at=timezone.now() + timedelta(days=settings.TEAM_INVITATION_DAYS),
        )
        record(
            actor=actor,
            team=team,
            action="member.invited",
            target=invitation,
            details={"invitee": invitee, "role": role},
        )
    return invitation


def revoke_invitation(*, actor, invitation: TeamInvitation) -> TeamInvitation:
    """Withdraw a pending invitation; revoking one that is no longer pending changes nothing."""
    with transaction.atomic():
        updated = TeamInvitation.objects.pending().filter(pk=invitation.pk).update(revoked_at=timezone.now())
        invitation.refresh_from_db()
        if updated:
            record(
                actor=actor,
                team=invitation.team,
                action="invitation.revoked",
                target=invitation,
                details={"invitee": invitation.invitee, "role": invitation.role},
            )
    return invitation


def _lock_own_invitation(user, invitation_id) -> TeamInvitation:
    """The invitation, locked, if it is addressed to ``user``; otherwise a 404 (never someone else's)."""
    invitation = (
        TeamInvitation.objects.select_for_update()
        .addressed_to(user)
        .filter(pk=invitation_id)
        .select_related("team")
        .first()
    )
    if invitation is None:
        raise Http404("No such invitation.")
    status = invitation.status
    if status != "pending":
        raise ValidationError({"invitation": [f"This invitation is {status} and can no longer be answered."]})
    return invitation


def accept_invitation(*, user, invitation_id) -> Membership:
    """Join the team with the invited role. Already a member: the membership stays as it is."""
    with transaction.atomic():
        invitation = _lock_own_invitation(user, invitation_id)
        now = timezone.now()
        invitation.accepted_at = now
        invitation.accepted_by = user
        invitation.save(update_fields=["accepted_at", "accepted_by"])
        membership, created = Membership.objects.get_or_create(
            team=invitation.team, user=user, defaults={"role": invitation.role}
        )
        record(
            actor=user,
            team=invitation.team,
            action="member.joined",
            target=membership,
            details={
                "user": user.get_username(),
                "role": membership.role,
                "invitation": invitation.pk,
                "already_member": not created,
            },
        )
    return membership


def decline_invitation(*, user, invitation_id) -> TeamInvitation:
    with transaction.atomic():
        invitation = _lock_own_invitation(user, invitation_id)
        invitation.declined_at = timezone.now()
        invitation.save(update_fields=["declined_at"])
        record(
            actor=user,
            team=invitation.team,
            action="invitation.declined",
            target=invitation,
            details={"user": user.get_username(), "invitation": invitation.pk},
        )
    return invitation


def _check_keeps_an_owner(team: Team, membership: Membership) -> None:
    # Lock the owners so two concurrent demotions cannot both see "another owner remains".
    owners = list(
        Membership.objects.select_for_update().filter(team=team, role=Role.OWNER).values_list("pk", flat=True)
    )
    if owners == [membership.pk]:
        raise ValidationError({"role": ["A team needs at least one owner: make another member owner first."]})


def change_member_role(*, actor, membership: Membership, role: str) -> Membership:
    role = _check_role(role)
    with transaction.atomic():
        if membership.role == Role.OWNER and role != Role.OWNER:
            _check_keeps_an_owner(membership.team, membership)
        old = membership.role
        membership.role = role
        membership.save(update_fields=["role"])
        record(
            actor=actor,
            team=membership.team,
            action="member.role_changed",
            target=membership,
            details={"user": membership.user.get_username(), "from": old, "to": role},
        )
    return membership


def remove_member(*, actor, membership: Membership) -> None:
    with transaction.atomic():
        if membership.role == Role.OWNER:
            _check_keeps_an_owner(membership.team, membership)
        record(
            actor=actor,
            team=membership.team,
            action="member.removed",
            target=membership,
            details={"user": membership.user.get_username(), "role": membership.role},
        )
        membership.delete()


def _new_prefix() -> str:
    while True:
        prefix = secrets.token_hex(4)
        if not ApiToken.objects.filter(prefix=prefix).exists():
            return prefix


def create_token(
    *,
    actor,
    team: Team,
    name: str,
    read_only: bool = False,
    expires_at: datetime | None = None,
    inference_only: bool = False,
    priority_class: str = "",
) -> tuple[ApiToken, str]:
    """Create a token; returns it with its plaintext, which is never stored and cannot be shown again."""
    name = name.strip()
    if not name:
        raise ValidationError({"name": ["Give the token a name that says where it is used."]})
    if expires_at is not None and expires_at <= timezone.now():
        raise ValidationError({"expires_at": ["The expiry must be in the future."]})
    priority_class = _check_priority_class("priority_class", priority_class, allow_blank=True)
    secret = secrets.token_urlsafe(32)
    with transaction.atomic():
        prefix = _new_prefix()
        token = ApiToken.objects.create(
            team=team,
            name=name,
            prefix=prefix,
            secret_hash=hash_token_secret(secret),
            read_only=read_only,
            inference_only=inference_only,
            priority_class=priority_class,
            created_by=actor,
            expires_at=expires_at,
        )
        record(
            actor=actor,
            team=team,
            action="token.created",
            target=token,
            details={
                "name": name,
                "read_only": read_only,
                "inference_only": inference_only,
                "priority_class": priority_class,
                "expires_at": expires_at.isoformat() if expires_at else None,
            },
        )
    return token, f"{TOKEN_SCHEME}_{prefix}_{secret}"


def revoke_token(*, actor, token: ApiToken) -> ApiToken:
    """Revoke a token; revoking twice is harmless and records nothing new."""
    with transaction.atomic():
        updated = ApiToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(
            revoked_at=timezone.now()
        )
        token.refresh_from_db()
        if updated:
            record(
                actor=actor,
                team=token.team,
                action="token.revoked",
                target=token,
                details={"name": token.name},
            )
    return token


def touch_token_last_used(token: ApiToken, now: datetime | None = None) -> None:
    """Record use at most once a minute: a conditional UPDATE, so busy clients cost no extra writes."""
    now = now or timezone.now()
    threshold = now - settings.API_TOKEN_LAST_USED_RESOLUTION
    ApiToken.objects.filter(pk=token.pk).filter(
        Q(last_used_at__isnull=True) | Q(last_used_at__lt=threshold)
    ).update(last_used_at=now)
