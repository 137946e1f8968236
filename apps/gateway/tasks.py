"""Beat tasks of the gateway (they run on the platform's workers, beside the gateway's exporter)."""

from celery import shared_task

from apps.gateway import autoscaling


@shared_task(name="apps.gateway.tasks.autoscale", ignore_result=True)
def autoscale() -> dict[str, int]:
    """Read the in-flight requests per deployment at the gateway and scale each autoscaled deployment."""
    return autoscaling.autoscale()
