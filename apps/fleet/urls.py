from django.urls import path

from apps.fleet import agent_api

urlpatterns = [
    path(
        "agent/versions/<int:version_id>/manifest", agent_api.version_manifest, name="agent-version-manifest"
    ),
    path(
        "agent/versions/<int:version_id>/files/<path:path>", agent_api.version_file, name="agent-version-file"
    ),
]
