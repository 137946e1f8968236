"""Alert rules, channels and silences (changed by maintainers, audited), and the minute evaluation that moves
alerts PENDING -> FIRING -> RESOLVED and queues their notifications."""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import EmailValidator
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from apps.alerts import notifications, webhooks
from apps.alerts.evaluation import find_conditions
from apps.alerts.models import (
    ACTIVE_ALERT_STATES,
    TRAFFIC_KINDS,
    Alert,
    AlertKind,
    AlertRule,
    AlertState,
    ChannelKind,
    NotificationChannel,
    Severity,
    Silence,
)
from apps.audit.services import record
from apps.deployments.models import Deployment

log = logging.getLogger(__name__)

# Bounds of what a tenant may set: (least, most) per field.
THRESHOLD_BOUNDS = {
    AlertKind.ERROR_RATE: (0.0, 100.0),
    AlertKind.P99_LATENCY: (0.001, 600_000.0),
    AlertKind.NPU_HBM: (0.0, 100.0),
}
WINDOW_BOUNDS = (1, 7 * 24 * 60)
FOR_BOUNDS = (0, 24 * 3600)
MAX_EMAILS = 10

# Created for a team with its first deployment (each kind only if the team has no rule of that kind).
DEFAULT_RULES = [
    dict(name="High error rate", kind=AlertKind.ERROR_RATE, threshold=5, window_minutes=5, for_seconds=120,
         severity=Severity.CRITICAL),
    dict(name="Slow p99 latency", kind=AlertKind.P99_LATENCY, threshold=1000, window_minutes=5, for_seconds=300),
    dict(name="Traffic stopped", kind=AlertKind.NO_TRAFFIC, window_minutes=15),
    dict(name="Placement failed", kind=AlertKind.PLACEMENT_FAILED, severity=Severity.CRITICAL),
    dict(name="Instance down", kind=AlertKind.INSTANCE_DOWN, for_seconds=60, severity=Severity.CRITICAL),
    dict(name="Host offline", kind=AlertKind.HOST_OFFLINE, for_seconds=60, severity=Severity.CRITICAL),
    dict(name="Conversion failed", kind=AlertKind.CONVERSION_FAILED, window_minutes=60),
    dict(name="NPU HBM nearly full", kind=AlertKind.NPU_HBM, threshold=90, window_minutes=5, for_seconds=300),
]  # fmt: skip

RULE_FIELDS = (
    "name",
    "kind",
    "deployment",
    "threshold",
    "window_minutes",
    "for_seconds",
    "severity",
    "enabled",
)


# --- rules -----------------------------------------------------------------------------------------------


def check_rule(team, data: dict) -> dict:
    """Validate a rule's fields (all of them, as they would be saved); returns them cleaned."""
    errors: dict[str, list[str]] = {}
    name = str(data.get("name") or "").strip()
    if not 1 <= len(name) <= 100:
        errors["name"] = ["Give the rule a name of 1-100 characters."]
    kind = data.get("kind")
    if kind not in AlertKind.values:
        errors["kind"] = [f"Pick one of: {', '.join(AlertKind.values)}."]
    severity = data.get("severity") or Severity.WARNING
    if severity not in Severity.values:
        errors["severity"] = [f"Pick one of: {', '.join(Severity.values)}."]
    numbers = {}
    for field_name, bounds, default in (
        ("window_minutes", WINDOW_BOUNDS, 5),
        ("for_seconds", FOR_BOUNDS, 0),
    ):
        try:
            value = int(data.get(field_name, default) if data.get(field_name) is not None else default)
        except (TypeError, ValueError):
            value = None
        if value is None or not bounds[0] <= value <= bounds[1]:
            errors[field_name] = [f"Give a whole number from {bounds[0]} to {bounds[1]}."]
        numbers[field_name] = value
    threshold = 0.0
    if kind in THRESHOLD_BOUNDS:
        low, high = THRESHOLD_BOUNDS[AlertKind(kind)]
        try:
            threshold = float(data.get("threshold"))
        except (TypeError, ValueError):
            threshold = float("nan")
        if not low <= threshold <= high:  # also refuses NaN and infinities
            errors["threshold"] = [f"Give a number from {low:g} to {high:g}."]
    deployment = data.get("deployment")
    if deployment is not None:
        if kind not in (*TRAFFIC_KINDS, AlertKind.PLACEMENT_FAILED):
            errors["deployment"] = ["Only traffic and placement rules can name a deployment."]
        elif not isinstance(deployment, Deployment) or deployment.team_id != team.pk:
            errors["deployment"] = ["No such deployment in this team."]
    if errors:
        raise ValidationError(errors)
    return dict(
        name=name,
        kind=kind,
        deployment=deployment,
        threshold=threshold,
        severity=severity,
        enabled=bool(data.get("enabled", True)),
        **numbers,
    )


def create_rule(*, actor, team, **data) -> AlertRule:
    cleaned = check_rule(team, data)
    with transaction.atomic():
        if AlertRule.objects.filter(team=team).count() >= settings.ALERT_MAX_RULES_PER_TEAM:
            raise ValidationError(
                {"non_field_errors": [f"A team has at most {settings.ALERT_MAX_RULES_PER_TEAM} alert rules."]}
            )
        rule = AlertRule.objects.create(team=team, created_by=actor, **cleaned)
        record(actor=actor, team=team, action="alert_rule.created", target=rule, details=_rule_details(rule))
    return rule


def update_rule(*, actor, rule: AlertRule, **changes) -> AlertRule:
    current = {name: getattr(rule, name) for name in RULE_FIELDS}
    cleaned = check_rule(rule.team, {**current, **changes})
    with transaction.atomic():
        for name, value in cleaned.items():
            setattr(rule, name, value)
        rule.save()
        record(
            actor=actor, team=rule.team, action="alert_rule.updated", target=rule, details=_rule_details(rule)
        )
    return rule


def delete_rule(*, actor, rule: AlertRule) -> None:
    with transaction.atomic():
        record(
            actor=actor, team=rule.team, action="alert_rule.deleted", target=rule, details=_rule_details(rule)
        )
        rule.delete()


def _rule_details(rule: AlertRule) -> dict:
    return {
        "kind": rule.kind,
        "condition": rule.describe(),
        "deployment": rule.deployment_id,
        "severity": rule.severity,
        "enabled": rule.enabled,
    }


def ensure_default_rules(*, actor, team) -> list[AlertRule]:
    """The default rules a team gets with a deployment: each kind the team has no rule of yet (a default
    the team deleted comes back with the next deployment; disable it to keep it quiet)."""
    existing = set(AlertRule.objects.filter(team=team).values_list("kind", flat=True))
    created = [
        AlertRule.objects.create(team=team, created_by=None, **spec)
        for spec in DEFAULT_RULES
        if spec["kind"] not in existing
    ]
    if created:
        record(
            actor=actor,
            team=team,
            action="alert_rule.defaults_created",
            details={"rules": [rule.name for rule in created]},
        )
    return created


# --- channels --------------------------------------------------------------------------------------------


def check_channel(data: dict) -> dict:
    errors: dict[str, list[str]] = {}
    name = str(data.get("name") or "").strip()
    if not 1 <= len(name) <= 100:
        errors["name"] = ["Give the channel a name of 1-100 characters."]
    kind = data.get("kind")
    url, emails = "", []
    if kind == ChannelKind.WEBHOOK:
        try:
            webhooks.check_webhook_url(str(data.get("url") or ""))
        except ValidationError as error:
            errors["url"] = error.messages
        url = str(data.get("url") or "")
    elif kind == ChannelKind.EMAIL:
        raw = data.get("emails") or []
        if isinstance(raw, str):
            raw = [part.strip() for part in raw.replace(";", ",").split(",")]
        emails = [str(item).strip() for item in raw if str(item).strip()]
        validate = EmailValidator()
        if not 1 <= len(emails) <= MAX_EMAILS:
            errors["emails"] = [f"Give 1-{MAX_EMAILS} email addresses."]
        else:
            for address in emails:
                try:
                    validate(address)
                except ValidationError:
                    errors["emails"] = [f"{address[:100]!r} is not an email address."]
                    break
    else:
        errors["kind"] = [f"Pick one of: {', '.join(ChannelKind.values)}."]
    if errors:
        raise ValidationError(errors)
    return dict(
        name=name,
        kind=kind,
        url=url,
        emails=emails,
        send_resolved=bool(data.get("send_resolved", True)),
        enabled=bool(data.get("enabled", True)),
    )


def create_channel(*, actor, team, **data) -> NotificationChannel:
    cleaned = check_channel(data)
    with transaction.atomic():
        if NotificationChannel.objects.filter(team=team).count() >= settings.ALERT_MAX_CHANNELS_PER_TEAM:
            raise ValidationError(
                {"non_field_errors": [f"A team has at most {settings.ALERT_MAX_CHANNELS_PER_TEAM} channels."]}
            )
        channel = NotificationChannel.objects.create(team=team, created_by=actor, **cleaned)
        record(
            actor=actor,
            team=team,
            action="alert_channel.created",
            target=channel,
            details={"kind": channel.kind, "target": channel.target()},
        )
    return channel


def update_channel(*, actor, channel: NotificationChannel, **changes) -> NotificationChannel:
    current = {n: getattr(channel, n) for n in ("name", "kind", "url", "emails", "send_resolved", "enabled")}
    cleaned = check_channel({**current, **changes})
    with transaction.atomic():
        for name, value in cleaned.items():
            setattr(channel, name, value)
        channel.save()
        record(
            actor=actor,
            team=channel.team,
            action="alert_channel.updated",
            target=channel,
            details={"kind": channel.kind, "target": channel.target(), "enabled": channel.enabled},
        )
    return channel


def delete_channel(*, actor, channel: NotificationChannel) -> None:
    with transaction.atomic():
        record(actor=actor, team=channel.team, action="alert_channel.deleted", target=channel)
        channel.delete()


# --- silences --------------------------------------------------------------------------------------------


def create_silence(
    *, actor, team, ends_at: datetime, rule: AlertRule | None = None, comment: str = ""
) -> Silence:
    now = timezone.now()
    errors = {}
    if ends_at is None or ends_at <= now:
        errors["ends_at"] = ["The end time must be in the future."]
    elif ends_at > now + timedelta(days=settings.ALERT_MAX_SILENCE_DAYS):
        errors["ends_at"] = [f"A silence lasts at most {settings.ALERT_MAX_SILENCE_DAYS} days."]
    if rule is not None and rule.team_id != team.pk:
        errors["rule"] = ["No such rule in this team."]
    if len(comment) > 300:
        errors["comment"] = ["At most 300 characters."]
    if errors:
        raise ValidationError(errors)
    with transaction.atomic():
        silence = Silence.objects.create(
            team=team, rule=rule, comment=comment, starts_at=now, ends_at=ends_at, created_by=actor
        )
        record(
            actor=actor,
            team=team,
            action="alert_silence.created",
            target=silence,
            details={"rule": rule.name if rule else None, "ends_at": ends_at.isoformat(), "comment": comment},
        )
    return silence


def expire_silence(*, actor, silence: Silence) -> Silence:
    with transaction.atomic():
        now = timezone.now()
        if silence.ends_at > now:
            silence.ends_at = max(now, silence.starts_at)
            silence.save(update_fields=["ends_at"])
        record(actor=actor, team=silence.team, action="alert_silence.expired", target=silence)
    return silence


# --- evaluation ------------------------------------------------------------------------------------------


@dataclass
class EvaluationResult:
    rules: int = 0
    pending: int = 0
    fired: int = 0
    resolved: int = 0
    deliveries: int = 0


UPDATED_FIELDS = ["state", "value", "summary", "labels", "fired_at", "resolved_at", "last_evaluated_at"]


def evaluate_rules(now: datetime | None = None) -> EvaluationResult:
    """Evaluate every enabled rule once and move alerts through PENDING -> FIRING -> RESOLVED.

    Two evaluations at once cannot both open an alert: the partial unique constraint on active alerts
    rejects the second (its transaction rolls back, and the next minute's run carries on).
    """
    now = now or timezone.now()
    rules = list(AlertRule.objects.filter(enabled=True).select_related("team"))
    findings = find_conditions(rules, now)
    result = EvaluationResult(rules=len(rules))
    rules_by_id = {rule.pk: rule for rule in rules}
    changed: dict[int, list[Alert]] = defaultdict(list)  # rule id -> alerts that fired or resolved
    try:
        with transaction.atomic():
            active = {
                (alert.rule_id, alert.subject): alert
                for alert in Alert.objects.select_for_update().filter(state__in=ACTIVE_ALERT_STATES)
            }
            new, updated, unchanged, dropped = [], [], [], []
            for rule in rules:
                for subject, finding in findings.get(rule.pk, {}).items():
                    alert = active.pop((rule.pk, subject), None)
                    if alert is None:
                        alert = Alert(team_id=rule.team_id, rule=rule, subject=subject, active_since=now)
                        new.append(alert)
                    before = (alert.state, alert.value, alert.summary, alert.labels)
                    alert.value, alert.summary, alert.labels = finding.value, finding.summary, finding.labels
                    alert.deployment_id = finding.deployment_id
                    alert.last_evaluated_at = now
                    if alert.state == AlertState.PENDING:
                        if now - alert.active_since >= timedelta(seconds=rule.for_seconds):
                            alert.state, alert.fired_at = AlertState.FIRING, now
                            changed[rule.pk].append(alert)
                            result.fired += 1
                        else:
                            result.pending += 1
                    if alert.pk is not None:
                        # Most active alerts stay as they were: they only get the evaluation time, in one
                        # UPDATE for all of them, instead of a row-by-row rewrite.
                        if (alert.state, alert.value, alert.summary, alert.labels) != before:
                            updated.append(alert)
                        else:
                            unchanged.append(alert.pk)
            # Whatever is left is no longer true (or its rule was disabled or deleted).
            for alert in active.values():
                if alert.state == AlertState.PENDING:
                    dropped.append(alert.pk)
                    continue
                alert.state, alert.resolved_at, alert.last_evaluated_at = AlertState.RESOLVED, now, now
                updated.append(alert)
                result.resolved += 1
                if alert.rule_id in rules_by_id:
                    changed[alert.rule_id].append(alert)
            Alert.objects.bulk_create(new)
            _save_fields(updated, UPDATED_FIELDS)
            Alert.objects.filter(pk__in=unchanged).update(last_evaluated_at=now)
            Alert.objects.filter(pk__in=dropped).delete()
            result.deliveries = _notify(changed, rules_by_id, now)
    except IntegrityError:
        log.warning("another alert evaluation ran at the same time; this one is dropped")
        return EvaluationResult(rules=len(rules))
    return result


def _save_fields(alerts: list[Alert], names: list[str]) -> None:
    """One parametrised UPDATE run for many rows (executemany). ``bulk_update`` builds a CASE expression
    per field and row in Python, which costs seconds for the ~1,000 alerts a minute can touch."""
    if not alerts:
        return
    fields = [Alert._meta.get_field(name) for name in names]
    quote = connection.ops.quote_name
    assignments = ", ".join(f"{quote(field.column)} = %s" for field in fields)
    sql = f"UPDATE {quote(Alert._meta.db_table)} SET {assignments} WHERE {quote('id')} = %s"
    rows = [
        [field.get_db_prep_save(getattr(alert, field.attname), connection) for field in fields] + [alert.pk]
        for alert in alerts
    ]
    with connection.cursor() as cursor:
        cursor.executemany(sql, rows)


def _notify(changed: dict[int, list[Alert]], rules_by_id: dict[int, AlertRule], now: datetime) -> int:
    if not changed:
        return 0
    team_ids = {rules_by_id[rule_id].team_id for rule_id in changed}
    channels: dict[int, list[NotificationChannel]] = defaultdict(list)
    for channel in NotificationChannel.objects.filter(team_id__in=team_ids, enabled=True):
        channels[channel.team_id].append(channel)
    silences: dict[int, list[Silence]] = defaultdict(list)
    for silence in Silence.objects.filter(team_id__in=team_ids, starts_at__lte=now, ends_at__gt=now):
        silences[silence.team_id].append(silence)
    count = 0
    for rule_id, alerts in changed.items():
        rule = rules_by_id[rule_id]
        audible = [a for a in alerts if not any(s.matches(a, now) for s in silences[rule.team_id])]
        if audible and channels[rule.team_id]:
            count += len(notifications.queue_deliveries(rule, audible, channels[rule.team_id]))
    return count


def is_silenced(alert: Alert, silences: list[Silence], now: datetime | None = None) -> bool:
    now = now or timezone.now()
    return any(silence.matches(alert, now) for silence in silences)
