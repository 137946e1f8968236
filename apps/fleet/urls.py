from django.urls import path
from rest_framework.routers import SimpleRouter

from apps.fleet import agent_api, api

router = SimpleRouter()
router.register("hosts", api.HostViewSet, basename="host")
router.register("instances", api.InstanceViewSet, basename="instance")

urlpatterns = [
    path(
        "agent/versions/<int:version_id>/manifest", agent_api.version_manifest, name="agent-version-manifest"
    ),
    path(
        "agent/versions/<int:version_id>/files/<path:path>", agent_api.version_file, name="agent-version-file"
    ),
    *router.urls,
]
