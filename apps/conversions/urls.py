from django.urls import path
from rest_framework.routers import SimpleRouter

from apps.conversions import api

router = SimpleRouter()
router.register(
    r"teams/(?P<team_slug>[^/.]+)/conversion-jobs", api.ConversionJobViewSet, basename="conversion-job"
)

version_config = api.VersionConfigViewSet.as_view({"get": "retrieve", "put": "update"})
derive_version = api.VersionConfigViewSet.as_view({"post": "derive"})

urlpatterns = [
    path(
        "teams/<str:team_slug>/models/<str:model_slug>/versions/<int:number>/config/",
        version_config,
        name="version-config",
    ),
    path(
        "teams/<str:team_slug>/models/<str:model_slug>/versions/<int:number>/config/derive/",
        derive_version,
        name="version-derive",
    ),
    *router.urls,
]
