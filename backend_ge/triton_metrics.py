"""Reading what one tritonserver reports, and turning two readings into the traffic between them.

Pure functions without Django, so the parser tests run on recorded payloads and the benchmark measures only
this work. A reading is flat: ``{(model, version): {counter: value}}`` plus a few instance-wide gauges.
The platform's scraper (``apps.monitoring``) and its rollout checks (``apps.deployments``, below monitoring)
both read Triton through it, so it lives below both, with the backend whose failure metric it reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

# Triton's cumulative per-model counters (family name as the parser reports it) -> our counter name.
COUNTER_FAMILIES = {
    "nv_inference_request_success": "success",
    "nv_inference_count": "inferences",
    "nv_inference_exec_count": "executions",
    "nv_inference_request_duration_us": "request_us",
    "nv_inference_queue_duration_us": "queue_us",
    "nv_inference_compute_input_duration_us": "compute_input_us",
    "nv_inference_compute_infer_duration_us": "compute_infer_us",
    "nv_inference_compute_output_duration_us": "compute_output_us",
}
FAILURE_FAMILY = "nv_inference_request_failure"
# Counted per reason (REJECTED, CANCELED, BACKEND, OTHER in Triton 2.51) as "failure:<REASON>".
FAILURE_PREFIX = "failure:"
# The GE backend's own count of requests it answered with an error, which Triton's python backend counts
# as successes (see backend_ge.serving.FAILURE_METRIC): "gefail:<REASON>".
GE_FAILURE_FAMILY = "ge_inference_request_failure"
GE_FAILURE_PREFIX = "gefail:"
# Reasons that are the caller's error, not the server's: the GE backend's INVALID_ARG answers (a request
# that does not fit the model, a 400). Counted apart as client errors; every other reason is a server failure,
# which error rates, rollout gates and alerts judge. (Triton's own request checks - parse errors, shape or data
# type against the config, batch size - are counted in none of its metrics; measured with Triton 2.51.)
CLIENT_ERROR_REASONS = frozenset({"INVALID_REQUEST"})
BATCH_PREFIX = "batch:"  # executions per batch size, from the statistics API
# Triton's latency summaries (only with --metrics-config=summary_latencies=true).
SUMMARY_FAMILIES = {
    "nv_inference_request_summary_us": "request",
    "nv_inference_queue_summary_us": "queue",
}
QUANTILES = {"0.5": "p50", "0.95": "p95", "0.99": "p99"}
CPU_UTILIZATION = "nv_cpu_utilization"
CPU_MEMORY_USED = "nv_cpu_memory_used_bytes"
PENDING_FAMILY = "nv_inference_pending_request_count"

SeriesKey = tuple[str, str]  # (Triton model name, version)
# A count is stored in PostgreSQL's bigint and summed in floats: anything outside 0..2**53 (NaN included) is not
# a count Triton reported but a broken or forged reading (final counts come from an inference host), refused
# with a ValueError before it reaches a row.
MAX_COUNT = float(2**53)


def _count(family: str, value: float) -> float:
    if not 0 <= value <= MAX_COUNT:
        raise ValueError(f"{family}: {value!r} is not a count from 0 to 2**53")
    return value


@dataclass
class Reading:
    """One scrape of one instance: cumulative counters and point-in-time gauges per model version."""

    counters: dict[SeriesKey, dict[str, float]] = field(default_factory=dict)
    # {(model, version): {"request_p50": us, ...}}: Triton's sliding-window quantiles, not counters.
    quantiles: dict[SeriesKey, dict[str, float]] = field(default_factory=dict)
    pending: dict[SeriesKey, float] = field(default_factory=dict)
    cpu_utilization: float | None = None
    cpu_memory_used_bytes: float | None = None


def parse_metrics(text: str, reading: Reading | None = None) -> Reading:
    """Parse Triton's Prometheus text with prometheus_client's parser (exposition format, not regexes)."""
    reading = reading or Reading()
    counters = reading.counters
    for family in text_string_to_metric_families(text):
        name = family.name
        counter = COUNTER_FAMILIES.get(name)
        if counter is not None:
            for sample in family.samples:
                # The text parser names a counter family without "_total"; Triton's samples carry none.
                key = (sample.labels.get("model", ""), sample.labels.get("version", ""))
                counters.setdefault(key, {})[counter] = _count(name, sample.value)
        elif name in (FAILURE_FAMILY, GE_FAILURE_FAMILY):
            prefix = FAILURE_PREFIX if name == FAILURE_FAMILY else GE_FAILURE_PREFIX
            for sample in family.samples:
                key = (sample.labels.get("model", ""), sample.labels.get("version", ""))
                reason = sample.labels.get("reason", "OTHER")
                counters.setdefault(key, {})[prefix + reason] = _count(name, sample.value)
        elif name in SUMMARY_FAMILIES:
            prefix = SUMMARY_FAMILIES[name]
            for sample in family.samples:
                quantile = QUANTILES.get(sample.labels.get("quantile", ""))
                if quantile is None or sample.name != name:
                    continue  # _count/_sum repeat the duration counters; other quantiles are not charted
                if sample.value != sample.value:  # NaN: no observation within the summary's window
                    continue
                key = (sample.labels.get("model", ""), sample.labels.get("version", ""))
                reading.quantiles.setdefault(key, {})[f"{prefix}_{quantile}"] = _count(name, sample.value)
        elif name == PENDING_FAMILY:
            for sample in family.samples:
                reading.pending[(sample.labels.get("model", ""), sample.labels.get("version", ""))] = _count(
                    name, sample.value
                )
        elif name == CPU_UTILIZATION and family.samples:
            reading.cpu_utilization = _count(name, family.samples[0].value)
        elif name == CPU_MEMORY_USED and family.samples:
            reading.cpu_memory_used_bytes = _count(name, family.samples[0].value)
    return reading


def parse_statistics(payload: Mapping, reading: Reading | None = None) -> Reading:
    """Add the statistics API's executions per batch size (``batch_stats``), which the metrics lack."""
    reading = reading or Reading()
    for entry in payload.get("model_stats") or []:
        key = (str(entry.get("name", "")), str(entry.get("version", "")))
        series = reading.counters.setdefault(key, {})
        for batch in entry.get("batch_stats") or []:
            count, size = (batch.get("compute_infer") or {}).get("count", 0), batch.get("batch_size")
            if isinstance(count, bool) or not isinstance(count, int | float):
                raise ValueError(f"batch_stats count {str(count)[:40]!r} is not a number")
            if isinstance(size, bool) or not isinstance(size, int) or not 0 < size < 2**31:
                raise ValueError(f"batch_size {str(size)[:40]!r} is not a batch size")
            series[f"{BATCH_PREFIX}{size}"] = float(_count("batch_stats", count))
    return reading


@dataclass(frozen=True)
class Baseline:
    """What the scraper remembers of an instance between scrapes: the server process and its counters."""

    server_id: str | None
    counters: Mapping[str, float]


def started_baseline(server_id: str | None) -> Baseline:
    """The baseline of a server process known to have started with every counter at zero - one the platform's
    agent started, read for the first time: all it counted is traffic the platform has not seen."""
    return Baseline(server_id, {})


def flatten(counters: Mapping[SeriesKey, Mapping[str, float]]) -> dict[str, float]:
    """``{"model|version|counter": value}``: a JSON-friendly form of a reading's counters."""
    return {
        f"{model}|{version}|{name}": value
        for (model, version), values in counters.items()
        for name, value in values.items()
    }


def counter_deltas(
    previous: Baseline | None, server_id: str | None, counters: Mapping[SeriesKey, Mapping[str, float]]
) -> dict[SeriesKey, dict[str, float]]:
    """The traffic since the previous reading, per model version, never negative nor counted twice.

    - No previous reading of this instance: it becomes the baseline and nothing is counted (like
      Prometheus' ``increase()``: the history before the platform watched is not this interval's). The
      caller passes ``started_baseline()`` instead for a process it knows started at zero (its own agent
      started it): then everything it counted is new.
    - Another server process than last time (a restart): every counter starts again at zero, so the new
      value is the whole traffic since the restart.
    - A counter below its previous value (the model was reloaded, or a restart the process id missed):
      the same - the new value counts, the old one is gone.
    - A counter not seen before on the same server (a model loaded since): all of it is new traffic.
    """
    deltas: dict[SeriesKey, dict[str, float]] = {}
    if previous is None:
        return deltas
    restarted = server_id is not None and previous.server_id is not None and server_id != previous.server_id
    before = previous.counters
    for (model, version), values in counters.items():
        out: dict[str, float] = {}
        prefix = f"{model}|{version}|"
        for name, value in values.items():
            old = None if restarted else before.get(prefix + name)
            delta = value if old is None or value < old else value - old
            if delta > 0:
                out[name] = delta
        if out:
            deltas[(model, version)] = out
    return deltas


def settle_backend_failures(
    deltas: dict[SeriesKey, dict[str, float]], owed: Mapping[str, float]
) -> dict[str, float]:
    """Move the GE backend's failed requests out of Triton's successes into the failures, in place.

    Triton may publish the backend's failure count a moment before the matching success count, so one
    interval can hold more backend failures than successes: the difference is owed and taken off the next
    interval's successes instead of going negative (or being counted as a success later). Returns the new
    ``{"model|version": owed}``.
    """
    still_owed: dict[str, float] = {}
    for (model, version), values in deltas.items():
        key = f"{model}|{version}"
        backend_failed = 0.0
        for name in [n for n in values if n.startswith(GE_FAILURE_PREFIX)]:
            count = values.pop(name)
            reason = FAILURE_PREFIX + name[len(GE_FAILURE_PREFIX) :]
            values[reason] = values.get(reason, 0.0) + count
            backend_failed += count
        debt = backend_failed + owed.get(key, 0.0)
        if debt:
            success = values.get("success", 0.0)
            values["success"] = max(0.0, success - debt)
            if debt > success:
                still_owed[key] = debt - success
    for key, debt in owed.items():  # owed by a series without traffic this interval
        model, _, version = key.partition("|")
        if (model, version) not in deltas:
            still_owed[key] = debt
    return still_owed


def failures(values: Mapping[str, float]) -> dict[str, float]:
    """``{reason: count}`` of one series' server failures (client errors are not among them)."""
    return {
        k[len(FAILURE_PREFIX) :]: v
        for k, v in values.items()
        if k.startswith(FAILURE_PREFIX) and k[len(FAILURE_PREFIX) :] not in CLIENT_ERROR_REASONS
    }


def client_errors(values: Mapping[str, float]) -> float:
    """Requests of one series that failed as the caller's error (``CLIENT_ERROR_REASONS``)."""
    return sum(values.get(FAILURE_PREFIX + reason, 0.0) for reason in CLIENT_ERROR_REASONS)


def batch_executions(values: Mapping[str, float]) -> dict[str, float]:
    return {k[len(BATCH_PREFIX) :]: v for k, v in values.items() if k.startswith(BATCH_PREFIX)}
