"""Celery tasks of conversions (routed to the ``conversions`` queue by CELERY_TASK_ROUTES)."""

from __future__ import annotations

from celery import shared_task


@shared_task(bind=True, acks_late=True, reject_on_worker_lost=True)
def run_conversion(self, job_id: int) -> None:
    """Run one ConversionJob (QUEUED -> RUNNING -> SUCCEEDED | FAILED)."""
    from apps.conversions.runner import execute_job

    execute_job(job_id, worker=self.request.hostname or "")
