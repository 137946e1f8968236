from apps.alerts.models import Alert, AlertState
from apps.teams.models import Action, Team, team_roles


def navigation(request) -> dict:
    """Teams for the switcher, the current team and its count of firing alerts (the top bar's badge)."""
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {}
    teams = list(Team.objects.for_user(user, Action.VIEW))
    current = current_team(request, teams)
    firing = 0
    if current is not None:
        firing = Alert.objects.for_user(user).filter(team=current, state=AlertState.FIRING).count()
    return {
        "nav_teams": teams,
        "current_team": current,
        "current_role": team_roles(user).get(current.pk) if current else None,
        "firing_alert_count": firing,
    }


def current_team(request, teams: list[Team] | None = None) -> Team | None:
    """The team picked in the switcher (kept in the session), else the user's first team."""
    if teams is None:
        teams = list(Team.objects.for_user(request.user, Action.VIEW))
    slug = request.session.get("team_slug")
    for team in teams:
        if team.slug == slug:
            return team
    return teams[0] if teams else None
