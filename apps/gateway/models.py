"""What the gateway saw, scraped from HAProxy's Prometheus exporter in the monitoring beat cycle."""

from __future__ import annotations

from django.db import models


class GatewayMetrics(models.Model):
    """One minute at the gateway: per deployment (its backend), or gateway-wide (``deployment`` empty: every
    request that reached the gateway, including those it refused before choosing a model - 401, 404, 429).

    Counts are what happened within the minute; ``time_ms_sum`` is HAProxy's average total time (client
    request to last byte, as the gateway observed it) times the requests, so a span's average is
    ``time_ms_sum / requests``.
    """

    bucket = models.DateTimeField(help_text="Start of the minute (UTC).")
    deployment = models.ForeignKey(
        "deployments.Deployment", null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    requests = models.BigIntegerField(default=0)
    responses_2xx = models.BigIntegerField(default=0)
    responses_4xx = models.BigIntegerField(default=0)
    responses_5xx = models.BigIntegerField(default=0)
    time_ms_sum = models.FloatField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["bucket", "deployment"], name="unique_gateway_metrics_row"),
            models.UniqueConstraint(
                fields=["bucket"], condition=models.Q(deployment=None), name="unique_gateway_wide_row"
            ),
        ]
        indexes = [models.Index(fields=["deployment", "bucket"], name="gatewaymetrics_dep_bucket")]

    def __str__(self) -> str:
        return f"{self.bucket:%Y-%m-%d %H:%M} gateway {self.deployment_id or 'all'}"


class GatewayScrapeState(models.Model):
    """The exporter's counters at the last scrape: the baseline for the next deltas. HAProxy's counters restart
    at zero with every reload (new workers), seen as a counter that went down."""

    counters = models.JSONField(default=dict, blank=True)
    fetched_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)

    def __str__(self) -> str:
        return "gateway scrape state"
