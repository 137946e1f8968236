"""Every app's API routes, mounted under /api/v1/."""

from django.urls import include, path

urlpatterns = [
    path("", include("apps.teams.urls")),
    path("", include("apps.conversions.urls")),
    path("", include("apps.registry.urls")),
    path("", include("apps.fleet.urls")),
    path("", include("apps.deployments.urls")),
    path("", include("apps.monitoring.urls")),
    path("", include("apps.alerts.urls")),
]
