"""One notification delivery: its attempts (webhook or email), their log on the row, the retries.

The worker's side of a notification, below ``apps.alerts.notifications`` (which writes the delivery rows and
enqueues this task when they commit) and ``apps.alerts.services``; ``apps.alerts.tasks`` lists it with the
app's other tasks.
"""

from __future__ import annotations

import logging
import smtplib

from celery import shared_task
from django.conf import settings
from django.core.mail import send_mail
from django.utils import timezone

from apps.alerts import webhooks
from apps.alerts.models import ChannelKind, DeliveryState, NotificationDelivery

log = logging.getLogger(__name__)

# HTTP answers worth another try (Alertmanager retries these too); every other 4xx is final.
RETRY_STATUSES = {408, 425, 429}


class TransientDeliveryError(Exception):
    """The receiver may take it later: the task retries with backoff."""


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


@shared_task(
    bind=True,
    # Named as when it lived in apps.alerts.tasks: queued messages and routes refer to the name.
    name="apps.alerts.tasks.deliver_notification",
    ignore_result=True,
    autoretry_for=(TransientDeliveryError,),
    retry_backoff=settings.ALERT_DELIVERY_RETRY_BACKOFF,
    retry_backoff_max=600,
    retry_jitter=True,
    max_retries=settings.ALERT_DELIVERY_MAX_RETRIES,
)
def deliver_notification(self, delivery_id: int) -> None:
    delivery = (
        NotificationDelivery.objects.select_related("channel")
        .filter(pk=delivery_id, state=DeliveryState.PENDING)
        .first()
    )
    if delivery is None:  # gone, or already sent by an earlier copy
        return
    try:
        send(delivery)
    except TransientDeliveryError as error:
        if self.request.retries >= self.max_retries:
            give_up(delivery_id, str(error))
            return
        raise
