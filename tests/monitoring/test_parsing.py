"""The parser and the delta rules on payloads recorded from a real tritonserver 2.51 (fixtures/capture.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apps.monitoring.models import ModelMetrics
from apps.monitoring.scraper import _add
from backend_ge import triton_metrics

FIXTURES = Path(__file__).parent / "fixtures"
MLP = ("vision__mlp", "1")
RESHAPER = ("vision__reshaper", "1")


@pytest.fixture(scope="module")
def reading() -> triton_metrics.Reading:
    result = triton_metrics.parse_metrics((FIXTURES / "triton_metrics.txt").read_text())
    return triton_metrics.parse_statistics(json.loads((FIXTURES / "triton_stats.json").read_text()), result)


def test_counters_per_model_version_from_the_recorded_metrics(reading):
    mlp = reading.counters[MLP]
    # 20 good requests; the 5 malformed ones were refused by Triton's frontend and counted nowhere.
    assert mlp["success"] == 20 and mlp["inferences"] == 20 and mlp["executions"] == 20
    assert {k: v for k, v in mlp.items() if k.startswith("failure:")} == {
        "failure:OTHER": 0,
        "failure:BACKEND": 0,
        "failure:CANCELED": 0,
        "failure:REJECTED": 0,
    }
    assert mlp["request_us"] > mlp["compute_infer_us"] > 0 and mlp["queue_us"] > 0
    assert mlp["batch:1"] == 20  # from the statistics API
    # Triton counts the GE backend's 3 error responses as successes; the backend's own counter has them.
    assert reading.counters[RESHAPER]["success"] == 7
    assert reading.counters[RESHAPER]["gefail:BACKEND"] == 3
    assert ("vision__mlp__candidate", "1") in reading.counters


def test_quantiles_and_cpu_from_the_recorded_summaries(reading):
    q = reading.quantiles[MLP]
    assert set(q) == {f"{k}_{p}" for k in ("request", "queue") for p in ("p50", "p95", "p99")}
    assert 0 < q["request_p50"] <= q["request_p95"] <= q["request_p99"]
    assert 0 < reading.cpu_utilization <= 1 and reading.cpu_memory_used_bytes > 0
    assert reading.pending[MLP] == 0


def test_without_summaries_there_are_no_quantiles():
    plain = triton_metrics.parse_metrics((FIXTURES / "triton_metrics_no_summaries.txt").read_text())
    assert plain.quantiles == {} and plain.counters[MLP]["success"] == 20


def _scaled(reading: triton_metrics.Reading, factor: float) -> dict:
    return {k: {n: v * factor for n, v in values.items()} for k, values in reading.counters.items()}


def test_first_reading_is_only_a_baseline(reading):
    assert triton_metrics.counter_deltas(None, "100", reading.counters) == {}


def test_deltas_between_two_readings_of_one_server(reading):
    before = triton_metrics.Baseline("100", triton_metrics.flatten(reading.counters))
    deltas = triton_metrics.counter_deltas(before, "100", _scaled(reading, 3))
    assert deltas[MLP]["success"] == 40 and deltas[MLP]["request_us"] == pytest.approx(
        reading.counters[MLP]["request_us"] * 2
    )
    assert "failure:BACKEND" not in deltas[MLP]  # zero deltas are left out
    assert triton_metrics.counter_deltas(before, "100", reading.counters) == {}


def test_a_restart_counts_the_new_values_even_when_they_exceed_the_old_ones(reading):
    before = triton_metrics.Baseline("100", triton_metrics.flatten(_scaled(reading, 2)))
    # Same values as before would be "nothing happened" on the same server; on a new one it is new traffic.
    deltas = triton_metrics.counter_deltas(before, "200", _scaled(reading, 3))
    assert deltas[MLP]["success"] == 60


def test_a_counter_going_down_without_a_new_pid_is_a_reset_never_negative(reading):
    before = triton_metrics.Baseline(None, triton_metrics.flatten(_scaled(reading, 5)))
    deltas = triton_metrics.counter_deltas(before, None, reading.counters)
    assert deltas[MLP]["success"] == 20  # not -80, not 100
    assert all(v > 0 for values in deltas.values() for v in values.values())


def test_a_model_loaded_since_the_last_reading_counts_from_zero(reading):
    only_mlp = {MLP: reading.counters[MLP]}
    before = triton_metrics.Baseline("100", triton_metrics.flatten(only_mlp))
    deltas = triton_metrics.counter_deltas(before, "100", reading.counters)
    assert MLP not in deltas and deltas[RESHAPER]["success"] == 7


def test_backend_failures_move_out_of_the_successes(reading):
    deltas = {RESHAPER: {"success": 7.0, "gefail:BACKEND": 3.0, "gefail:INVALID_REQUEST": 0.0}}
    owed = triton_metrics.settle_backend_failures(deltas, {})
    assert owed == {}
    assert deltas[RESHAPER]["success"] == 4 and triton_metrics.failures(deltas[RESHAPER]) == {"BACKEND": 3}
    assert triton_metrics.client_errors(deltas[RESHAPER]) == 0


def test_the_backends_invalid_requests_are_client_errors_not_failures():
    # Triton counted all 12 as successes; the GE backend answered 5 as INVALID_ARG (400) and 2 failed.
    deltas = {RESHAPER: {"success": 12.0, "gefail:INVALID_REQUEST": 5.0, "gefail:BACKEND": 2.0}}
    triton_metrics.settle_backend_failures(deltas, {})
    values = deltas[RESHAPER]
    assert values["success"] == 5
    assert triton_metrics.failures(values) == {"BACKEND": 2}  # what error rates, gates and alerts judge
    assert triton_metrics.client_errors(values) == 5

    row = ModelMetrics(failure_reasons={}, batch_executions={})
    _add(row, values, None)
    assert (row.success, row.failure, row.client_errors, row.failure_reasons) == (5, 2, 5, {"BACKEND": 2})


def test_a_failure_published_before_its_success_is_owed_not_counted_twice():
    first = {RESHAPER: {"gefail:BACKEND": 1.0}}
    owed = triton_metrics.settle_backend_failures(first, {})
    assert first[RESHAPER]["success"] == 0 and owed == {"vision__reshaper|1": 1.0}
    # The success count catches up in the next interval: it was that failure, not a success.
    second = {RESHAPER: {"success": 1.0}}
    assert triton_metrics.settle_backend_failures(second, owed) == {}
    assert second[RESHAPER]["success"] == 0
