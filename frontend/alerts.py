"""The alerts page of a team: firing alerts, history, rules, channels, silences and the delivery log.
Every member reads it; maintainers change rules, channels and silences (through apps.alerts.services)."""

from __future__ import annotations

from datetime import timedelta

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import HttpResponseBadRequest
from django.shortcuts import get_object_or_404, redirect
from django.utils import timezone

from apps.alerts import services
from apps.alerts.models import (
    ACTIVE_ALERT_STATES,
    THRESHOLD_UNIT,
    Alert,
    AlertKind,
    AlertRule,
    AlertState,
    ChannelKind,
    NotificationChannel,
    NotificationDelivery,
    Severity,
    Silence,
)
from apps.deployments.models import Deployment, DeploymentState
from apps.teams.models import Action
from frontend.pages import TeamPageView

HISTORY_SHOWN = 50
DELIVERIES_SHOWN = 30
SILENCE_HOURS = [(1, "1 hour"), (4, "4 hours"), (24, "1 day"), (72, "3 days"), (168, "1 week")]


class AlertsView(TeamPageView):
    template_name = "frontend/alerts/alerts.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        user, now = self.request.user, timezone.now()
        alerts = (
            Alert.objects.for_user(user).filter(team=self.team).select_related("rule", "deployment__model")
        )
        silences = list(Silence.objects.for_user(user).filter(team=self.team).select_related("rule")[:50])
        active = list(alerts.filter(state__in=ACTIVE_ALERT_STATES).order_by("-state", "-fired_at", "-id"))
        for alert in active:
            alert.silenced = services.is_silenced(alert, silences, now)
        context.update(
            active_alerts=active,
            history=alerts.filter(state=AlertState.RESOLVED).order_by("-resolved_at", "-id")[:HISTORY_SHOWN],
            rules=AlertRule.objects.for_user(user).filter(team=self.team).select_related("deployment__model"),
            channels=NotificationChannel.objects.for_user(user).filter(team=self.team),
            silences=silences,
            deliveries=NotificationDelivery.objects.for_user(user)
            .filter(team=self.team)
            .select_related("channel", "rule")[:DELIVERIES_SHOWN],
            deployments=Deployment.objects.for_user(user)
            .filter(team=self.team)
            .exclude(state=DeploymentState.UNDEPLOYED)
            .select_related("model"),
            kinds=AlertKind.choices,
            threshold_units={str(kind): unit for kind, unit in THRESHOLD_UNIT.items()},
            severities=Severity.choices,
            channel_kinds=ChannelKind.choices,
            silence_hours=SILENCE_HOURS,
            now=now,
        )
        return context

    def post(self, request, *args, **kwargs):
        self.require(Action.CHANGE)
        handler = getattr(self, f"op_{request.POST.get('op', '')}", None)
        if handler is None:
            return HttpResponseBadRequest("Unknown operation.")
        try:
            text = handler(request.POST)
        except ValidationError as error:
            messages.error(request, " ".join(error.messages))
        else:
            messages.success(request, text)
        return redirect("alerts", team_slug=self.team.slug)

    def _rule(self, pk) -> AlertRule:
        return get_object_or_404(
            AlertRule.objects.for_user(self.request.user, Action.CHANGE).filter(team=self.team), pk=pk
        )

    def _deployment(self, pk):
        if not pk:
            return None
        return get_object_or_404(
            Deployment.objects.for_user(self.request.user, Action.CHANGE).filter(team=self.team), pk=pk
        )

    def _rule_fields(self, post) -> dict:
        fields = {
            "name": post.get("name", ""),
            "threshold": post.get("threshold") or 0,
            "window_minutes": post.get("window_minutes") or 5,
            "for_seconds": post.get("for_seconds") or 0,
            "severity": post.get("severity", Severity.WARNING),
            "enabled": post.get("enabled") == "on",
        }
        return fields

    def op_create_rule(self, post) -> str:
        rule = services.create_rule(
            actor=self.request.user,
            team=self.team,
            kind=post.get("kind", ""),
            deployment=self._deployment(post.get("deployment")),
            **self._rule_fields(post),
        )
        return f"Rule “{rule.name}” created."

    def op_update_rule(self, post) -> str:
        rule = services.update_rule(
            actor=self.request.user, rule=self._rule(post.get("rule")), **self._rule_fields(post)
        )
        return f"Rule “{rule.name}” saved."

    def op_delete_rule(self, post) -> str:
        rule = self._rule(post.get("rule"))
        services.delete_rule(actor=self.request.user, rule=rule)
        return f"Rule “{rule.name}” deleted."

    def _channel(self, pk) -> NotificationChannel:
        return get_object_or_404(
            NotificationChannel.objects.for_user(self.request.user, Action.CHANGE).filter(team=self.team),
            pk=pk,
        )

    def op_create_channel(self, post) -> str:
        channel = services.create_channel(
            actor=self.request.user,
            team=self.team,
            name=post.get("name", ""),
            kind=post.get("kind", ""),
            url=post.get("url", ""),
            emails=post.get("emails", ""),
            send_resolved=post.get("send_resolved") == "on",
        )
        return f"Channel “{channel.name}” added."

    def op_toggle_channel(self, post) -> str:
        channel = self._channel(post.get("channel"))
        services.update_channel(actor=self.request.user, channel=channel, enabled=not channel.enabled)
        return f"Channel “{channel.name}” {'enabled' if channel.enabled else 'disabled'}."

    def op_delete_channel(self, post) -> str:
        channel = self._channel(post.get("channel"))
        services.delete_channel(actor=self.request.user, channel=channel)
        return f"Channel “{channel.name}” deleted."

    def op_create_silence(self, post) -> str:
        try:
            hours = int(post.get("hours", ""))
        except ValueError:
            raise ValidationError({"ends_at": ["Pick how long the silence lasts."]}) from None
        if hours not in dict(SILENCE_HOURS):
            raise ValidationError({"ends_at": ["Pick how long the silence lasts."]})
        rule = self._rule(post["rule"]) if post.get("rule") else None
        silence = services.create_silence(
            actor=self.request.user,
            team=self.team,
            rule=rule,
            ends_at=timezone.now() + timedelta(hours=hours),
            comment=post.get("comment", "")[:300],
        )
        return f"Silenced {silence.rule or 'all rules'} until {silence.ends_at:%Y-%m-%d %H:%M} UTC."

    def op_expire_silence(self, post) -> str:
        silence = get_object_or_404(
            Silence.objects.for_user(self.request.user, Action.CHANGE).filter(team=self.team),
            pk=post.get("silence"),
        )
        services.expire_silence(actor=self.request.user, silence=silence)
        return "Silence ended."
