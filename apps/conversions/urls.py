from django.urls import path
from rest_framework.routers import SimpleRouter

from apps.conversions import api

router = SimpleRouter()
router.register(
    r"teams/(?P<team_slug>[^/.]+)/conversion-jobs", api.ConversionJobViewSet, basename="conversion-job"
)

version_config = api.VersionConfigViewSet.as_view({"get": "retrieve", "put": "update"})

urlpatterns = [
    path(
        "teams/<str:team_slug>/models/<str:model_slug>/versions/<int:number>/config/",
        version_config,
        name="version-config",
    ),
    *router.urls,
]
