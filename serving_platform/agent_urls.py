"""The agent API (``/agent/v1/``): host agents only, with their host's credential (``apps.fleet.agent_api``)."""

from django.http import JsonResponse
from django.urls import path
from django.views.decorators.http import require_POST

from apps.deployments import agent_api as deployments_agent_api
from apps.fleet import agent_api as fleet_agent_api
from apps.fleet.models import TritonInstance
from apps.monitoring.services import record_final_counts


@require_POST
@fleet_agent_api.host_only
def final_counts(request, instance_id: int):
    """A version's last counters, read by the agent just before it unloaded it (``apps.monitoring``)."""
    if not TritonInstance.objects.filter(pk=instance_id, host=request.host).exists():
        return fleet_agent_api.error(404, "not_found", "No such instance on this host.")
    try:
        rows = record_final_counts(instance_id, fleet_agent_api.read_json(request))
    except ValueError as exc:
        return fleet_agent_api.error(400, "invalid", str(exc))
    return JsonResponse({"rows": rows})


urlpatterns = [
    path("join", fleet_agent_api.join, name="agent-join"),
    path("heartbeat", fleet_agent_api.heartbeat, name="agent-heartbeat"),
    path("instances/<int:instance_id>/state", fleet_agent_api.instance_state, name="agent-instance-state"),
    path("instances/<int:instance_id>/final-counts", final_counts, name="agent-final-counts"),
    path("desired-state", deployments_agent_api.desired_state, name="agent-desired-state"),
    path(
        "placements/<int:placement_id>/report",
        deployments_agent_api.placement_report,
        name="agent-placement-report",
    ),
    path("tunings/<int:job_id>/report", deployments_agent_api.tuning_report, name="agent-tuning-report"),
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
