from rest_framework.routers import SimpleRouter

from apps.deployments import api, rollout_api, tuning_api

router = SimpleRouter()
router.register(r"teams/(?P<team_slug>[^/.]+)/deployments", api.DeploymentViewSet, basename="team-deployment")
router.register(
    r"teams/(?P<team_slug>[^/.]+)/deployments/(?P<deployment_pk>[0-9]+)/rollouts",
    rollout_api.RolloutViewSet,
    basename="team-deployment-rollout",
)
router.register(r"teams/(?P<team_slug>[^/.]+)/tunings", tuning_api.TuningViewSet, basename="team-tuning")

urlpatterns = router.urls
