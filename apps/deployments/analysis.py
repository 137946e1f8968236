"""The figures a rollout check judges: per version, over the window since the last judged check.

Read at check time straight from the instances that serve both versions (their metrics port, no key needed):
cumulative counters give requests, server failures, client errors and time spent (deltas against the readings kept on the rollout,
per server process, so a restart or a reload never counts twice or goes negative), and Triton's latency
summaries (``--metrics-config=summary_latencies=true``, an instance's ``latency_summaries``) give real
per-version p50/p99 of request and queue time. Triton computes those quantiles over a sliding window (the
last minute), not exactly over the check's window; instances merge weighted by their requests.

Gates judge server failures only: a request the model refused as not fitting it (a client error, 400 - see
``backend_ge.triton_metrics.CLIENT_ERROR_REASONS``) is shown beside them, in neither ``requests`` nor
``success_rate``, so a flood of bad requests can neither fail a canary nor hide its failures. (Triton's own
request checks - malformed JSON, shapes, data types, batch size - are counted in none of its metrics.)

The text parser is ``backend_ge.triton_metrics``: pure functions without Django, shared with the scraper.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from django.conf import settings

from apps.fleet.models import TritonInstance
from backend_ge import triton_metrics


@dataclass
class VersionFigures:
    """One version's traffic over a window (times in ms; None when nothing was measured). ``requests`` are the
    requests the model took (successes and server failures); ``client_errors`` the ones it refused."""

    version: int
    requests: int = 0
    failures: int = 0
    client_errors: int = 0
    success_rate: float | None = None
    requests_per_s: float = 0.0
    mean_ms: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    queue_ms: float | None = None
    queue_p99_ms: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class InstanceReading:
    instance_id: int
    server_id: str
    reading: triton_metrics.Reading | None = None
    error: str = ""


def _read(instance: TritonInstance) -> InstanceReading:
    result = InstanceReading(instance.pk, str(instance.pid or ""))
    try:
        with urllib.request.urlopen(
            instance.metrics_url(), timeout=settings.METRICS_SCRAPE_TIMEOUT
        ) as answer:
            result.reading = triton_metrics.parse_metrics(answer.read().decode("utf-8", errors="replace"))
    except (OSError, urllib.error.URLError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def read_instances(instances: Iterable[TritonInstance]) -> list[InstanceReading]:
    """Read every instance's metrics at once (one thread each; no database access)."""
    instances = list(instances)
    if not instances:
        return []
    with ThreadPoolExecutor(max_workers=min(8, len(instances))) as pool:
        return list(pool.map(_read, instances))


def _own_counters(reading: triton_metrics.Reading, name: str) -> dict:
    return {key: values for key, values in reading.counters.items() if key[0] == name}


def baseline_of(readings: list[InstanceReading], name: str) -> dict:
    """What the next window is measured against: per instance, its server process and counters."""
    return {
        str(item.instance_id): {
            "server": item.server_id,
            "counters": triton_metrics.flatten(_own_counters(item.reading, name)),
        }
        for item in readings
        if item.reading is not None
    }


def window_figures(
    readings: list[InstanceReading],
    baseline: Mapping[str, Mapping],
    name: str,
    versions: Mapping[str, int],
    seconds: float,
) -> dict[str, dict]:
    """``{"stable": {...}, "canary": {...}}`` over the window that started at ``baseline``.

    An instance without a baseline (it joined, or the platform lost it) counts its counters from zero: the
    canary's counters start when it is loaded, so its whole traffic is the window's."""
    totals = {role: VersionFigures(version=number) for role, number in versions.items()}
    request_us = {role: 0.0 for role in versions}
    queue_us = {role: 0.0 for role in versions}
    weighted = {role: {"request_p50": [], "request_p99": [], "queue_p99": []} for role in versions}
    for item in readings:
        if item.reading is None:
            continue
        before = baseline.get(str(item.instance_id))
        previous = (
            triton_metrics.Baseline(before["server"], before["counters"])
            if before
            else triton_metrics.Baseline(None, {})
        )
        deltas = triton_metrics.counter_deltas(previous, item.server_id, _own_counters(item.reading, name))
        triton_metrics.settle_backend_failures(deltas, {})
        for role, number in versions.items():
            values = deltas.get((name, str(number)), {})
            failed = sum(triton_metrics.failures(values).values())
            succeeded = values.get("success", 0.0)
            count = succeeded + failed
            figures = totals[role]
            figures.requests += int(round(count))
            figures.failures += int(round(failed))
            figures.client_errors += int(round(triton_metrics.client_errors(values)))
            request_us[role] += values.get("request_us", 0.0)
            queue_us[role] += values.get("queue_us", 0.0)
            quantiles = item.reading.quantiles.get((name, str(number)), {})
            for key, samples in weighted[role].items():
                if key in quantiles and count > 0:
                    samples.append((quantiles[key], count))
    for role, figures in totals.items():
        if figures.requests:
            figures.success_rate = (figures.requests - figures.failures) / figures.requests
            figures.mean_ms = request_us[role] / figures.requests / 1000
            figures.queue_ms = queue_us[role] / figures.requests / 1000
        figures.requests_per_s = figures.requests / seconds if seconds > 0 else 0.0
        figures.p50_ms = _merge(weighted[role]["request_p50"])
        figures.p99_ms = _merge(weighted[role]["request_p99"])
        figures.queue_p99_ms = _merge(weighted[role]["queue_p99"])
    return {role: figures.as_dict() for role, figures in totals.items()}


def _merge(samples: list[tuple[float, float]]) -> float | None:
    """Quantiles of several instances, weighted by the requests each served (in ms)."""
    weight = sum(count for _, count in samples)
    if not weight:
        return None
    return sum(value * count for value, count in samples) / weight / 1000


def failed_gates(rollout, canary: Mapping, stable: Mapping) -> list[dict]:
    """The gates the canary's figures fail, each with the figure and the limit (empty: it passes)."""
    failed = []
    rate = canary.get("success_rate")
    if rate is not None and rate < rollout.min_success_rate:
        failed.append({"gate": "success_rate", "value": round(rate, 4), "limit": rollout.min_success_rate})
    p99 = canary.get("p99_ms")
    if rollout.max_p99_ms is not None:
        if p99 is None:
            failed.append({"gate": "p99_ms", "value": None, "limit": rollout.max_p99_ms})
        elif p99 > rollout.max_p99_ms:
            failed.append({"gate": "p99_ms", "value": round(p99, 2), "limit": rollout.max_p99_ms})
    stable_p99 = stable.get("p99_ms")
    if rollout.max_p99_ratio is not None and p99 is not None and stable_p99:
        ratio = p99 / stable_p99
        if ratio > rollout.max_p99_ratio:
            failed.append(
                {
                    "gate": "p99_ratio",
                    "value": round(ratio, 2),
                    "limit": rollout.max_p99_ratio,
                    "canary_p99_ms": round(p99, 2),
                    "stable_p99_ms": round(stable_p99, 2),
                }
            )
    return failed
