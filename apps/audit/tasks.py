from celery import shared_task
from django.conf import settings

from apps.audit import services


@shared_task(name="apps.audit.tasks.prune_audit_events")
def prune_audit_events() -> int:
    return services.prune_audit_events(settings.AUDIT_RETENTION_DAYS)
