from rest_framework.routers import SimpleRouter

from apps.deployments import api

router = SimpleRouter()
router.register(r"teams/(?P<team_slug>[^/.]+)/deployments", api.DeploymentViewSet, basename="team-deployment")

urlpatterns = router.urls
