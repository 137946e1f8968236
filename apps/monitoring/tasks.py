"""Beat tasks of monitoring: the scrape cycle and the downsampling of old rows."""

from __future__ import annotations

from celery import shared_task

from apps.gateway.metrics import scrape_gateway
from apps.monitoring import rollups, scraper


@shared_task(name="apps.monitoring.tasks.scrape_instances", ignore_result=True)
def scrape_instances() -> dict:
    """Scrape every READY instance once (every ``METRICS_SCRAPE_INTERVAL`` seconds from beat)."""
    result = scraper.scrape_all()
    # The gateway's exporter in the same cycle: per-deployment requests, response classes, gateway time.
    gateway_rows = scrape_gateway()
    return {
        "instances": result.instances,
        "failures": result.failures,
        "rows": result.rows,
        "gateway_rows": gateway_rows,
    }


@shared_task(name="apps.monitoring.tasks.downsample_metrics", ignore_result=True)
def downsample_metrics() -> dict:
    return rollups.downsample()
