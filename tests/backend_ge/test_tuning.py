"""The tuning search: bounded, within its budget, recommending what meets the objective with the most
throughput or saying which came closest; and the real measurement of candidates on tritonserver."""

from __future__ import annotations

import dataclasses
import math
import shutil

import pytest

from backend_ge import config as ge_config
from backend_ge import tuning, tuning_measure, tuning_reference
from backend_ge.tuning import Candidate, Limits, Objective, Point, TuningError


class Server:
    """A server model with two cores: an execution of ``b`` rows takes 1 ms + 0.1 ms per row; instances run
    in parallel up to the cores; requests wait ``delay`` for a batch to form; p99 is twice the mean."""

    def __init__(self, cores: int = 2) -> None:
        self.cores = cores
        self.calls: list[tuple[Candidate, int]] = []

    def __call__(self, c: Candidate, concurrency: int) -> Point:
        self.calls.append((c, concurrency))
        parallel = min(c.instance_count, self.cores, concurrency)
        per_instance = math.ceil(concurrency / parallel)
        batch = min(per_instance, c.max_batch_size) if c.dynamic_batching else 1
        execution_ms = (
            1.0 + 0.1 * batch + (c.max_queue_delay_us / 1000 if c.dynamic_batching and batch > 1 else 0)
        )
        throughput = parallel * batch / execution_ms * 1000
        mean_ms = concurrency / throughput * 1000
        return Point(c, concurrency, throughput, mean_ms, 2 * mean_ms, avg_batch_size=batch)


BASE = Candidate(dynamic_batching=False, max_batch_size=32, instance_count=1)


def test_the_search_batches_and_adds_instances_where_they_help_within_a_bounded_number_of_candidates():
    server = Server()
    result = tuning.tune(server, BASE, Limits(32, max_instances=4), Objective(p99_ms=20), budget_s=600)
    assert result.recommended is not None and result.recommended.dynamic_batching
    assert result.recommended.instance_count == 2  # the third and fourth instance add nothing on two cores
    assert result.tuned_over_default() > 3
    # Every point measured is recorded, and the search stays a small part of the grid.
    assert len(result.points) == len(server.calls)
    assert len(result.candidates()) <= 12
    grid = 2 * len(tuning.QUEUE_DELAYS_US) * len(Limits(32).batch_sizes()) * 2 * 3
    assert len(result.candidates()) < 0.1 * grid
    assert result.stopped in ("done", "candidates")
    assert "recommended:" in result.message()


def test_each_sweep_stops_once_p99_passes_the_objective():
    server = Server()
    result = tuning.tune(server, BASE, Limits(32), Objective(p99_ms=3), budget_s=600, max_candidates=1)
    concurrencies = [c for _, c in server.calls]
    assert concurrencies[-1] < tuning.CONCURRENCIES[-1]
    assert result.points[-1].p99_ms > 3 and all(p.p99_ms <= 3 for p in result.points[:-1])


def test_no_candidate_meets_the_objective_and_the_closest_is_named():
    result = tuning.tune(Server(), BASE, Limits(32, max_instances=2), Objective(p99_ms=1), budget_s=600)
    assert result.recommended is None and result.closest is not None
    assert result.tuned_over_default() is None
    assert result.message().startswith("no candidate meets the most throughput with p99 <= 1 ms; closest:")


def test_a_rate_objective_is_met_only_by_points_that_serve_the_rate():
    objective = Objective(p99_ms=50, rate_rps=5000)
    result = tuning.tune(Server(), BASE, Limits(32, max_instances=2), objective, budget_s=600)
    assert result.recommended is not None
    assert max(p.throughput_rps for p in result.points_of(result.recommended) if objective.met_by(p)) >= 5000
    assert result.score(BASE) is None  # 1 instance without batching serves at most ~1,800 requests/s


def test_the_budget_is_never_passed_by_more_than_one_measurement():
    now = [0.0]

    def measure(c, concurrency):
        now[0] += 7.0  # each point takes 7 s
        return Server()(c, concurrency)

    result = tuning.tune(
        measure, BASE, Limits(32, max_instances=4), Objective(20), budget_s=30, clock=lambda: now[0]
    )
    assert result.stopped == "budget"
    assert len(result.points) == 5 and now[0] == 35.0
    assert result.wall_s == 35.0


def test_cancel_stops_before_the_next_point():
    calls = []
    result = tuning.tune(
        lambda c, n: calls.append(n) or Server()(c, n),
        BASE,
        Limits(32),
        Objective(20),
        budget_s=600,
        cancelled=lambda: len(calls) >= 2,
    )
    assert len(calls) == 2 and result.stopped == "cancelled"


def test_npu_candidates_use_only_the_compiled_gears_and_a_gear_between_is_suggested():
    gears = (1, 16)
    base = Candidate(dynamic_batching=True, max_batch_size=16, max_queue_delay_us=100)
    server = Server(cores=1)
    result = tuning.tune(server, base, Limits(16, gears=gears), Objective(p99_ms=100), budget_s=600)
    assert {c.max_batch_size for c, _ in server.calls} <= set(gears)
    assert all(set(c.preferred) <= set(gears) for c, _ in server.calls)
    # The sweep reaches batches of 4 and 8, which pad up to 16 on the device.
    assert result.regear and set(gears) < set(result.regear)
    assert "re-converting with gears" in result.message()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"p99_ms": 0}, "p99_ms"),
        ({"p99_ms": float("nan")}, "p99_ms"),
        ({"p99_ms": 10**6}, "p99_ms"),
        ({"p99_ms": "5"}, "p99_ms"),
        ({"p99_ms": 5, "rate_rps": 0}, "rate_rps"),
        ({"p99_ms": 5, "rate_rps": float("inf")}, "rate_rps"),
    ],
)
def test_an_objective_out_of_bounds_names_its_field(kwargs, field):
    with pytest.raises(TuningError) as caught:
        Objective(**kwargs)
    assert caught.value.field == field


def test_limits_refuse_gears_beyond_the_max_batch_size():
    with pytest.raises(TuningError, match="gears"):
        Limits(8, gears=(1, 16))


def test_a_candidate_changes_only_the_serving_settings_and_keeps_priority_levels():
    cfg = ge_config.parse_config(
        """
        name: "m" backend: "ge" max_batch_size: 8
        input [ { name: "input" data_type: TYPE_FP32 dims: [ 4 ] } ]
        output [ { name: "output" data_type: TYPE_FP32 dims: [ 4 ] } ]
        dynamic_batching { max_queue_delay_microseconds: 100 priority_levels: 2 default_priority_level: 2 }
        instance_group [ { count: 1 kind: KIND_CPU } ]
        parameters { key: "intra_op_thread_count" value { string_value: "1" } }
        """
    )
    base = Candidate.from_config(cfg)
    assert base == Candidate(True, 8, 100, (), 1)
    moved = dataclasses.replace(base, max_queue_delay_us=500, preferred=(4,), instance_count=2).apply(cfg)
    assert moved.dynamic_batching.max_queue_delay_microseconds == 500
    assert list(moved.dynamic_batching.preferred_batch_size) == [4]
    assert moved.dynamic_batching.priority_levels == 2
    assert moved.instance_group[0].count == 2 and moved.instance_group[0].kind == cfg.instance_group[0].kind
    assert moved.parameters["intra_op_thread_count"].string_value == "1"
    off = dataclasses.replace(base, dynamic_batching=False).apply(cfg)
    assert not off.HasField("dynamic_batching")
    assert Candidate.from_dict(base.as_dict()) == base


@pytest.mark.triton
def test_candidates_are_measured_on_a_real_server_under_a_scratch_name(triton, example_repository):
    scratch = "mlp_tuning_scratch"
    shutil.copytree(example_repository / "mlp", example_repository / scratch, dirs_exist_ok=True)
    cfg = ge_config.parse_config((example_repository / "mlp" / "config.pbtxt").read_text())
    measure = tuning_measure.TritonMeasure(triton, scratch, cfg, requests=60, warmup=2)
    try:
        base = Candidate.from_config(cfg)
        result = tuning.tune(
            measure,
            base,
            Limits(cfg.max_batch_size, max_instances=2, concurrencies=(1, 4)),
            Objective(p99_ms=2000),
            budget_s=120,
            max_candidates=3,
        )
        assert len(result.candidates()) == 3 and all(p.errors == 0 for p in result.points)
        assert all(p.throughput_rps > 0 and 0 < p.p50_ms <= p.p99_ms for p in result.points)
        # The scratch model serves the last candidate's config, not the version's.
        served = triton.model_config(scratch)
        last = result.points[-1].candidate
        assert served.get("max_batch_size") == last.max_batch_size
        assert sum(g.get("count", 1) for g in served["instance_group"]) == last.instance_count
        assert ("dynamic_batching" in served) == last.dynamic_batching
        assert result.recommended is not None
        assert triton.is_model_ready("mlp")  # the version itself was never touched
    finally:
        measure.close()
        shutil.rmtree(example_repository / scratch)
    assert not triton.is_model_ready(scratch)


def test_the_bounded_search_reaches_95_percent_of_the_brute_force_optimum_in_under_10_percent_of_the_space():
    limits = Limits(64, max_instances=4)
    space = tuning_reference.grid(BASE, limits)
    assert len(space) == len(set(space)) > 100
    objective = Objective(p99_ms=15)
    brute = tuning_reference.brute_force(Server(), space, limits, objective, budget_s=10**6)
    quick = tuning.tune(Server(), BASE, limits, objective, budget_s=10**6)
    assert brute.recommended is not None and quick.recommended is not None
    assert quick.score(quick.recommended) >= 0.95 * brute.score(brute.recommended)
    assert len(quick.candidates()) < 0.1 * len(space)


def test_two_settings_that_help_only_together_are_found_from_a_local_optimum():
    base = Candidate(dynamic_batching=True, max_batch_size=64, max_queue_delay_us=100, instance_count=1)

    def measure(c: Candidate, concurrency: int) -> Point:
        # Either a longer delay or a preferred size alone serves 1 % more (noise); both together 40 % more.
        gain = 1.0 + 0.01 * (c.max_queue_delay_us > 100) + 0.01 * bool(c.preferred)
        if c.max_queue_delay_us > 100 and c.preferred:
            gain = 1.4
        throughput = 1000.0 * min(concurrency, 8) * (gain if c.dynamic_batching else 0.5)
        mean_ms = concurrency / throughput * 1000
        return Point(c, concurrency, throughput, mean_ms, 2 * mean_ms)

    result = tuning.tune(measure, base, Limits(64), Objective(p99_ms=100), budget_s=600)
    assert result.recommended.max_queue_delay_us > 100 and result.recommended.preferred
    assert result.tuned_over_default() >= 1.39
