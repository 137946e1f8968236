"""``{% traffic_split deployment %}``: which version serves where and at what share of the unversioned
requests (the model list and the model page)."""

from django import template

from apps.deployments.models import Deployment, DeploymentState

register = template.Library()


@register.inclusion_tag("frontend/deployments/partials/traffic_split.html")
def traffic_split(deployment: Deployment | None, rollout_only: bool = False) -> dict:
    """``rollout_only``: nothing unless a rollout splits the traffic (where the placements are listed anyway)."""
    if deployment is None or deployment.state == DeploymentState.UNDEPLOYED:
        return {"rows": []}
    rows = deployment.traffic_split()
    return {"rows": rows if len(rows) > 1 or not rollout_only else []}
