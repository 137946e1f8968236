from rest_framework.routers import SimpleRouter

from apps.alerts import api

router = SimpleRouter()
prefix = r"teams/(?P<team_slug>[^/.]+)/alerts"
router.register(f"{prefix}/rules", api.AlertRuleViewSet, basename="team-alert-rule")
router.register(f"{prefix}/channels", api.NotificationChannelViewSet, basename="team-alert-channel")
router.register(f"{prefix}/silences", api.SilenceViewSet, basename="team-alert-silence")
router.register(f"{prefix}/events", api.AlertViewSet, basename="team-alert")
router.register(f"{prefix}/deliveries", api.DeliveryViewSet, basename="team-alert-delivery")

urlpatterns = router.urls
