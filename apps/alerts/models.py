"""Alert rules, the alerts they raise, where notifications go, silences and the delivery log.

A rule is a team's condition over the monitoring rollups or the platform's rows (``AlertKind``); the
evaluator (``apps.alerts.evaluation``) runs every minute and keeps one ``Alert`` per rule and subject
(a deployment, a placement, an instance, a host, a device, a conversion job).
"""

from __future__ import annotations

from datetime import datetime
from urllib.parse import urlsplit

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from apps.teams.models import TeamScopedQuerySet


class AlertKind(models.TextChoices):
    ERROR_RATE = "error_rate", "Error rate above threshold (%)"
    P99_LATENCY = "p99_latency", "p99 latency above threshold (ms)"
    NO_TRAFFIC = "no_traffic", "No traffic on a deployment that had some"
    PLACEMENT_FAILED = "placement_failed", "Placement failed"
    INSTANCE_DOWN = "instance_down", "Instance down or quarantined"
    HOST_OFFLINE = "host_offline", "Host offline"
    CONVERSION_FAILED = "conversion_failed", "Conversion failed"
    NPU_HBM = "npu_hbm", "NPU HBM use above threshold (%)"


# Kinds whose subject is a deployment's traffic: a rule of these kinds may name one deployment.
TRAFFIC_KINDS = (AlertKind.ERROR_RATE, AlertKind.P99_LATENCY, AlertKind.NO_TRAFFIC)
# What the threshold means per kind (None: the kind has no threshold).
THRESHOLD_UNIT = {
    AlertKind.ERROR_RATE: "%",
    AlertKind.P99_LATENCY: "ms",
    AlertKind.NPU_HBM: "%",
}


class Severity(models.TextChoices):
    WARNING = "warning", "Warning"
    CRITICAL = "critical", "Critical"


class AlertRule(models.Model):
    """One condition a team is alerted on.

    ``threshold`` is a percentage (error rate, HBM) or milliseconds (p99); ``window_minutes`` is the span the
    rollups are read over (Y minutes of error rate, N minutes without traffic, how recent a failed conversion
    is); ``for_seconds`` is how long the condition must hold before the alert fires (pending until then).
    ``deployment`` narrows a traffic rule to one deployment; empty means every live deployment of the team.
    """

    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="alert_rules")
    name = models.CharField(max_length=100)
    kind = models.CharField(max_length=30, choices=AlertKind.choices)
    deployment = models.ForeignKey(
        "deployments.Deployment", null=True, blank=True, on_delete=models.CASCADE, related_name="alert_rules"
    )
    threshold = models.FloatField(default=0)
    window_minutes = models.PositiveIntegerField(default=5)
    for_seconds = models.PositiveIntegerField(default=0)
    severity = models.CharField(max_length=20, choices=Severity.choices, default=Severity.WARNING)
    enabled = models.BooleanField(default=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = TeamScopedQuerySet.as_manager()

    class Meta:
        ordering = ["team", "kind", "name", "id"]
        indexes = [models.Index(fields=["enabled", "kind"], name="alertrule_enabled_kind")]

    def __str__(self) -> str:
        return self.name

    def describe(self) -> str:
        """The condition in words, for lists and notifications."""
        unit = THRESHOLD_UNIT.get(AlertKind(self.kind))
        text = AlertKind(self.kind).label
        if unit:
            text = f"{text.split(' (')[0]} {self.threshold:g} {unit}"
        if self.kind in (AlertKind.ERROR_RATE, AlertKind.P99_LATENCY, AlertKind.NPU_HBM):
            text += f" over {self.window_minutes} min"
        elif self.kind == AlertKind.NO_TRAFFIC:
            text = f"No traffic for {self.window_minutes} min"
        elif self.kind == AlertKind.CONVERSION_FAILED:
            text += f" (within {self.window_minutes} min)"
        if self.for_seconds:
            text += f", for {self.for_seconds} s"
        return text


class AlertState(models.TextChoices):
    PENDING = "PENDING", "Pending"
    FIRING = "FIRING", "Firing"
    RESOLVED = "RESOLVED", "Resolved"


ACTIVE_ALERT_STATES = (AlertState.PENDING, AlertState.FIRING)


class Alert(models.Model):
    """One rule's condition on one subject.

    State machine: PENDING -> FIRING (once the condition held for the rule's ``for_seconds``) -> RESOLVED
    (the condition cleared). A PENDING alert whose condition clears before it fires is deleted (it never
    happened, as in Prometheus). At most one active (PENDING or FIRING) alert per rule and subject; a new
    occurrence after RESOLVED is a new row, so the rows are the history.
    """

    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="alerts")
    rule = models.ForeignKey(AlertRule, on_delete=models.CASCADE, related_name="alerts")
    subject = models.CharField(max_length=100, help_text="What the alert is about, e.g. deployment:12.")
    deployment = models.ForeignKey(
        "deployments.Deployment", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    state = models.CharField(max_length=20, choices=AlertState.choices, default=AlertState.PENDING)
    value = models.FloatField(null=True, blank=True, help_text="The measured value at the last evaluation.")
    labels = models.JSONField(default=dict, blank=True)
    summary = models.CharField(max_length=300, blank=True)
    active_since = models.DateTimeField(help_text="When the condition was first seen (PENDING).")
    fired_at = models.DateTimeField(null=True, blank=True)
    resolved_at = models.DateTimeField(null=True, blank=True)
    last_evaluated_at = models.DateTimeField()

    objects = TeamScopedQuerySet.as_manager()

    class Meta:
        ordering = ["-active_since", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["rule", "subject"],
                condition=Q(state__in=["PENDING", "FIRING"]),
                name="one_active_alert_per_rule_subject",
            )
        ]
        indexes = [models.Index(fields=["team", "state"], name="alert_team_state")]

    def __str__(self) -> str:
        return f"{self.rule} on {self.subject} ({self.state})"


class ChannelKind(models.TextChoices):
    WEBHOOK = "webhook", "Webhook (Alertmanager JSON)"
    EMAIL = "email", "Email"


class NotificationChannel(models.Model):
    """Where a team's notifications go. A webhook URL is tenant input: checked against the SSRF guard
    (``apps.alerts.webhooks.check_webhook_url``) when saved and again at every delivery."""

    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="alert_channels")
    name = models.CharField(max_length=100)
    kind = models.CharField(max_length=20, choices=ChannelKind.choices)
    url = models.CharField(max_length=500, blank=True, help_text="Webhook: an http(s) URL.")
    emails = models.JSONField(default=list, blank=True, help_text="Email: the recipients.")
    send_resolved = models.BooleanField(default=True)
    enabled = models.BooleanField(default=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TeamScopedQuerySet.as_manager()

    class Meta:
        ordering = ["team", "name", "id"]

    def __str__(self) -> str:
        return self.name

    def target(self) -> str:
        return self.url if self.kind == ChannelKind.WEBHOOK else ", ".join(self.emails)

    def masked_url(self) -> str:
        """The webhook URL without its path and query, which often carry a receiver's secret: what
        members who may not change channels (viewers) see."""
        if not self.url:
            return ""
        parts = urlsplit(self.url)
        return f"{parts.scheme}://{parts.netloc}/…"


class Silence(models.Model):
    """Mutes notifications of a team's alerts until ``ends_at``: of one rule, or of every rule when empty.
    Alerts still change state and show on the pages; only their notifications are held back."""

    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="alert_silences")
    rule = models.ForeignKey(
        AlertRule, null=True, blank=True, on_delete=models.CASCADE, related_name="silences"
    )
    comment = models.CharField(max_length=300, blank=True)
    starts_at = models.DateTimeField(default=timezone.now)
    ends_at = models.DateTimeField()
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TeamScopedQuerySet.as_manager()

    class Meta:
        ordering = ["-ends_at", "-id"]

    def __str__(self) -> str:
        return f"silence of {self.rule or 'all rules'} until {self.ends_at:%Y-%m-%d %H:%M}"

    def is_active(self, now: datetime | None = None) -> bool:
        now = now or timezone.now()
        return self.starts_at <= now < self.ends_at

    def matches(self, alert: Alert, now: datetime) -> bool:
        return (
            self.team_id == alert.team_id
            and self.is_active(now)
            and (self.rule_id is None or self.rule_id == alert.rule_id)
        )


class DeliveryState(models.TextChoices):
    PENDING = "PENDING", "Pending"
    SENT = "SENT", "Sent"
    FAILED = "FAILED", "Failed"


class NotificationDelivery(models.Model):
    """One notification to one channel: the alerts of one rule that changed in one evaluation.

    State machine: PENDING -> SENT | FAILED. Each attempt is counted and its error kept; transient errors
    are retried with backoff by the task until ``ALERT_DELIVERY_MAX_RETRIES``, then FAILED.
    """

    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="+")
    channel = models.ForeignKey(NotificationChannel, on_delete=models.CASCADE, related_name="deliveries")
    rule = models.ForeignKey(AlertRule, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    alerts = models.ManyToManyField(Alert, related_name="deliveries", blank=True)
    status = models.CharField(max_length=20, help_text="firing or resolved, as in the payload.")
    payload = models.JSONField(default=dict)
    state = models.CharField(max_length=20, choices=DeliveryState.choices, default=DeliveryState.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    response_status = models.IntegerField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    delivered_at = models.DateTimeField(null=True, blank=True)

    objects = TeamScopedQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"delivery #{self.pk} to {self.channel} ({self.state})"
