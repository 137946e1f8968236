"""Notifications: Alertmanager's webhook payload, email, and one delivery attempt with its log.

The webhook body is Alertmanager's (version "4": status, receiver, groupKey, groupLabels, commonLabels,
commonAnnotations, externalURL, alerts[] with status, labels, annotations, startsAt, endsAt, generatorURL,
fingerprint), so receivers written for Alertmanager work unchanged.
"""

from __future__ import annotations

import hashlib
import logging
import smtplib
from collections.abc import Iterable
from datetime import UTC, datetime

from django.conf import settings
from django.core.mail import send_mail
from django.db import transaction
from django.urls import reverse
from django.utils import timezone

from apps.alerts import webhooks
from apps.alerts.models import (
    Alert,
    AlertRule,
    AlertState,
    ChannelKind,
    DeliveryState,
    NotificationChannel,
    NotificationDelivery,
)

log = logging.getLogger(__name__)

# Alertmanager's "zero time": an alert that has not ended.
ZERO_TIME = "0001-01-01T00:00:00Z"
# HTTP answers worth another try (Alertmanager retries these too); every other 4xx is final.
RETRY_STATUSES = {408, 425, 429}


class TransientDeliveryError(Exception):
    """The receiver may take it later: the task retries with backoff."""


def _rfc3339(moment: datetime | None) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ") if moment else ZERO_TIME


def alerts_page_url(team_slug: str) -> str:
    return settings.PLATFORM_PUBLIC_URL.rstrip("/") + reverse("alerts", kwargs={"team_slug": team_slug})


def alert_labels(alert: Alert, rule: AlertRule, team_slug: str) -> dict[str, str]:
    labels = {
        "alertname": rule.name,
        "team": team_slug,
        "severity": rule.severity,
        "kind": rule.kind,
        "rule_id": str(rule.pk),
    }
    labels.update({key: str(value) for key, value in alert.labels.items()})
    return labels


def alert_json(alert: Alert, rule: AlertRule, team_slug: str) -> dict:
    labels = alert_labels(alert, rule, team_slug)
    firing = alert.state == AlertState.FIRING
    return {
        "status": "firing" if firing else "resolved",
        "labels": labels,
        "annotations": {"summary": alert.summary, "description": rule.describe()},
        "startsAt": _rfc3339(alert.fired_at or alert.active_since),
        "endsAt": ZERO_TIME if firing else _rfc3339(alert.resolved_at),
        "generatorURL": alerts_page_url(team_slug),
        "fingerprint": hashlib.sha256(f"{rule.pk}|{alert.subject}".encode()).hexdigest()[:16],
    }


def _common(dicts: list[dict[str, str]]) -> dict[str, str]:
    if not dicts:
        return {}
    common = dict(dicts[0])
    for other in dicts[1:]:
        common = {key: value for key, value in common.items() if other.get(key) == value}
    return common


def build_payload(channel: NotificationChannel, rule: AlertRule, alerts: list[Alert], team_slug: str) -> dict:
    items = [alert_json(alert, rule, team_slug) for alert in alerts]
    group_labels = {"alertname": rule.name, "team": team_slug}
    return {
        "version": "4",
        "groupKey": f'{{}}:{{alertname="{rule.name}", team="{team_slug}"}}',
        "truncatedAlerts": 0,
        "status": "firing" if any(item["status"] == "firing" for item in items) else "resolved",
        "receiver": channel.name,
        "groupLabels": group_labels,
        "commonLabels": _common([item["labels"] for item in items]),
        "commonAnnotations": _common([item["annotations"] for item in items]),
        "externalURL": alerts_page_url(team_slug),
        "alerts": items,
    }


def queue_deliveries(
    rule: AlertRule, alerts: list[Alert], channels: Iterable[NotificationChannel]
) -> list[NotificationDelivery]:
    """A delivery row per channel for the alerts of one rule that changed (the caller holds the
    transaction; the tasks start after it commits)."""
    deliveries = []
    for channel in channels:
        if not channel.enabled:
            continue
        chosen = [a for a in alerts if a.state == AlertState.FIRING or channel.send_resolved]
        if not chosen:
            continue
        payload = build_payload(channel, rule, chosen, rule.team.slug)
        delivery = NotificationDelivery.objects.create(
            team_id=rule.team_id, channel=channel, rule=rule, status=payload["status"], payload=payload
        )
        delivery.alerts.add(*chosen)
        deliveries.append(delivery)
    if deliveries:
        transaction.on_commit(lambda: _enqueue([d.pk for d in deliveries]))
    return deliveries


def _enqueue(delivery_ids: list[int]) -> None:
    from apps.alerts.tasks import deliver_notification  # tasks import this module

    for delivery_id in delivery_ids:
        deliver_notification.delay(delivery_id)


def _email_text(payload: dict) -> tuple[str, str]:
    firing = [a for a in payload["alerts"] if a["status"] == "firing"]
    resolved = [a for a in payload["alerts"] if a["status"] == "resolved"]
    status = f"FIRING:{len(firing)}" if firing else "RESOLVED"
    group = payload["groupLabels"]
    subject = f"[{status}] {group['alertname']} ({group['team']})"
    lines = []
    for title, items in (("Firing", firing), ("Resolved", resolved)):
        if items:
            lines.append(f"{title}:")
            lines += [f"  - {a['annotations']['summary']} (since {a['startsAt'][:19]}Z)" for a in items]
            lines.append("")
    lines.append(f"Alerts page: {payload['externalURL']}")
    return subject, "\n".join(lines)


def send(delivery: NotificationDelivery) -> None:
    """One attempt. Records it on the row; raises TransientDeliveryError when a retry may help. Does
    nothing when another copy of the task already made this attempt."""
    channel = delivery.channel
    # Claim this attempt: a redelivered copy of the task that read the same row finds it taken and stops.
    claimed = NotificationDelivery.objects.filter(
        pk=delivery.pk, state=DeliveryState.PENDING, attempts=delivery.attempts
    ).update(attempts=delivery.attempts + 1)
    if not claimed:
        return
    delivery.attempts += 1
    try:
        if channel.kind == ChannelKind.WEBHOOK:
            response = webhooks.post_json(
                channel.url, delivery.payload, timeout=settings.ALERT_WEBHOOK_TIMEOUT
            )
            delivery.response_status = response.status
            if not 200 <= response.status < 300:
                message = f"HTTP {response.status}: {response.excerpt[:500]}"
                if response.status >= 500 or response.status in RETRY_STATUSES:
                    raise TransientDeliveryError(message)
                return _finish(delivery, DeliveryState.FAILED, message)
        else:
            subject, body = _email_text(delivery.payload)
            send_mail(subject, body, settings.DEFAULT_FROM_EMAIL, list(channel.emails), fail_silently=False)
    except webhooks.WebhookRefused as error:
        return _finish(delivery, DeliveryState.FAILED, " ".join(error.messages))
    except (OSError, smtplib.SMTPException) as error:
        _record_error(delivery, f"{type(error).__name__}: {error}")
        raise TransientDeliveryError(str(error)) from error
    except TransientDeliveryError as error:
        _record_error(delivery, str(error))
        raise
    _finish(delivery, DeliveryState.SENT, "")


def _record_error(delivery: NotificationDelivery, message: str) -> None:
    NotificationDelivery.objects.filter(pk=delivery.pk).update(
        last_error=message[:2000], response_status=delivery.response_status
    )


def _finish(delivery: NotificationDelivery, state: str, message: str) -> None:
    NotificationDelivery.objects.filter(pk=delivery.pk).update(
        state=state,
        last_error=message[:2000],
        response_status=delivery.response_status,
        delivered_at=timezone.now() if state == DeliveryState.SENT else None,
    )
    if state == DeliveryState.FAILED:
        log.warning("alert delivery %s to channel %s failed: %s", delivery.pk, delivery.channel_id, message)


def give_up(delivery_id: int, message: str) -> None:
    """The retries are spent: the delivery is FAILED with the last error."""
    NotificationDelivery.objects.filter(pk=delivery_id, state=DeliveryState.PENDING).update(
        state=DeliveryState.FAILED, last_error=f"gave up after retries: {message}"[:2000]
    )
