"""Downsampling and retention of the rollup rows, and the time series the charts draw from them."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F, QuerySet, Sum
from django.db.models.functions import TruncHour
from django.utils import timezone

from apps.core.periods import HOUR, MINUTE
from apps.gateway.models import GatewayMetrics
from apps.monitoring.models import DeviceMetrics, InstanceMetrics, ModelMetrics

SUMMED = (
    "success",
    "failure",
    "client_errors",
    "inferences",
    "executions",
    "request_us",
    "queue_us",
    "compute_input_us",
    "compute_infer_us",
    "compute_output_us",
)
QUANTILE_FIELDS = ("p50_us", "p95_us", "p99_us")


@dataclass(frozen=True)
class Range:
    """A chart range: how far back, and the width of one point."""

    key: str
    seconds: int
    step: int


# ~15-360 points per line: enough detail, and the 7-day range reads hourly rows where minutes are gone.
RANGES = {
    "15m": Range("15m", 900, MINUTE),
    "1h": Range("1h", 3600, MINUTE),
    "6h": Range("6h", 6 * 3600, MINUTE),
    "24h": Range("24h", 24 * 3600, 5 * MINUTE),
    "7d": Range("7d", 7 * 24 * 3600, HOUR),
}


# --------------------------------------------------------------------------------------- retention
def downsample(now: datetime | None = None) -> dict[str, int]:
    """Fold minute rows older than ``METRICS_MINUTE_RETENTION_DAYS`` into hourly rows (whole hours only) and
    drop every row older than ``METRICS_RETENTION_DAYS``. Idempotent: rerunning adds nothing twice."""
    now = now or timezone.now()
    cutoff = (now - timedelta(days=settings.METRICS_MINUTE_RETENTION_DAYS)).replace(
        minute=0, second=0, microsecond=0
    )
    drop_before = now - timedelta(days=settings.METRICS_RETENTION_DAYS)
    with transaction.atomic():
        folded = (
            _fold_model_rows(cutoff)
            + _fold_instance_rows(cutoff)
            + _fold_device_rows(cutoff)
            + _fold_gateway_rows(cutoff)
        )
        dropped = sum(
            table.objects.filter(bucket__lt=drop_before).delete()[0]
            for table in (ModelMetrics, InstanceMetrics, DeviceMetrics, GatewayMetrics)
        )
    return {"folded": folded, "dropped": dropped}


def _hour(moment: datetime) -> datetime:
    return moment.replace(minute=0, second=0, microsecond=0)


def _merge_dict(target: dict, source: dict) -> dict:
    for key, value in source.items():
        target[key] = target.get(key, 0) + value
    return target


def _fold_model_rows(cutoff: datetime) -> int:
    minutes = ModelMetrics.objects.filter(period_seconds=MINUTE, bucket__lt=cutoff)
    hours: dict[tuple, ModelMetrics] = {}
    count = 0
    for row in minutes.order_by("bucket").iterator(chunk_size=2000):
        count += 1
        key = (_hour(row.bucket), row.instance_id, row.version_id)
        hour = hours.get(key)
        if hour is None:
            hour = hours[key] = ModelMetrics(
                period_seconds=HOUR,
                bucket=key[0],
                team_id=row.team_id,
                model_id=row.model_id,
                version_id=row.version_id,
                instance_id=row.instance_id,
            )
        _fold_model_row(hour, row)
    if not count:
        return 0
    # An hour partly folded by an earlier run (its later minutes arrived after) gets the rest added.
    existing = ModelMetrics.objects.filter(
        period_seconds=HOUR, bucket__in={k[0] for k in hours}, instance_id__in={k[1] for k in hours}
    )
    for row in existing:
        key = (row.bucket, row.instance_id, row.version_id)
        if key in hours:
            _fold_model_row(row, hours[key])
            hours[key] = row
    ModelMetrics.objects.bulk_create([h for h in hours.values() if h.pk is None])
    ModelMetrics.objects.bulk_update(
        [h for h in hours.values() if h.pk is not None],
        [*SUMMED, *QUANTILE_FIELDS, "quantile_requests", "failure_reasons", "batch_executions"],
    )
    minutes.delete()
    return count


def _fold_model_row(target: ModelMetrics, row: ModelMetrics) -> None:
    for name in SUMMED:
        setattr(target, name, getattr(target, name) + getattr(row, name))
    _merge_dict(target.failure_reasons, row.failure_reasons)
    _merge_dict(target.batch_executions, row.batch_executions)
    weight, extra = target.quantile_requests, row.quantile_requests
    if extra:
        for name in QUANTILE_FIELDS:
            old, new = getattr(target, name), getattr(row, name)
            if new is None:
                continue
            setattr(
                target,
                name,
                new if old is None or not weight else (old * weight + new * extra) / (weight + extra),
            )
        target.quantile_requests = weight + extra


def _fold_simple(table, cutoff: datetime, owner: str, summed: tuple[str, ...], last: tuple[str, ...]) -> int:
    minutes = table.objects.filter(period_seconds=MINUTE, bucket__lt=cutoff)
    hours: dict[tuple, object] = {}
    count = 0
    for row in minutes.order_by("bucket").iterator(chunk_size=2000):
        count += 1
        key = (_hour(row.bucket), getattr(row, owner))
        hour = hours.get(key)
        if hour is None:
            hour = hours[key] = table(period_seconds=HOUR, bucket=key[0], **{owner: key[1]})
        for name in summed:
            setattr(hour, name, getattr(hour, name) + getattr(row, name))
        for name in last:
            if getattr(row, name) is not None:
                setattr(hour, name, getattr(row, name))
    if not count:
        return 0
    for row in table.objects.filter(period_seconds=HOUR, bucket__in={k[0] for k in hours}):
        key = (row.bucket, getattr(row, owner))
        if key in hours:
            for name in summed:
                setattr(row, name, getattr(row, name) + getattr(hours[key], name))
            for name in last:
                setattr(row, name, getattr(hours[key], name) or getattr(row, name))
            hours[key] = row
    table.objects.bulk_create([h for h in hours.values() if h.pk is None])
    table.objects.bulk_update([h for h in hours.values() if h.pk is not None], [*summed, *last])
    minutes.delete()
    return count


def _fold_instance_rows(cutoff: datetime) -> int:
    return _fold_simple(
        InstanceMetrics,
        cutoff,
        "instance_id",
        ("scrapes", "scrape_failures", "cpu_utilization_sum", "cpu_samples"),
        ("cpu_memory_used_bytes",),
    )


def _fold_device_rows(cutoff: datetime) -> int:
    return _fold_simple(
        DeviceMetrics,
        cutoff,
        "device_id",
        ("samples", "aicore_percent_sum", "aicore_samples", "hbm_used_mb_sum", "hbm_samples"),
        ("hbm_total_mb",),
    )


def _fold_gateway_rows(cutoff: datetime) -> int:
    # Per deployment, and gateway-wide (deployment empty): every column is a count or a sum.
    summed = tuple(
        f.name for f in GatewayMetrics._meta.concrete_fields if f.name.startswith(("requests", "responses_"))
    )
    return _fold_simple(GatewayMetrics, cutoff, "deployment_id", (*summed, "time_ms_sum"), ())


# --------------------------------------------------------------------------------------- chart series
@dataclass(frozen=True)
class Window:
    range: Range
    start: datetime
    end: datetime

    @classmethod
    def ending(cls, range_: Range, now: datetime | None = None) -> Window:
        now = now or timezone.now()
        epoch = int(now.timestamp())
        end = datetime.fromtimestamp(epoch - epoch % range_.step + range_.step, tz=UTC)
        return cls(range_, end - timedelta(seconds=range_.seconds), end)

    @property
    def points(self) -> int:
        return self.range.seconds // self.range.step

    def timestamps(self) -> list[int]:
        start = int(self.start.timestamp())
        return [start + i * self.range.step for i in range(self.points)]

    def index(self, bucket: datetime) -> int:
        return int((bucket - self.start).total_seconds()) // self.range.step


def ratio(numerator: float, denominator: float, scale: float = 1.0) -> float | None:
    return round(numerator / denominator * scale, 4) if denominator else None


def traffic_series(rows: QuerySet, window: Window, group: str | None) -> dict:
    """Per ``group`` value (e.g. the version number; one group when None): the chart lines of the window.

    The database sums the instances of each minute; the steps of wider ranges are folded here, which
    keeps the query the same on SQLite and PostgreSQL and cheap with the (model, bucket) index.
    """
    # Hourly points are summed by the database (168 groups for a week instead of 10,080 minutes); finer
    # steps are folded below.
    bucket = TruncHour("bucket") if window.range.step == HOUR else F("bucket")
    fields = ["point", group] if group else ["point"]
    aggregates = {name: Sum(name) for name in SUMMED}
    aggregates.update({f"{q}_w": Sum(_weighted(q)) for q in QUANTILE_FIELDS})
    aggregates["quantile_requests"] = Sum("quantile_requests")
    grouped = (
        rows.filter(bucket__gte=window.start, bucket__lt=window.end)
        .annotate(point=bucket)
        .values(*fields)
        .annotate(**aggregates)
        .order_by()
    )
    points = window.points
    acc: dict = defaultdict(lambda: defaultdict(lambda: [0.0] * points))
    for item in grouped:
        i = window.index(item["point"])
        if not 0 <= i < points:
            continue
        lines = acc[item[group] if group else "all"]
        for name in (*SUMMED, "quantile_requests", *(f"{q}_w" for q in QUANTILE_FIELDS)):
            lines[name][i] += item[name] or 0
    step = window.range.step
    out = {}
    for key, sums in sorted(acc.items(), key=lambda kv: str(kv[0])):
        requests = [s + f for s, f in zip(sums["success"], sums["failure"], strict=True)]
        out[key] = {
            "requests_per_second": [round(r / step, 4) for r in requests],
            # Server failures of the requests the model took; bad requests (the caller's error) beside it.
            "error_rate": [ratio(f, r) for f, r in zip(sums["failure"], requests, strict=True)],
            "client_errors_per_second": [round(c / step, 4) for c in sums["client_errors"]],
            "avg_latency_ms": [ratio(d, r, 1e-3) for d, r in zip(sums["request_us"], requests, strict=True)],
            "queue_ms": [ratio(d, r, 1e-3) for d, r in zip(sums["queue_us"], requests, strict=True)],
            "compute_ms": [
                ratio(a + b + c, r, 1e-3)
                for a, b, c, r in zip(
                    sums["compute_input_us"],
                    sums["compute_infer_us"],
                    sums["compute_output_us"],
                    requests,
                    strict=True,
                )
            ],
            "avg_batch_size": [
                ratio(n, e) for n, e in zip(sums["inferences"], sums["executions"], strict=True)
            ],
            **{
                f"{q[:3]}_ms": [
                    ratio(w, n, 1e-3) for w, n in zip(sums[f"{q}_w"], sums["quantile_requests"], strict=True)
                ]
                for q in QUANTILE_FIELDS
            },
            "totals": {
                "requests": int(sum(requests)),
                "success": int(sum(sums["success"])),
                "failure": int(sum(sums["failure"])),
                "client_errors": int(sum(sums["client_errors"])),
            },
        }
    return out


def _weighted(field_name: str):
    return F(field_name) * F("quantile_requests")


def failure_reasons(rows: QuerySet, window: Window) -> dict[str, int]:
    reasons: dict[str, int] = {}
    for item in rows.filter(bucket__gte=window.start, bucket__lt=window.end, failure__gt=0).values_list(
        "failure_reasons", flat=True
    ):
        _merge_dict(reasons, item)
    return reasons


def instance_series(instance_id: int, window: Window) -> dict:
    """CPU utilisation (%) and scrape failures of one instance."""
    cpu: list[float | None] = [None] * window.points
    cpu_acc = [[0.0, 0] for _ in range(window.points)]
    failures = [0] * window.points
    for bucket, cpu_sum, samples, failed in InstanceMetrics.objects.filter(
        instance_id=instance_id, bucket__gte=window.start, bucket__lt=window.end
    ).values_list("bucket", "cpu_utilization_sum", "cpu_samples", "scrape_failures"):
        i = window.index(bucket)
        if 0 <= i < window.points:
            cpu_acc[i][0] += cpu_sum
            cpu_acc[i][1] += samples
            failures[i] += failed
    for i, (total, samples) in enumerate(cpu_acc):
        cpu[i] = round(total / samples * 100, 2) if samples else None
    return {"cpu_percent": cpu, "scrape_failures": failures}


def device_series(device_ids: list[int], window: Window) -> dict[int, dict]:
    """Per device: AI core use (%) and HBM (or device memory) used in MB."""
    out: dict[int, dict] = {}
    acc: dict[int, list] = {}
    for device_id, bucket, core_sum, core_n, hbm_sum, hbm_n, hbm_total in DeviceMetrics.objects.filter(
        device_id__in=device_ids, bucket__gte=window.start, bucket__lt=window.end
    ).values_list(
        "device_id",
        "bucket",
        "aicore_percent_sum",
        "aicore_samples",
        "hbm_used_mb_sum",
        "hbm_samples",
        "hbm_total_mb",
    ):
        i = window.index(bucket)
        if not 0 <= i < window.points:
            continue
        cells = acc.setdefault(device_id, [[0.0, 0, 0.0, 0] for _ in range(window.points)])
        cells[i][0] += core_sum
        cells[i][1] += core_n
        cells[i][2] += hbm_sum
        cells[i][3] += hbm_n
        out.setdefault(device_id, {"hbm_total_mb": hbm_total})["hbm_total_mb"] = hbm_total
    for device_id, cells in acc.items():
        out[device_id]["aicore_percent"] = [round(c[0] / c[1], 2) if c[1] else None for c in cells]
        out[device_id]["hbm_used_mb"] = [round(c[2] / c[3], 1) if c[3] else None for c in cells]
    return out
