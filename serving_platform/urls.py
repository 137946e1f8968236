from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from apps.monitoring import platform_metrics
from serving_platform import health

urlpatterns = [
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("metrics", platform_metrics.metrics_view, name="platform-metrics"),
    path("metrics/targets.json", platform_metrics.targets_view, name="platform-metrics-targets"),
    path("api/v1/", include("serving_platform.api_urls")),
    path("agent/v1/", include("serving_platform.agent_urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
    path("admin/", admin.site.urls),
    path("", include("frontend.urls")),
]

handler404 = "apps.core.exceptions.page_not_found"
handler500 = "apps.core.exceptions.server_error"
