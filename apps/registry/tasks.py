from celery import shared_task

from apps.registry import services


@shared_task(name="apps.registry.tasks.expire_abandoned_uploads")
def expire_abandoned_uploads() -> int:
    return services.expire_abandoned_uploads()
