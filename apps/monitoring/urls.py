from django.urls import path

from apps.monitoring import api, compare_api

urlpatterns = [
    path(
        "teams/<slug:team_slug>/models/<slug:model_slug>/metrics/",
        api.ModelMetricsViewSet.as_view({"get": "retrieve"}),
        name="team-model-metrics",
    ),
    path(
        "teams/<slug:team_slug>/models/<slug:model_slug>/compare/",
        compare_api.VersionComparisonViewSet.as_view({"get": "retrieve"}),
        name="team-model-compare",
    ),
    path(
        "teams/<slug:team_slug>/models/<slug:model_slug>/versions/<int:number>/tuning-advice/",
        api.TuningAdviceViewSet.as_view({"get": "retrieve"}),
        name="team-version-tuning-advice",
    ),
    path(
        "instances/<int:pk>/metrics/",
        api.InstanceMetricsViewSet.as_view({"get": "retrieve"}),
        name="instance-metrics",
    ),
    path("metrics/fleet/", api.FleetMetricsViewSet.as_view({"get": "retrieve"}), name="fleet-metrics"),
]
