"""The agent API (``/agent/v1/``): host agents only, with their host's credential (``apps.fleet.agent_api``)."""

from django.urls import path

from apps.deployments import agent_api as deployments_agent_api
from apps.fleet import agent_api as fleet_agent_api

urlpatterns = [
    path("join", fleet_agent_api.join, name="agent-join"),
    path("heartbeat", fleet_agent_api.heartbeat, name="agent-heartbeat"),
    path("instances/<int:instance_id>/state", fleet_agent_api.instance_state, name="agent-instance-state"),
    path("desired-state", deployments_agent_api.desired_state, name="agent-desired-state"),
    path(
        "placements/<int:placement_id>/report",
        deployments_agent_api.placement_report,
        name="agent-placement-report",
    ),
    path(
        "versions/<int:version_id>/manifest",
        deployments_agent_api.version_manifest,
        name="agent-v1-version-manifest",
    ),
    path(
        "versions/<int:version_id>/files/<path:path>",
        deployments_agent_api.version_file,
        name="agent-v1-version-file",
    ),
]
