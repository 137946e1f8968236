"""Two versions of one model side by side: what they are (``apps.registry.comparison``), how each was
converted (the job's toolchain, options, ATC command and duration) and how each served over a range (requests,
error rate, p50/p99 from the minute and hour rollups). The comparison API and page render this one payload."""

from __future__ import annotations

from datetime import datetime

from django.db.models import Sum

from apps.conversions.models import ConversionJob
from apps.monitoring import rollups
from apps.monitoring.models import ModelMetrics
from apps.monitoring.services import check_range
from apps.registry import comparison
from apps.registry.models import ModelVersion, RegisteredModel


class CompareError(ValueError):
    """The query cannot be answered as asked (HTTP 400); the message says what to send instead."""


def check_numbers(a, b) -> tuple[int, int]:
    """``a`` and ``b`` as two different version numbers."""
    numbers = []
    for key, value in (("a", a), ("b", b)):
        if value in (None, ""):
            raise CompareError(f"{key} is required: the number of a version of this model, e.g. ?a=1&b=2")
        if not str(value).isdigit() or not 1 <= int(value) <= 10**9:
            raise CompareError(
                f"{key} must be a version number (a positive integer), not {str(value)[:40]!r}"
            )
        numbers.append(int(value))
    if numbers[0] == numbers[1]:
        raise CompareError("a and b must be two different versions")
    return numbers[0], numbers[1]


def conversion_facts(version: ModelVersion) -> dict | None:
    """The version's latest conversion job: what ran, with which options, for how long."""
    job = ConversionJob.objects.filter(version=version).order_by("-created_at", "-id").first()
    if job is None:
        return None
    duration = job.duration()
    return {
        "job": job.pk,
        "state": job.state,
        "toolchain": job.toolchain,
        "options": job.options or {},
        "command": [str(arg) for arg in job.command or []],
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "duration_seconds": round(duration.total_seconds(), 3) if duration is not None else None,
    }


def options_diff(a: dict | None, b: dict | None) -> list[dict]:
    """Conversion options key by key (keys in order), each with whether it differs."""
    left, right = (a or {}).get("options") or {}, (b or {}).get("options") or {}
    keys = sorted({*left, *right}, key=str)
    return [
        {"key": str(k), "a": left.get(k), "b": right.get(k), "changed": left.get(k) != right.get(k)}
        for k in keys
    ]


def serving_figures(version: ModelVersion, window: rollups.Window) -> dict:
    """Totals of the version's rollup rows within the window (every instance it served on)."""
    sums = ModelMetrics.objects.filter(
        version=version, bucket__gte=window.start, bucket__lt=window.end
    ).aggregate(
        success=Sum("success"),
        failure=Sum("failure"),
        request_us=Sum("request_us"),
        queue_us=Sum("queue_us"),
        weight=Sum("quantile_requests"),
        p50_w=Sum(rollups._weighted("p50_us")),
        p99_w=Sum(rollups._weighted("p99_us")),
    )
    success, failure = sums["success"] or 0, sums["failure"] or 0
    requests = success + failure
    weight = sums["weight"] or 0
    return {
        "requests": requests,
        "success": success,
        "failure": failure,
        "error_rate": rollups.ratio(failure, requests),
        "requests_per_second": round(requests / window.range.seconds, 4),
        "mean_ms": rollups.ratio(sums["request_us"] or 0, requests, 1e-3),
        "queue_ms": rollups.ratio(sums["queue_us"] or 0, requests, 1e-3),
        # Triton's latency summaries, weighted by the requests each scrape saw; None without summaries.
        "p50_ms": rollups.ratio(sums["p50_w"] or 0, weight, 1e-3) if weight else None,
        "p99_ms": rollups.ratio(sums["p99_w"] or 0, weight, 1e-3) if weight else None,
    }


def _difference(a: float | None, b: float | None) -> float | None:
    """``b`` relative to ``a`` (0.25: b is 25% higher), None when either is unknown or ``a`` is zero."""
    if a is None or b is None or not a:
        return None
    return round((b - a) / a, 4)


def compare_versions(
    model: RegisteredModel, a: int, b: int, range_key: str | None = None, now: datetime | None = None
) -> dict:
    """The comparison of versions ``a`` and ``b`` of ``model``. ``ModelVersion.DoesNotExist`` when either is
    not a version of this model (a 404); ``CompareError`` for a bad range."""
    try:
        window = rollups.Window.ending(check_range(range_key), now)
    except ValueError as exc:
        raise CompareError(str(exc)) from None
    versions = {v.number: v for v in model.versions.filter(number__in=[a, b])}
    if a not in versions or b not in versions:
        raise ModelVersion.DoesNotExist(f"{model} has no version {b if a in versions else a}")
    va, vb = versions[a], versions[b]
    conv_a, conv_b = conversion_facts(va), conversion_facts(vb)
    serve_a, serve_b = serving_figures(va, window), serving_figures(vb, window)
    return {
        "team": model.team.slug,
        "model": model.slug,
        "range": window.range.key,
        "start": window.start,
        "end": window.end,
        "a": {**comparison.file_facts(va), "conversion": conv_a, "serving": serve_a},
        "b": {**comparison.file_facts(vb), "conversion": conv_b, "serving": serve_b},
        "signature": comparison.signature_diff(va, vb),
        "config": comparison.config_diff(va, vb),
        "options": options_diff(conv_a, conv_b),
        "differences": {
            "sha256": va.sha256 != vb.sha256,
            "source_format": va.source_format != vb.source_format,
            "size_bytes": _difference(va.size_bytes, vb.size_bytes),
            "command": (conv_a or {}).get("command") != (conv_b or {}).get("command"),
            "duration": _difference(
                (conv_a or {}).get("duration_seconds"), (conv_b or {}).get("duration_seconds")
            ),
            "error_rate": _difference(serve_a["error_rate"], serve_b["error_rate"]),
            "p50_ms": _difference(serve_a["p50_ms"], serve_b["p50_ms"]),
            "p99_ms": _difference(serve_a["p99_ms"], serve_b["p99_ms"]),
        },
    }
