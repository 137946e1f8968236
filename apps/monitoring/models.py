"""Rollups of what the Triton instances served, and the scraper's memory of each instance.

Rows are per minute (``period_seconds`` 60) and become hourly rows (3600) after
``METRICS_MINUTE_RETENTION_DAYS``; everything goes after ``METRICS_RETENTION_DAYS``
(``apps.monitoring.rollups.downsample``). Counts are what happened within the row's period; durations are
sums in microseconds, so averages of any span are sums divided by counts.
"""

from __future__ import annotations

from django.db import models

from apps.core.periods import MINUTE, PERIOD_CHOICES
from apps.teams.models import TeamScopedQuerySet


class ModelMetrics(models.Model):
    """Traffic of one model version on one instance within one minute (or hour).

    ``p50_us``/``p95_us``/``p99_us`` are Triton's request latency quantiles (only where the instance runs
    with latency summaries), averaged over the period weighted by ``quantile_requests``; without them the
    charts fall back to ``request_us / requests``.

    ``failure`` (with ``failure_reasons``) are server failures: the model or the server failed a request it
    should have answered. ``client_errors`` are requests the model refused as not fitting it (the GE backend's
    INVALID_ARG, a 400 to the caller): counted beside, never in the error rate, rollout gates or alerts.
    ``success + failure`` are the requests the model took.
    """

    period_seconds = models.PositiveIntegerField(choices=PERIOD_CHOICES, default=MINUTE)
    bucket = models.DateTimeField(help_text="Start of the period (UTC).")
    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="+")
    model = models.ForeignKey("registry.RegisteredModel", on_delete=models.CASCADE, related_name="+")
    version = models.ForeignKey("registry.ModelVersion", on_delete=models.CASCADE, related_name="+")
    instance = models.ForeignKey("fleet.TritonInstance", on_delete=models.CASCADE, related_name="+")
    success = models.BigIntegerField(default=0)
    failure = models.BigIntegerField(default=0)
    failure_reasons = models.JSONField(default=dict, blank=True)
    client_errors = models.BigIntegerField(
        default=0, help_text="Requests refused as malformed (400): the caller's error, not a failure."
    )
    inferences = models.BigIntegerField(default=0, help_text="Batch items: a request of batch 4 counts 4.")
    executions = models.BigIntegerField(default=0, help_text="Model executions (batches).")
    batch_executions = models.JSONField(default=dict, blank=True, help_text="{batch size: executions}")
    request_us = models.FloatField(default=0)
    queue_us = models.FloatField(default=0)
    compute_input_us = models.FloatField(default=0)
    compute_infer_us = models.FloatField(default=0)
    compute_output_us = models.FloatField(default=0)
    p50_us = models.FloatField(null=True, blank=True)
    p95_us = models.FloatField(null=True, blank=True)
    p99_us = models.FloatField(null=True, blank=True)
    quantile_requests = models.BigIntegerField(default=0)

    objects = TeamScopedQuerySet.as_manager()

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["period_seconds", "bucket", "instance", "version"], name="unique_model_metrics_row"
            )
        ]
        indexes = [
            # The model page: one model's rows over a time range.
            models.Index(fields=["model", "bucket"], name="modelmetrics_model_bucket"),
            # The instance page and the fleet dashboard.
            models.Index(fields=["instance", "bucket"], name="modelmetrics_instance_bucket"),
            models.Index(fields=["bucket"], name="modelmetrics_bucket"),
        ]

    def __str__(self) -> str:
        return f"{self.bucket:%Y-%m-%d %H:%M} {self.version_id}@{self.instance_id}"


class InstanceMetrics(models.Model):
    """One instance within one minute (or hour): scrapes, failed scrapes and Triton's CPU utilisation."""

    period_seconds = models.PositiveIntegerField(choices=PERIOD_CHOICES, default=MINUTE)
    bucket = models.DateTimeField()
    instance = models.ForeignKey("fleet.TritonInstance", on_delete=models.CASCADE, related_name="+")
    scrapes = models.PositiveIntegerField(default=0)
    scrape_failures = models.PositiveIntegerField(default=0)
    cpu_utilization_sum = models.FloatField(default=0, help_text="Sum of nv_cpu_utilization samples (0-1).")
    cpu_samples = models.PositiveIntegerField(default=0)
    cpu_memory_used_bytes = models.FloatField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["period_seconds", "bucket", "instance"], name="unique_instance_metrics_row"
            )
        ]
        indexes = [models.Index(fields=["instance", "bucket"], name="instancemetrics_inst_bucket")]

    def __str__(self) -> str:
        return f"{self.bucket:%Y-%m-%d %H:%M} instance {self.instance_id}"


class DeviceMetrics(models.Model):
    """One NPU within one minute (or hour), sampled from the Device rows the agent's heartbeat writes."""

    period_seconds = models.PositiveIntegerField(choices=PERIOD_CHOICES, default=MINUTE)
    bucket = models.DateTimeField()
    device = models.ForeignKey("fleet.Device", on_delete=models.CASCADE, related_name="+")
    samples = models.PositiveIntegerField(default=0)
    aicore_percent_sum = models.FloatField(default=0)
    aicore_samples = models.PositiveIntegerField(default=0)
    hbm_used_mb_sum = models.FloatField(default=0)
    hbm_samples = models.PositiveIntegerField(default=0)
    hbm_total_mb = models.IntegerField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["period_seconds", "bucket", "device"], name="unique_device_metrics_row"
            )
        ]
        indexes = [models.Index(fields=["device", "bucket"], name="devicemetrics_device_bucket")]

    def __str__(self) -> str:
        return f"{self.bucket:%Y-%m-%d %H:%M} device {self.device_id}"


class ScrapeState(models.Model):
    """What the scraper last read from one instance: the baseline for the next interval's deltas.

    ``server_id`` identifies the tritonserver process (its pid, with ``server_started_at``): when it changes,
    every counter restarted at zero. The first reading of an instance is only the baseline, unless its agent
    reported starting that process: then it counts from zero (``apps.monitoring.scraper.record_scrape``). ``counters`` is ``{"model|version|counter": value}``; ``owed`` holds backend failures not yet
    matched by a success count (``backend_ge.triton_metrics.settle_backend_failures``).
    """

    instance = models.OneToOneField("fleet.TritonInstance", on_delete=models.CASCADE, related_name="+")
    server_id = models.CharField(max_length=64, blank=True)
    # When the agent started that process (``TritonInstance.server_started_at``): the same pid with another
    # start is another process; empty when its start is unknown.
    server_started_at = models.DateTimeField(null=True, blank=True)
    counters = models.JSONField(default=dict, blank=True)
    owed = models.JSONField(default=dict, blank=True)
    # apps.monitoring.final_counts: versions a scrape found gone, with their last scraped values, and the
    # hosts' reports of final counts already folded ({"model|version": {...}}), both kept for an hour.
    retired = models.JSONField(default=dict, blank=True)
    finals = models.JSONField(default=dict, blank=True)
    has_baseline = models.BooleanField(default=False)
    fetched_at = models.DateTimeField(null=True, blank=True, help_text="When the applied reading was taken.")
    last_success_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    consecutive_failures = models.PositiveIntegerField(default=0)
    total_failures = models.PositiveBigIntegerField(default=0)

    def __str__(self) -> str:
        return f"scrape state of instance {self.instance_id}"
