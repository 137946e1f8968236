"""The figures a rollout check judges, from two readings of the instances' metrics: deltas per server process,
the GE backend's failures, per-version quantiles merged across instances, and the gates."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from apps.deployments.analysis import InstanceReading, baseline_of, failed_gates, window_figures
from backend_ge.triton_metrics import Reading, parse_metrics

NAME = "vision__scaler"
VERSIONS = {"stable": 1, "canary": 2}


def reading(instance_id: int, server: str, series: dict, quantiles: dict | None = None) -> InstanceReading:
    counters = {(NAME, str(v)): values for v, values in series.items()}
    counters[("other__model", "1")] = {"success": 999.0}  # another model on the instance is not counted
    return InstanceReading(
        instance_id,
        server,
        Reading(counters=counters, quantiles={(NAME, str(v)): q for v, q in (quantiles or {}).items()}),
    )


def test_the_window_counts_the_traffic_since_the_baseline_per_version():
    before = [
        reading(1, "100", {1: {"success": 1000, "request_us": 1e6, "queue_us": 1e5}, 2: {"success": 1}})
    ]
    after = [
        reading(
            1, "100",
            {1: {"success": 1900, "request_us": 1.9e6, "queue_us": 1.9e5},
             2: {"success": 101, "failure:BACKEND": 5, "gefail:BACKEND": 20, "request_us": 3e5, "queue_us": 2e4}},
            {1: {"request_p50": 900, "request_p99": 2500}, 2: {"request_p50": 1500, "request_p99": 4000, "queue_p99": 300}},
        )
    ]  # fmt: skip
    figures = window_figures(after, baseline_of(before, NAME), NAME, VERSIONS, seconds=10)
    stable, canary = figures["stable"], figures["canary"]
    assert stable["requests"] == 900 and stable["failures"] == 0 and stable["success_rate"] == 1.0
    assert stable["requests_per_s"] == 90 and stable["mean_ms"] == pytest.approx(1.0)
    assert stable["p50_ms"] == 0.9 and stable["p99_ms"] == 2.5
    # 100 Triton successes of which the GE backend answered 20 with an error, plus 5 Triton failures.
    assert canary["requests"] == 105 and canary["failures"] == 25
    assert canary["success_rate"] == pytest.approx(80 / 105)
    assert canary["p99_ms"] == 4.0 and canary["queue_p99_ms"] == 0.3
    assert canary["queue_ms"] == pytest.approx(2e4 / 105 / 1000)


def test_a_restarted_server_counts_from_zero_and_quantiles_merge_weighted_by_requests():
    before = [
        reading(1, "100", {1: {"success": 5000}, 2: {"success": 400}}),
        reading(2, "200", {1: {"success": 5000}, 2: {"success": 400}}),
    ]
    after = [
        reading(1, "101", {1: {"success": 30}, 2: {"success": 10}}, {2: {"request_p99": 1000}}),  # restarted
        reading(2, "200", {1: {"success": 5100}, 2: {"success": 430}}, {2: {"request_p99": 5000}}),
    ]
    figures = window_figures(after, baseline_of(before, NAME), NAME, VERSIONS, seconds=2)
    assert figures["stable"]["requests"] == 130 and figures["canary"]["requests"] == 40
    # (1 ms x 10 + 5 ms x 30) / 40
    assert figures["canary"]["p99_ms"] == pytest.approx(4.0)


def test_an_instance_without_a_baseline_counts_the_canary_since_it_loaded():
    after = [reading(3, "300", {2: {"success": 12}})]
    assert window_figures(after, {}, NAME, VERSIONS, seconds=2)["canary"]["requests"] == 12


def test_an_unreadable_instance_counts_nothing_and_no_traffic_has_no_rates():
    figures = window_figures([InstanceReading(1, "100", None, "URLError")], {}, NAME, VERSIONS, seconds=2)
    assert figures["canary"] == {
        "version": 2, "requests": 0, "failures": 0, "client_errors": 0, "success_rate": None, "requests_per_s": 0.0, "mean_ms": None,
        "p50_ms": None, "p99_ms": None, "queue_ms": None, "queue_p99_ms": None,
    }  # fmt: skip


def test_triton_summaries_parse_into_the_figures():
    text = (
        "# TYPE nv_inference_request_success counter\n"
        f'nv_inference_request_success{{model="{NAME}",version="2"}} 50\n'
        "# TYPE nv_inference_request_summary_us summary\n"
        f'nv_inference_request_summary_us{{model="{NAME}",version="2",quantile="0.5"}} 700\n'
        f'nv_inference_request_summary_us{{model="{NAME}",version="2",quantile="0.99"}} 1900\n'
        f'nv_inference_request_summary_us_count{{model="{NAME}",version="2"}} 50\n'
        f'nv_inference_request_summary_us_sum{{model="{NAME}",version="2"}} 40000\n'
    )
    figures = window_figures([InstanceReading(1, "1", parse_metrics(text))], {}, NAME, VERSIONS, seconds=5)
    assert figures["canary"]["p50_ms"] == 0.7 and figures["canary"]["p99_ms"] == 1.9


def gates(**limits):
    base = {"min_success_rate": 0.99, "max_p99_ms": None, "max_p99_ratio": None}
    return SimpleNamespace(**(base | limits))


def test_each_gate_reports_its_value_and_limit():
    canary, stable = {"success_rate": 0.98, "p99_ms": 30.0}, {"p99_ms": 10.0}
    assert failed_gates(gates(), {"success_rate": 0.995, "p99_ms": 30.0}, stable) == []
    assert failed_gates(gates(), canary, stable) == [{"gate": "success_rate", "value": 0.98, "limit": 0.99}]
    assert failed_gates(gates(min_success_rate=0.9, max_p99_ms=20), canary, stable) == [
        {"gate": "p99_ms", "value": 30.0, "limit": 20}
    ]
    assert failed_gates(gates(min_success_rate=0.9, max_p99_ratio=2), canary, stable) == [
        {"gate": "p99_ratio", "value": 3.0, "limit": 2, "canary_p99_ms": 30.0, "stable_p99_ms": 10.0}
    ]
    # No stable traffic in the window (the canary at 100 %): the ratio cannot be judged and is not failed.
    assert failed_gates(gates(min_success_rate=0.9, max_p99_ratio=2), canary, {"p99_ms": None}) == []
    # An absolute p99 gate without a measured p99 fails: it never passes blind.
    assert failed_gates(
        gates(min_success_rate=0.9, max_p99_ms=20), {"success_rate": 1.0, "p99_ms": None}, stable
    )


def canary_window(success: int, invalid: int, backend: int) -> dict:
    """The canary's figures over one window: Triton's successes, of which the GE backend answered ``invalid``
    as INVALID_ARG (a 400: the caller's error) and ``backend`` as failed (a 500)."""
    before = [reading(1, "100", {2: {"success": 0}})]
    after = [
        reading(
            1, "100", {2: {"success": success, "gefail:INVALID_REQUEST": invalid, "gefail:BACKEND": backend}}
        )
    ]
    return window_figures(after, baseline_of(before, NAME), NAME, VERSIONS, seconds=10)["canary"]


def test_a_flood_of_bad_requests_does_not_fail_the_canary():
    canary = canary_window(success=10_100, invalid=10_000, backend=0)
    assert (canary["requests"], canary["failures"], canary["client_errors"]) == (100, 0, 10_000)
    assert canary["success_rate"] == 1.0
    assert failed_gates(gates(), canary, {"p99_ms": None}) == []


def test_server_failures_fail_the_canary_whatever_bad_requests_come_beside_them():
    canary = canary_window(success=10_100, invalid=10_000, backend=5)
    # 95 of the 100 requests the model took succeeded: bad requests neither hide nor dilute the failures.
    assert (canary["requests"], canary["failures"], canary["client_errors"]) == (100, 5, 10_000)
    assert failed_gates(gates(), canary, {"p99_ms": None}) == [
        {"gate": "success_rate", "value": 0.95, "limit": 0.99}
    ]
