"""A team's audit log over the API. The audit app records events for every app (the teams' services
among them), so it sits below ``apps.teams``; the team-scoped view of its rows is served from here."""

from django_filters import rest_framework as filters
from rest_framework import mixins, serializers

from apps.audit.models import AuditEvent
from apps.core.filters import UTCIsoDateTimeFilter
from apps.teams.viewsets import TeamScopedViewSet


class AuditEventSerializer(serializers.ModelSerializer):
    actor = serializers.CharField(source="actor_label", read_only=True)

    class Meta:
        model = AuditEvent
        fields = [
            "id",
            "created_at",
            "actor",
            "action",
            "target_type",
            "target_id",
            "target_label",
            "details",
        ]
        read_only_fields = fields


class AuditEventFilter(filters.FilterSet):
    action = filters.CharFilter(help_text="Exact action, e.g. token.created.")
    action_prefix = filters.CharFilter(field_name="action", lookup_expr="startswith", help_text="e.g. token.")
    actor = filters.CharFilter(field_name="actor__username", help_text="Username of the actor.")
    since = UTCIsoDateTimeFilter(field_name="created_at", lookup_expr="gte")
    until = UTCIsoDateTimeFilter(field_name="created_at", lookup_expr="lt")

    class Meta:
        model = AuditEvent
        fields = ["action", "action_prefix", "actor", "target_type", "target_id", "since", "until"]


class AuditEventViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TeamScopedViewSet):
    """The team's audit log, newest first. Every member can read it."""

    queryset = AuditEvent.objects.all()
    serializer_class = AuditEventSerializer
    filterset_class = AuditEventFilter
    ordering_fields = ["created_at", "action"]
    ordering = ["-created_at", "-id"]
