from django.contrib.auth import views as auth_views
from django.urls import path

from frontend import (
    alerts,
    compare,
    conversions,
    deployments,
    ensembles,
    fleet,
    monitoring,
    registry,
    rollouts,
    sso,
    versions,
    views,
)

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("login/", sso.SignInView.as_view(), name="login"),
    path("login/sso/", sso.SsoStartView.as_view(), name="sso-start"),
    path("login/sso/callback/", sso.SsoCallbackView.as_view(), name="sso-callback"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("switch-team/", views.switch_team, name="switch-team"),
    path("teams/new/", views.team_new, name="team-new"),
    path(
        "invitations/<int:pk>/accept/",
        views.answer_invitation,
        {"answer": "accept"},
        name="invitation-accept",
    ),
    path(
        "invitations/<int:pk>/decline/",
        views.answer_invitation,
        {"answer": "decline"},
        name="invitation-decline",
    ),
    path("teams/<slug:team_slug>/settings/", views.TeamSettingsView.as_view(), name="team-settings"),
    path("teams/<slug:team_slug>/audit/", views.AuditLogView.as_view(), name="team-audit"),
    path("teams/<slug:team_slug>/alerts/", alerts.AlertsView.as_view(), name="alerts"),
    path("teams/<slug:team_slug>/models/", registry.ModelListView.as_view(), name="models"),
    path("teams/<slug:team_slug>/models/new/", registry.ModelCreateView.as_view(), name="model-new"),
    path(
        "teams/<slug:team_slug>/models/<slug:model_slug>/",
        registry.ModelDetailView.as_view(),
        name="model-detail",
    ),
    path(
        "teams/<slug:team_slug>/models/<slug:model_slug>/upload/",
        registry.ModelUploadView.as_view(),
        name="model-upload",
    ),
    path(
        "teams/<slug:team_slug>/models/<slug:model_slug>/compose/",
        ensembles.EnsembleComposeView.as_view(),
        name="ensemble-compose",
    ),
    path(
        "teams/<slug:team_slug>/models/<slug:model_slug>/versions/<int:number>/",
        versions.VersionDetailView.as_view(),
        name="version-detail",
    ),
    path(
        "teams/<slug:team_slug>/models/<slug:model_slug>/compare/",
        compare.VersionCompareView.as_view(),
        name="version-compare",
    ),
    path(
        "teams/<slug:team_slug>/conversions/<int:pk>/",
        conversions.ConversionJobView.as_view(),
        name="conversion-job",
    ),
    path(
        "teams/<slug:team_slug>/conversions/<int:pk>/progress/",
        conversions.ConversionJobProgressView.as_view(),
        name="conversion-job-progress",
    ),
    path(
        "teams/<slug:team_slug>/models/<slug:model_slug>/versions/<int:number>/config/",
        conversions.VersionConfigView.as_view(),
        name="version-config-edit",
    ),
    path("teams/<slug:team_slug>/deployments/", deployments.DeploymentListView.as_view(), name="deployments"),
    path(
        "teams/<slug:team_slug>/deployments/new/",
        deployments.DeploymentCreateView.as_view(),
        name="deployment-new",
    ),
    path(
        "teams/<slug:team_slug>/deployments/<int:pk>/",
        deployments.DeploymentDetailView.as_view(),
        name="deployment-detail",
    ),
    path(
        "teams/<slug:team_slug>/deployments/<int:pk>/status/",
        deployments.DeploymentStatusView.as_view(),
        name="deployment-status",
    ),
    path(
        "teams/<slug:team_slug>/deployments/<int:pk>/rollout/",
        rollouts.RolloutPanelView.as_view(),
        name="deployment-rollout",
    ),
    path(
        "teams/<slug:team_slug>/deployments/<int:pk>/playground/",
        deployments.PlaygroundView.as_view(),
        name="deployment-playground",
    ),
    path("hosts/", fleet.HostListView.as_view(), name="hosts"),
    path("hosts/<slug:host_name>/", fleet.HostDetailView.as_view(), name="host-detail"),
    path("pools/<slug:pool_name>/", fleet.PoolDetailView.as_view(), name="pool-detail"),
    path(
        "hosts/<slug:host_name>/instances/<slug:instance_name>/",
        fleet.InstanceDetailView.as_view(),
        name="instance-detail",
    ),
    path(
        "teams/<slug:team_slug>/models/<slug:model_slug>/metrics/",
        monitoring.ModelMetricsView.as_view(),
        name="model-metrics",
    ),
    path(
        "hosts/<slug:host_name>/instances/<slug:instance_name>/metrics/",
        monitoring.InstanceMetricsView.as_view(),
        name="instance-metrics-page",
    ),
    path("fleet/metrics/", monitoring.FleetMetricsView.as_view(), name="fleet-metrics-page"),
]
