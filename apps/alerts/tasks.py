"""Beat's minute evaluation and the notification deliveries (retried with backoff)."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

from apps.alerts import notifications, services
from apps.alerts.models import DeliveryState, NotificationDelivery


@shared_task(name="apps.alerts.tasks.evaluate_alert_rules", ignore_result=True)
def evaluate_alert_rules() -> dict:
    result = services.evaluate_rules()
    return result.__dict__


@shared_task(
    bind=True,
    name="apps.alerts.tasks.deliver_notification",
    ignore_result=True,
    autoretry_for=(notifications.TransientDeliveryError,),
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
        notifications.send(delivery)
    except notifications.TransientDeliveryError as error:
        if self.request.retries >= self.max_retries:
            notifications.give_up(delivery_id, str(error))
            return
        raise
