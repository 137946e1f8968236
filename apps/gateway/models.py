"""What the gateway saw, scraped from HAProxy's Prometheus exporter in the monitoring beat cycle."""

from __future__ import annotations

from django.db import models

from apps.core.periods import MINUTE, PERIOD_CHOICES


class GatewayMetrics(models.Model):
    """One minute (an hour once downsampled, like the model rows) at the gateway, per deployment or
    gateway-wide (``deployment`` empty).

    Per deployment: ``requests`` and the response classes are the requests the gateway forwarded to the
    deployment's instances (its backend); ``responses_401`` and ``responses_429`` are requests naming the
    deployment's model that the gateway refused (no valid token, the team over its rate); ``responses_404``
    are 404s its instances answered (a version that is not loaded). A 404 for an unknown model, or another
    team's, names no deployment of the caller: it is counted gateway-wide only.

    Client errors apart from server errors: ``responses_400`` are bad requests its instances answered (HTTP 400,
    Triton's request-parse failures included - the gateway answers those 400, not Triton's 500 - and gRPC
    INVALID_ARGUMENT): the caller must fix the request. ``responses_5xx`` are server errors only (a model that
    failed, no instance ready, a timeout): worth a retry, and what alerts and charts of failures show.

    Gateway-wide: every request that reached the gateway (HTTP and gRPC, refusals included); ``responses_404``
    adds the gateway's own 404s (paths off the allow-list, unknown models, gRPC methods not offered and gRPC
    without a dedicated instance) to the instances'; gRPC UNAUTHENTICATED and RESOURCE_EXHAUSTED count as 401
    and 429.

    ``time_ms_sum`` is HAProxy's average total time (client request to last byte, as the gateway observed it,
    over its last 1024 requests) times the requests, so a span's average is ``time_ms_sum / requests``.
    """

    period_seconds = models.PositiveIntegerField(choices=PERIOD_CHOICES, default=MINUTE)
    bucket = models.DateTimeField(help_text="Start of the minute or hour (UTC).")
    deployment = models.ForeignKey(
        "deployments.Deployment", null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    requests = models.BigIntegerField(default=0)
    responses_2xx = models.BigIntegerField(default=0)
    responses_4xx = models.BigIntegerField(default=0)
    responses_5xx = models.BigIntegerField(default=0)
    responses_401 = models.BigIntegerField(default=0)
    responses_404 = models.BigIntegerField(default=0)
    responses_429 = models.BigIntegerField(default=0)
    responses_400 = models.BigIntegerField(default=0)
    # Requests admitted to the deployment's model (a valid token of its team, within the rate), by the
    # caller's priority class (apps.core.priority).
    requests_interactive = models.BigIntegerField(default=0)
    requests_batch = models.BigIntegerField(default=0)
    time_ms_sum = models.FloatField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["period_seconds", "bucket", "deployment"], name="unique_gateway_metrics_row"
            ),
            models.UniqueConstraint(
                fields=["period_seconds", "bucket"],
                condition=models.Q(deployment=None),
                name="unique_gateway_wide_row",
            ),
        ]
        indexes = [models.Index(fields=["deployment", "bucket"], name="gatewaymetrics_dep_bucket")]

    def __str__(self) -> str:
        return f"{self.bucket:%Y-%m-%d %H:%M} gateway {self.deployment_id or 'all'}"


class GatewayScrapeState(models.Model):
    """The exporter's counters at the last scrape: the baseline for the next deltas. HAProxy's counters restart
    at zero with every reload (new workers), seen as a new worker pid or a counter that went down.

    ``started_workers`` are the worker pids the gateway command started (a start or a reload), newest last,
    written by that command: the first scrape of such a worker counts from zero - it counted nothing before
    the gateway started it - where a worker of unknown start is only the baseline."""

    counters = models.JSONField(default=dict, blank=True)
    started_workers = models.JSONField(default=list, blank=True)
    fetched_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)

    def __str__(self) -> str:
        return "gateway scrape state"
