"""The one base page view for team pages: the same ``for_user`` scoping as the API's base viewset."""

from __future__ import annotations

from django.contrib.auth.mixins import LoginRequiredMixin
from django.core.exceptions import PermissionDenied
from django.shortcuts import get_object_or_404
from django.views.generic import TemplateView

from apps.teams.models import ACTION_MIN_ROLE, Action, Team, role_allows, team_roles

# The extra tag of a flash message that describes a state the page follows ("this page follows it until
# it serves"): base.html gives it the id "state-flash"; the polled partial removes it once the state has
# settled, and a page rendered with ``state_settled`` leaves it out.
FOLLOWS_STATE = "follows-state"


class TeamPageView(LoginRequiredMixin, TemplateView):
    """A page about one team, addressed as /teams/<team_slug>/...

    A team the user is not in is a 404. ``required_action`` guards GET; POST handlers call
    ``require(action)`` for what they change. Visiting a team's page makes it the current team.
    """

    required_action: str = Action.VIEW

    def dispatch(self, request, *args, **kwargs):
        if not request.user.is_authenticated:
            return self.handle_no_permission()
        self.team = get_object_or_404(
            Team.objects.for_user(request.user, Action.VIEW), slug=kwargs["team_slug"]
        )
        self.role = team_roles(request.user).get(self.team.pk)
        self.require(self.required_action)
        request.session["team_slug"] = self.team.slug
        return super().dispatch(request, *args, **kwargs)

    def require(self, action: str) -> None:
        if not role_allows(self.role, action):
            needed = ACTION_MIN_ROLE[Action(action)].value
            raise PermissionDenied(f"Your role in {self.team.name} is {self.role}; this needs {needed}.")

    def can(self, action: str) -> bool:
        return role_allows(self.role, action)

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context.update(
            team=self.team,
            role=self.role,
            can_change=self.can(Action.CHANGE),
            can_manage=self.can(Action.MANAGE),
        )
        return context
