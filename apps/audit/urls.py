from rest_framework.routers import SimpleRouter

from apps.audit import api

router = SimpleRouter()
router.register(
    r"teams/(?P<team_slug>[^/.]+)/audit-events", api.AuditEventViewSet, basename="team-audit-event"
)

urlpatterns = router.urls
