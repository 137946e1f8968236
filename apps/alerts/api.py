"""REST API of alerts under /api/v1/teams/<team>/alerts/: rules, channels, silences (maintainers change them,
every member reads), the alerts themselves and the delivery log (read-only)."""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from django_filters import rest_framework as filters
from rest_framework import mixins, serializers, status
from rest_framework.response import Response

from apps.alerts import services
from apps.alerts.models import (
    Alert,
    AlertRule,
    AlertState,
    NotificationChannel,
    NotificationDelivery,
    Silence,
)
from apps.deployments.models import Deployment
from apps.teams.models import Action, role_allows, team_roles
from apps.teams.viewsets import TeamScopedViewSet


class AlertRuleSerializer(serializers.ModelSerializer):
    deployment = serializers.IntegerField(
        source="deployment_id", allow_null=True, required=False, help_text="Narrow to one deployment (id)."
    )
    condition = serializers.CharField(source="describe", read_only=True)

    class Meta:
        model = AlertRule
        fields = [
            "id",
            "name",
            "kind",
            "deployment",
            "threshold",
            "window_minutes",
            "for_seconds",
            "severity",
            "enabled",
            "condition",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["id", "condition", "created_at", "updated_at"]


class NotificationChannelSerializer(serializers.ModelSerializer):
    emails = serializers.ListField(child=serializers.CharField(max_length=254), required=False, max_length=10)

    class Meta:
        model = NotificationChannel
        fields = ["id", "name", "kind", "url", "emails", "send_resolved", "enabled", "created_at"]
        read_only_fields = ["id", "created_at"]

    def to_representation(self, channel):
        data = super().to_representation(channel)
        request = self.context.get("request")
        if request is not None and not role_allows(
            team_roles(request.user).get(channel.team_id), Action.CHANGE
        ):
            data["url"] = channel.masked_url()  # the path often holds the receiver's secret
        return data


class SilenceSerializer(serializers.ModelSerializer):
    rule = serializers.IntegerField(
        source="rule_id", allow_null=True, required=False, help_text="Silence one rule (id); empty: all."
    )
    active = serializers.SerializerMethodField()

    class Meta:
        model = Silence
        fields = ["id", "rule", "comment", "starts_at", "ends_at", "active", "created_at"]
        read_only_fields = ["id", "starts_at", "active", "created_at"]

    def get_active(self, silence: Silence) -> bool:
        return silence.is_active()


class AlertSerializer(serializers.ModelSerializer):
    rule_name = serializers.CharField(source="rule.name", read_only=True)
    kind = serializers.CharField(source="rule.kind", read_only=True)
    severity = serializers.CharField(source="rule.severity", read_only=True)

    class Meta:
        model = Alert
        fields = [
            "id",
            "rule",
            "rule_name",
            "kind",
            "severity",
            "subject",
            "deployment",
            "state",
            "value",
            "summary",
            "labels",
            "active_since",
            "fired_at",
            "resolved_at",
            "last_evaluated_at",
        ]
        read_only_fields = fields


class DeliverySerializer(serializers.ModelSerializer):
    channel_name = serializers.CharField(source="channel.name", read_only=True)

    class Meta:
        model = NotificationDelivery
        fields = [
            "id",
            "channel",
            "channel_name",
            "rule",
            "status",
            "state",
            "attempts",
            "response_status",
            "last_error",
            "payload",
            "created_at",
            "delivered_at",
        ]
        read_only_fields = fields


class _ChangeViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.UpdateModelMixin,
    mixins.DestroyModelMixin,
    TeamScopedViewSet,
):
    ordering = ["id"]


class AlertRuleViewSet(_ChangeViewSet):
    """The team's alert rules. Kinds: error_rate (threshold %, window_minutes), p99_latency (ms), no_traffic
    (window_minutes without requests), placement_failed, instance_down, host_offline, conversion_failed
    (failed within window_minutes), npu_hbm (%). ``for_seconds``: how long the condition holds before firing."""

    queryset = AlertRule.objects.all()
    serializer_class = AlertRuleSerializer
    filterset_fields = ["kind", "enabled"]

    def _changes(self, serializer) -> dict:
        data = dict(serializer.validated_data)
        if "deployment_id" in data:
            deployment_id = data.pop("deployment_id")
            data["deployment"] = (
                get_object_or_404(
                    Deployment.objects.for_user(self.request.user).filter(team=self.team), pk=deployment_id
                )
                if deployment_id is not None
                else None
            )
        return data

    def perform_create(self, serializer):
        serializer.instance = services.create_rule(
            actor=self.request.user, team=self.team, **self._changes(serializer)
        )

    def perform_update(self, serializer):
        serializer.instance = services.update_rule(
            actor=self.request.user, rule=serializer.instance, **self._changes(serializer)
        )

    def perform_destroy(self, instance):
        services.delete_rule(actor=self.request.user, rule=instance)


class NotificationChannelViewSet(_ChangeViewSet):
    """Where notifications go: ``webhook`` (Alertmanager's webhook JSON to ``url``; public http(s) addresses
    only, no credentials in the URL) or ``email`` (to ``emails``)."""

    queryset = NotificationChannel.objects.all()
    serializer_class = NotificationChannelSerializer

    def perform_create(self, serializer):
        serializer.instance = services.create_channel(
            actor=self.request.user, team=self.team, **serializer.validated_data
        )

    def perform_update(self, serializer):
        serializer.instance = services.update_channel(
            actor=self.request.user, channel=serializer.instance, **serializer.validated_data
        )

    def perform_destroy(self, instance):
        services.delete_channel(actor=self.request.user, channel=instance)


class SilenceViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.DestroyModelMixin,
    TeamScopedViewSet,
):
    """Silences hold back notifications of one rule (or all) until ``ends_at``. DELETE ends one now (kept
    in the list as history)."""

    queryset = Silence.objects.all()
    serializer_class = SilenceSerializer
    ordering = ["-ends_at", "-id"]

    def perform_create(self, serializer):
        data = serializer.validated_data
        rule_id = data.get("rule_id")
        rule = (
            get_object_or_404(
                AlertRule.objects.for_user(self.request.user).filter(team=self.team), pk=rule_id
            )
            if rule_id is not None
            else None
        )
        serializer.instance = services.create_silence(
            actor=self.request.user,
            team=self.team,
            rule=rule,
            ends_at=data["ends_at"],
            comment=data.get("comment", ""),
        )

    def destroy(self, request, *args, **kwargs):
        services.expire_silence(actor=request.user, silence=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)


class AlertFilter(filters.FilterSet):
    state = filters.ChoiceFilter(choices=AlertState.choices)

    class Meta:
        model = Alert
        fields = ["state", "rule"]


class AlertViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TeamScopedViewSet):
    """The team's alerts, newest first: PENDING and FIRING now, RESOLVED as history."""

    queryset = Alert.objects.select_related("rule")
    serializer_class = AlertSerializer
    filterset_class = AlertFilter
    ordering = ["-active_since", "-id"]


class DeliveryViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TeamScopedViewSet):
    """The delivery log: each notification sent (or tried) to a channel, with attempts and the last error."""

    queryset = NotificationDelivery.objects.select_related("channel")
    serializer_class = DeliverySerializer
    filterset_fields = ["state", "channel"]
    ordering = ["-created_at", "-id"]
