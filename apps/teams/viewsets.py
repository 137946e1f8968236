"""The one base viewset for tenant-owned objects.

Tenant resources live under ``/api/v1/teams/<team_slug>/...``. The team is looked up through
``Team.objects.for_user(user, "view")``: a team the user is not in is a 404 (never a 403 that confirms it
exists). Within a visible team, the action's least role is checked and a lower role gets a 403 that says
which role is needed. It lives with ``Team``, which it looks up; the rule it applies (roles, ``for_user``)
is ``apps.core.scoping``.
"""

from __future__ import annotations

from functools import cached_property

from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import viewsets
from rest_framework.exceptions import PermissionDenied

from apps.core.scoping import ACTION_MIN_ROLE, Action, role_allows, team_roles
from apps.teams.models import Team

# DRF action -> what it does to the team's data.
DEFAULT_ACTIONS = {
    "list": Action.VIEW,
    "retrieve": Action.VIEW,
    "create": Action.CHANGE,
    "update": Action.CHANGE,
    "partial_update": Action.CHANGE,
    "destroy": Action.CHANGE,
}


def check_team_action(user, team: Team, action: str) -> None:
    role = team_roles(user).get(team.pk)
    if not role_allows(role, action):
        needed = ACTION_MIN_ROLE[Action(action)]
        via_token = (
            " (this API token is read-only)"
            if getattr(getattr(user, "api_token", None), "read_only", False)
            else ""
        )
        raise PermissionDenied(
            f"Your role in team '{team.slug}' is {role}{via_token}; to {Action(action).label} you need the role {needed.value}."
        )


@extend_schema(
    parameters=[
        OpenApiParameter("team_slug", OpenApiTypes.STR, OpenApiParameter.PATH, description="The team's slug.")
    ]
)
class TeamScopedViewSet(viewsets.GenericViewSet):
    """Base for every viewset of tenant-owned rows. Subclasses set ``queryset`` (a TeamScopedQuerySet) and
    may override ``action_requirements`` for actions that need more than the default role."""

    action_requirements: dict[str, str] = {}
    team_url_kwarg = "team_slug"

    @cached_property
    def team(self) -> Team:
        return get_object_or_404(
            Team.objects.for_user(self.request.user, Action.VIEW), slug=self.kwargs[self.team_url_kwarg]
        )

    def required_action(self) -> str:
        return self.action_requirements.get(self.action) or DEFAULT_ACTIONS.get(self.action, Action.CHANGE)

    def initial(self, request, *args, **kwargs):
        super().initial(request, *args, **kwargs)
        if self.team_url_kwarg in kwargs:
            check_team_action(request.user, self.team, self.required_action())

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):  # schema generation has no request team
            return super().get_queryset().none()
        return super().get_queryset().for_user(self.request.user, Action.VIEW).filter(team=self.team)
