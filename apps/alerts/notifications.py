"""Notifications: Alertmanager's webhook payload, and a delivery row per channel, sent after the commit
(one attempt and its retries: ``apps.alerts.delivery``).

The webhook body is Alertmanager's (version "4": status, receiver, groupKey, groupLabels, commonLabels,
commonAnnotations, externalURL, alerts[] with status, labels, annotations, startsAt, endsAt, generatorURL,
fingerprint), so receivers written for Alertmanager work unchanged.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from datetime import UTC, datetime

from django.conf import settings
from django.db import transaction
from django.urls import reverse

from apps.alerts.delivery import deliver_notification
from apps.alerts.models import (
    Alert,
    AlertRule,
    AlertState,
    NotificationChannel,
    NotificationDelivery,
)

log = logging.getLogger(__name__)

# Alertmanager's "zero time": an alert that has not ended.
ZERO_TIME = "0001-01-01T00:00:00Z"


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
    for delivery_id in delivery_ids:
        deliver_notification.delay(delivery_id)
