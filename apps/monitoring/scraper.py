"""The scrape cycle: read every READY instance's metrics and statistics, store the interval's traffic.

Network reads run in a thread pool without touching the database, each bounded by
``METRICS_SCRAPE_TIMEOUT``, so a hung instance delays nobody else; the rows are then written one instance at
a time, each in its own transaction with the instance's ``ScrapeState`` row locked.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime

from django.conf import settings
from django.db import connections, router, transaction
from django.db.models import F
from django.utils import timezone

from apps.core.periods import MINUTE
from apps.fleet.models import Device, InstanceState, TritonInstance
from apps.monitoring import final_counts
from apps.monitoring.models import DeviceMetrics, InstanceMetrics, ModelMetrics, ScrapeState
from apps.registry.models import ModelVersion, RegisteredModel
from backend_ge import naming, triton_metrics

log = logging.getLogger(__name__)

DURATIONS = ("request_us", "queue_us", "compute_input_us", "compute_infer_us", "compute_output_us")
COUNTS = ("success", "inferences", "executions")


@dataclass
class Fetched:
    """The outcome of reading one instance: a reading, or the reason there is none."""

    instance: TritonInstance
    started_at: datetime
    server_id: str
    reading: triton_metrics.Reading | None = None
    error: str = ""
    # When the agent started the process (None: unknown start), as the instance row said before the read.
    server_started_at: datetime | None = None


@dataclass
class CycleResult:
    instances: int = 0
    failures: int = 0
    rows: int = 0
    errors: dict[str, str] = field(default_factory=dict)


def _get(url: str, timeout: float, headers: dict[str, str] | None = None) -> bytes:
    with urllib.request.urlopen(
        urllib.request.Request(url, headers=headers or {}), timeout=timeout
    ) as response:
        return response.read()


def fetch_instance(instance: TritonInstance, timeout: float | None = None) -> Fetched:
    """Read ``/metrics`` and ``/v2/models/stats`` of one instance (no database access: runs in a thread)."""
    timeout = timeout or settings.METRICS_SCRAPE_TIMEOUT
    fetched = Fetched(
        instance, timezone.now(), str(instance.pid or ""), server_started_at=instance.server_started_at
    )
    try:
        text = _get(instance.metrics_url(), timeout).decode("utf-8", errors="replace")
        # The statistics API needs the instance key; the metrics port has no restriction (it stays private).
        stats = json.loads(
            _get(f"{instance.endpoint_url()}/v2/models/stats", timeout, instance.key_headers())
        )
        reading = triton_metrics.parse_metrics(text)
        fetched.reading = triton_metrics.parse_statistics(stats, reading)
    except (OSError, urllib.error.URLError, ValueError) as exc:  # timeouts and refusals are OSErrors
        fetched.error = f"{type(exc).__name__}: {exc}"
    return fetched


class ModelNames:
    """Triton model names back to the platform's models and versions, for one cycle."""

    def __init__(self) -> None:
        self._models: dict[str, tuple[int, int]] = {}
        self._versions: dict[tuple[int, int], int] = {}
        self._loaded_versions: set[int] = set()

    @classmethod
    def load(cls, triton_name: str | None = None) -> ModelNames:
        """Every platform model's name, or only ``triton_name``'s."""
        names = cls()
        models = RegisteredModel.objects.all()
        if triton_name is not None:
            if not naming.is_triton_model_name(triton_name):
                return names  # a candidate, or a name the platform did not make
            team_slug, slug = naming.parse_triton_model_name(triton_name)
            models = models.filter(team__slug=team_slug, slug=slug)
        for model_id, team_id, team_slug, slug in models.values_list("pk", "team_id", "team__slug", "slug"):
            names._models[naming.triton_model_name(team_slug, slug)] = (model_id, team_id)
        return names

    def prepare(self, keys) -> None:
        """Load the versions of every platform model among ``keys`` in one query."""
        wanted = {self._models[name][0] for name, _ in keys if name in self._models} - self._loaded_versions
        if wanted:
            self._loaded_versions |= wanted
            for model_id, number, pk in ModelVersion.objects.filter(model_id__in=wanted).values_list(
                "model_id", "number", "pk"
            ):
                self._versions[(model_id, number)] = pk

    def resolve(self, triton_name: str, version: str) -> tuple[int, int, int] | None:
        """``(team_id, model_id, version_id)``, or None for candidates and names the platform did not make.

        A switch's smoke test runs under a candidate name (``naming.CANDIDATE_SUFFIX``), which is no model's
        name, so it is not client traffic here."""
        found = self._models.get(triton_name)
        if found is None or not version.isdigit():
            return None
        model_id, team_id = found
        if model_id not in self._loaded_versions:
            self.prepare([(triton_name, version)])
        version_id = self._versions.get((model_id, int(version)))
        return None if version_id is None else (team_id, model_id, version_id)


def minute_of(moment: datetime) -> datetime:
    return moment.replace(second=0, microsecond=0)


def scrape_all(
    now: datetime | None = None, fetch: Callable[[TritonInstance], Fetched] = fetch_instance
) -> CycleResult:
    """One scrape cycle over every READY instance, plus a device sample. Returns what happened."""
    instances = list(TritonInstance.objects.filter(state=InstanceState.READY).select_related("host"))
    result = CycleResult(instances=len(instances))
    if instances:
        with ThreadPoolExecutor(max_workers=min(16, len(instances))) as pool:
            fetched = list(pool.map(fetch, instances))
        names = ModelNames.load()
        for item in fetched:
            try:
                result.rows += record_scrape(item, names, now=now)
            except Exception:  # one instance's bad data must not cost the others their interval
                log.exception("recording the scrape of %s failed", item.instance)
                item.error = item.error or "recording failed"
            if item.error:
                result.failures += 1
                result.errors[str(item.instance)] = item.error
    sample_devices(now=now)
    return result


def scrape_instance(instance: TritonInstance, now: datetime | None = None) -> int:
    """Scrape one instance now (tests and the benchmark call this); returns the model rows written."""
    return record_scrape(fetch_instance(instance), ModelNames.load(), now=now)


def record_scrape(fetched: Fetched, names: ModelNames, now: datetime | None = None) -> int:
    """Turn one reading into minute rows against the instance's previous reading; returns rows written."""
    instance = fetched.instance
    bucket = minute_of(now or fetched.started_at)
    ScrapeState.objects.get_or_create(instance=instance)
    with transaction.atomic():
        state = ScrapeState.objects.select_for_update().get(instance=instance)
        if fetched.reading is None:
            _count_failure(state, instance, bucket, fetched.error)
            return 0
        if state.fetched_at is not None and fetched.started_at <= state.fetched_at:
            return 0  # an overlapping cycle already applied a newer reading: this one would count twice
        reading = fetched.reading
        previous = (
            triton_metrics.Baseline(state.server_id or None, state.counters) if state.has_baseline else None
        )
        restarted = bool(previous is not None and fetched.server_id and not _same_process(state, fetched))
        started_here = previous is None and bool(fetched.server_id) and fetched.server_started_at is not None
        if restarted or started_here:
            # The first reading of this process, which started at zero (a restart, or its agent started it):
            # all it counted is new, less the versions unloaded on it before this read, which their final
            # counts report counted already. A process of unknown start keeps the baseline rule.
            previous = final_counts.restart_baseline(
                state, fetched.server_id, fetched.server_started_at
            ) or triton_metrics.started_baseline(fetched.server_id)
        deltas = triton_metrics.counter_deltas(previous, fetched.server_id or None, reading.counters)
        owed = triton_metrics.settle_backend_failures(deltas, {} if restarted else state.owed)
        rows = write_model_rows(instance, bucket, deltas, reading.quantiles, names)
        _write_instance_row(instance, bucket, reading)
        counters = triton_metrics.flatten(reading.counters)
        final_counts.retire(state, restarted, counters, fetched.started_at)
        state.server_id = fetched.server_id
        state.server_started_at = fetched.server_started_at
        state.counters = counters
        state.owed = owed
        state.has_baseline = True
        state.fetched_at = fetched.started_at
        state.last_success_at = fetched.started_at
        state.last_error = ""
        state.consecutive_failures = 0
        state.save()
    return rows


def _same_process(state: ScrapeState, fetched: Fetched) -> bool:
    """The baseline's process: the same pid, and the same start where both are known (a pid can be reused)."""
    if fetched.server_id != state.server_id:
        return False
    known = state.server_started_at is not None and fetched.server_started_at is not None
    return not known or state.server_started_at == fetched.server_started_at


def _count_failure(state: ScrapeState, instance: TritonInstance, bucket: datetime, error: str) -> None:
    log.warning("scraping %s failed: %s", instance, error)
    ScrapeState.objects.filter(pk=state.pk).update(
        last_error=error[:2000],
        consecutive_failures=F("consecutive_failures") + 1,
        total_failures=F("total_failures") + 1,
    )
    row, _ = InstanceMetrics.objects.get_or_create(period_seconds=MINUTE, bucket=bucket, instance=instance)
    InstanceMetrics.objects.filter(pk=row.pk).update(
        scrapes=F("scrapes") + 1, scrape_failures=F("scrape_failures") + 1
    )


def _write_instance_row(instance: TritonInstance, bucket: datetime, reading: triton_metrics.Reading) -> None:
    row, _ = InstanceMetrics.objects.get_or_create(period_seconds=MINUTE, bucket=bucket, instance=instance)
    row.scrapes += 1
    if reading.cpu_utilization is not None:
        row.cpu_utilization_sum += reading.cpu_utilization
        row.cpu_samples += 1
    if reading.cpu_memory_used_bytes is not None:
        row.cpu_memory_used_bytes = reading.cpu_memory_used_bytes
    row.save()


def write_model_rows(
    instance: TritonInstance,
    bucket: datetime,
    deltas: dict[triton_metrics.SeriesKey, dict[str, float]],
    quantiles: dict[triton_metrics.SeriesKey, dict[str, float]],
    names: ModelNames,
) -> int:
    names.prepare(deltas)
    resolved = {}
    for key in deltas:
        ids = names.resolve(*key)
        if ids is not None:
            resolved[key] = ids
    if not resolved:
        return 0
    existing = {
        row.version_id: row
        for row in ModelMetrics.objects.filter(
            period_seconds=MINUTE,
            bucket=bucket,
            instance=instance,
            version_id__in=[ids[2] for ids in resolved.values()],
        )
    }
    created, updated = [], []
    for key, (team_id, model_id, version_id) in resolved.items():
        values = deltas[key]
        row = existing.get(version_id)
        if row is None:
            row = ModelMetrics(
                period_seconds=MINUTE,
                bucket=bucket,
                team_id=team_id,
                model_id=model_id,
                version_id=version_id,
                instance=instance,
            )
            created.append(row)
        else:
            updated.append(row)
        _add(row, values, quantiles.get(key))
    ModelMetrics.objects.bulk_create(created)
    update_rows(ModelMetrics, updated, UPDATE_FIELDS)
    return len(created) + len(updated)


def update_rows(table, rows: list, fields: list[str]) -> None:
    """Save ``fields`` of many rows with one prepared UPDATE run for each row (executemany).

    ``bulk_update`` builds a CASE expression per field and row, which cost most of a scrape cycle's CPU;
    the values still go through each field's own database preparation (JSON on PostgreSQL and SQLite).
    """
    if not rows:
        return
    connection = connections[router.db_for_write(table)]
    meta = table._meta
    columns = [meta.get_field(name) for name in fields]
    quote = connection.ops.quote_name
    sql = "UPDATE {} SET {} WHERE {} = %s".format(
        quote(meta.db_table), ", ".join(f"{quote(f.column)} = %s" for f in columns), quote(meta.pk.column)
    )
    params = [
        [f.get_db_prep_save(getattr(row, f.attname), connection) for f in columns] + [row.pk] for row in rows
    ]
    with connection.cursor() as cursor:
        cursor.executemany(sql, params)


UPDATE_FIELDS = [
    *COUNTS,
    *DURATIONS,
    "failure",
    "failure_reasons",
    "client_errors",
    "batch_executions",
    "p50_us",
    "p95_us",
    "p99_us",
    "quantile_requests",
]


def _add(row: ModelMetrics, values: dict[str, float], quantiles: dict[str, float] | None) -> None:
    for name in COUNTS:
        setattr(row, name, getattr(row, name) + int(values.get(name, 0)))
    for name in DURATIONS:
        setattr(row, name, getattr(row, name) + values.get(name, 0.0))
    reasons = dict(row.failure_reasons)
    for reason, count in triton_metrics.failures(values).items():
        reasons[reason] = reasons.get(reason, 0) + int(count)
        row.failure += int(count)
    row.failure_reasons = reasons
    row.client_errors += int(triton_metrics.client_errors(values))
    batches = dict(row.batch_executions)
    for size, count in triton_metrics.batch_executions(values).items():
        batches[size] = batches.get(size, 0) + int(count)
    row.batch_executions = batches
    requests = int(values.get("success", 0)) + sum(int(c) for c in triton_metrics.failures(values).values())
    if quantiles and requests:
        # Triton's quantiles cover its recent window; weight each scrape's by the requests it saw.
        weight = row.quantile_requests
        for field_name, key in (
            ("p50_us", "request_p50"),
            ("p95_us", "request_p95"),
            ("p99_us", "request_p99"),
        ):
            value = quantiles.get(key)
            if value is None:
                continue
            old = getattr(row, field_name)
            setattr(
                row,
                field_name,
                value
                if old is None or not weight
                else (old * weight + value * requests) / (weight + requests),
            )
        row.quantile_requests = weight + requests


def sample_devices(now: datetime | None = None) -> int:
    """Add the NPUs' current use (from the agents' latest npu-smi inventory) to their minute rows."""
    now = now or timezone.now()
    bucket = minute_of(now)
    devices = list(
        Device.objects.filter(host__last_heartbeat_at__isnull=False).values_list(
            "pk", "aicore_percent", "hbm_used_mb", "hbm_total_mb", "memory_used_mb", "memory_total_mb"
        )
    )
    if not devices:
        return 0
    rows = {r.device_id: r for r in DeviceMetrics.objects.filter(period_seconds=MINUTE, bucket=bucket)}
    created, updated = [], []
    for pk, aicore, hbm_used, hbm_total, mem_used, mem_total in devices:
        row = rows.get(pk)
        if row is None:
            row = DeviceMetrics(period_seconds=MINUTE, bucket=bucket, device_id=pk)
            created.append(row)
        else:
            updated.append(row)
        row.samples += 1
        if aicore is not None:
            row.aicore_percent_sum += aicore
            row.aicore_samples += 1
        # 310P cards report device memory instead of HBM (npu-smi's Memory-Usage column).
        used, total = (hbm_used, hbm_total) if hbm_total else (mem_used, mem_total)
        if used is not None:
            row.hbm_used_mb_sum += used
            row.hbm_samples += 1
        row.hbm_total_mb = total
    DeviceMetrics.objects.bulk_create(created)
    update_rows(
        DeviceMetrics,
        updated,
        ["samples", "aicore_percent_sum", "aicore_samples", "hbm_used_mb_sum", "hbm_samples", "hbm_total_mb"],
    )
    return len(devices)
