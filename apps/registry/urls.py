from rest_framework.routers import SimpleRouter

from apps.registry import api, ensemble_api

TEAM = r"teams/(?P<team_slug>[^/.]+)"

router = SimpleRouter()
router.register(f"{TEAM}/models", api.RegisteredModelViewSet, basename="team-model")
router.register(
    f"{TEAM}/models/(?P<model_slug>[^/.]+)/versions", api.ModelVersionViewSet, basename="team-model-version"
)
router.register(
    f"{TEAM}/models/(?P<model_slug>[^/.]+)/ensemble-versions",
    ensemble_api.EnsembleVersionViewSet,
    basename="team-ensemble-version",
)
router.register(f"{TEAM}/uploads", api.UploadViewSet, basename="team-upload")

urlpatterns = router.urls
