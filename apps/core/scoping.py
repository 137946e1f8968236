"""Who may see and change a team's rows: the roles, what each request wants to do, and the queryset method
every tenant-owned model scopes with (``for_user``).

It sits at the bottom of the apps because every app scopes its rows with it, the audit log included, and
the audit log sits below ``apps.teams`` (whose services write audit events). A user's memberships are
reached through the user (``user.memberships``, the reverse of ``teams.Membership.user``), so nothing here
imports an app above it.
"""

from __future__ import annotations

from django.db import models


class Role(models.TextChoices):
    VIEWER = "viewer", "Viewer"
    MAINTAINER = "maintainer", "Maintainer"
    OWNER = "owner", "Owner"


ROLE_RANK = {Role.VIEWER: 1, Role.MAINTAINER: 2, Role.OWNER: 3}


class Action(models.TextChoices):
    """What a request wants to do, and the least role that may do it."""

    VIEW = "view", "read"  # viewer
    CHANGE = "change", "change models and deployments"  # maintainer
    MANAGE = "manage", "manage members and tokens"  # owner


ACTION_MIN_ROLE = {Action.VIEW: Role.VIEWER, Action.CHANGE: Role.MAINTAINER, Action.MANAGE: Role.OWNER}


def role_allows(role: str | None, action: str) -> bool:
    return role is not None and ROLE_RANK[Role(role)] >= ROLE_RANK[ACTION_MIN_ROLE[Action(action)]]


def team_roles(user) -> dict[int, str]:
    """Role per team id for this principal.

    A bearer token narrows the user to the token's team, and a read-only token caps the role at viewer,
    so a leaked read-only token can never change anything. Cached on the user object for the request.
    """
    cached = getattr(user, "_team_roles_cache", None)
    if cached is not None:
        return cached
    roles: dict[int, str] = {}
    if user is not None and user.is_authenticated:
        roles = dict(user.memberships.values_list("team_id", "role"))
        token = getattr(user, "api_token", None)
        if token is not None:
            role = roles.get(token.team_id)
            if role is not None and token.read_only:
                role = Role.VIEWER
            roles = {token.team_id: role} if role is not None else {}
        user._team_roles_cache = roles
    return roles


def team_ids_for(user, action: str) -> list[int]:
    return [team_id for team_id, role in team_roles(user).items() if role_allows(role, action)]


class TeamScopedQuerySet(models.QuerySet):
    """Base queryset of every tenant-owned model. ``team_lookup`` is the path to the owning team."""

    team_lookup = "team"

    def for_user(self, user, action: str = Action.VIEW):
        return self.filter(**{f"{self.team_lookup}__in": team_ids_for(user, action)})
