from django.urls import path
from rest_framework.routers import SimpleRouter

from apps.teams import api, audit_api

router = SimpleRouter()
router.register("teams", api.TeamViewSet, basename="team")
router.register(r"teams/(?P<team_slug>[^/.]+)/members", api.MembershipViewSet, basename="team-member")
router.register(
    r"teams/(?P<team_slug>[^/.]+)/invitations", api.TeamInvitationViewSet, basename="team-invitation"
)
router.register("me/invitations", api.MyInvitationViewSet, basename="my-invitation")
router.register(r"teams/(?P<team_slug>[^/.]+)/tokens", api.ApiTokenViewSet, basename="team-token")
router.register(
    r"teams/(?P<team_slug>[^/.]+)/audit-events", audit_api.AuditEventViewSet, basename="team-audit-event"
)

urlpatterns = [path("me/", api.me, name="me"), *router.urls]
