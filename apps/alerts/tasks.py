"""Beat's minute evaluation and the notification deliveries (retried with backoff)."""

from __future__ import annotations

from celery import shared_task

from apps.alerts import services

# Defined beside the attempt it retries, below the services that queue it; listed here so the worker's
# autodiscovery of ``tasks`` modules finds every task of the app.
from apps.alerts.delivery import deliver_notification

__all__ = ["deliver_notification", "evaluate_alert_rules"]


@shared_task(name="apps.alerts.tasks.evaluate_alert_rules", ignore_result=True)
def evaluate_alert_rules() -> dict:
    result = services.evaluate_rules()
    return result.__dict__
