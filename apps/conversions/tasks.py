"""Celery tasks of conversions (routed to the ``conversions`` queue by CELERY_TASK_ROUTES).

Reliability: the message is acknowledged only after the task returns (``acks_late``) and is given back to
the broker when the worker process dies (``reject_on_worker_lost``), so a killed worker's job is delivered
again; the job row's conditional claim and its heartbeat decide whether that copy may run (see
``apps.conversions.runner``). ``recover_stale_conversions`` (celery beat, every minute) re-enqueues jobs whose
worker died when the broker would only redeliver after its visibility timeout.
"""

from __future__ import annotations

from celery import shared_task
from django.conf import settings
from django.db import InterfaceError, OperationalError

from apps.conversions import runner


@shared_task(
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    soft_time_limit=settings.CONVERSION_TIME_LIMIT,
    # The hard limit leaves the soft one time to record the failure on the row.
    time_limit=settings.CONVERSION_TIME_LIMIT + 60,
    autoretry_for=(OperationalError, InterfaceError),
    retry_backoff=True,
    retry_backoff_max=300,
    retry_jitter=True,
    max_retries=5,
)
def run_conversion(self, job_id: int) -> str:
    """Run one ConversionJob (QUEUED -> RUNNING -> SUCCEEDED | FAILED); exits cleanly if the row is gone,
    already finished, or held by a live worker."""
    outcome = runner.execute_job(job_id, worker=self.request.hostname or "")
    if outcome == "busy":
        # A copy redelivered right after its worker died sees that worker's last heartbeat as still fresh:
        # look again once it would be stale, until the job finishes or becomes claimable.
        timeout = settings.CONVERSION_HEARTBEAT_TIMEOUT
        raise self.retry(countdown=timeout, max_retries=settings.CONVERSION_TIME_LIMIT // timeout + 3)
    return outcome


@shared_task
def recover_stale_conversions() -> list[int]:
    """Re-enqueue RUNNING jobs whose worker stopped its heartbeat; fail those on their last attempt."""
    requeued = runner.recover_stale_jobs()
    for job_id in requeued:
        run_conversion.delay(job_id)
    return requeued
