"""Loads in parallel on one instance (``hostagent.placement.run_per_model``): bounded by ``--parallel-loads``,
never two jobs of one model at once, an ensemble after the models it chains, a decision made meanwhile started
when a slot frees, nothing new after the deadline or once the server died; and which loads overlapped
(``hostagent.instances.LoadOverlap``) for the footprint meters. Threads and clocks only: the live tests
(tests/fleet/test_agent.py, tests/fleet/test_serving_truth.py) run it against tritonserver."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from hostagent.config import AgentConfig, ConfigError, load
from hostagent.instances import LoadOverlap
from hostagent.placement import ModelJob, run_per_model


class Recorder:
    """Jobs that sleep and record which ran at the same time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: list[str] = []
        self.peak = 0
        self.overlaps: list[tuple[str, str]] = []
        self.order: list[str] = []

    def job(self, key: str, model: str, seconds: float = 0.15, after=()) -> ModelJob:
        def run() -> None:
            with self.lock:
                self.overlaps += [(other, key) for other in self.running]
                self.running.append(key)
                self.peak = max(self.peak, len(self.running))
            time.sleep(seconds)
            with self.lock:
                self.running.remove(key)
                self.order.append(key)

        return ModelJob(key=(key,), model=model, run=run, after=frozenset(after))


def agent_with(parallel: int):
    return SimpleNamespace(config=AgentConfig(platform="http://127.0.0.1:1", parallel_loads=parallel))


def live_proc(alive=lambda: True):
    return SimpleNamespace(instance_id=7, running=alive)


def test_loads_run_in_parallel_up_to_the_limit():
    rec = Recorder()
    jobs = [rec.job(f"m{i}", f"team__m{i}") for i in range(8)]
    started = time.monotonic()
    assert run_per_model(agent_with(3), live_proc(), lambda: jobs) == 8
    elapsed = time.monotonic() - started
    assert rec.peak == 3
    assert sorted(rec.order) == sorted(f"m{i}" for i in range(8))
    # 8 jobs of 0.15 s, 3 at a time: 3 rounds, far below 8 x 0.15 s one after another.
    assert elapsed < 8 * 0.15 * 0.75


def test_one_at_a_time_is_serial():
    rec = Recorder()
    jobs = [rec.job(f"m{i}", f"team__m{i}", 0.02) for i in range(4)]
    run_per_model(agent_with(1), live_proc(), lambda: jobs)
    assert rec.peak == 1 and rec.order == ["m0", "m1", "m2", "m3"]


def test_two_jobs_of_one_model_never_overlap_and_keep_their_order():
    rec = Recorder()
    jobs = [
        rec.job("undeploy-old", "team__same"),
        rec.job("deploy-new", "team__same"),
        rec.job("x", "team__x"),
    ]
    run_per_model(agent_with(4), live_proc(), lambda: jobs)
    assert ("undeploy-old", "deploy-new") not in rec.overlaps
    assert rec.order.index("undeploy-old") < rec.order.index("deploy-new")
    assert ("undeploy-old", "x") in rec.overlaps  # another model did run beside it


def test_an_ensemble_loads_after_the_models_it_chains():
    rec = Recorder()
    jobs = [
        rec.job("pipeline", "team__pipeline", 0.02, after=("team__pre", "team__cls")),
        rec.job("pre", "team__pre"),
        rec.job("cls", "team__cls", 0.3),
    ]
    run_per_model(agent_with(4), live_proc(), lambda: jobs)
    assert rec.order[-1] == "pipeline"
    assert not [pair for pair in rec.overlaps if "pipeline" in pair]


def test_a_decision_made_meanwhile_starts_when_a_slot_frees_not_after_the_batch():
    rec = Recorder()
    jobs = [rec.job("long", "team__long", 0.8), rec.job("short", "team__short", 0.05)]
    started = time.monotonic()
    late_started: list[float] = []

    def listing():
        if time.monotonic() - started > 0.1 and len(jobs) == 2:
            late = rec.job("late", "team__late", 0.05)
            inner = late.run
            jobs.append(
                ModelJob(late.key, late.model, lambda: (late_started.append(time.monotonic()), inner()))
            )
        return list(jobs)

    run_per_model(agent_with(2), live_proc(), listing)
    assert rec.order == ["short", "late", "long"]
    assert late_started[0] - started < 0.6  # long before the 0.8 s job ended


def test_nothing_starts_after_the_deadline_or_once_the_server_died():
    rec = Recorder()
    jobs = [rec.job(f"m{i}", f"team__m{i}", 0.2) for i in range(6)]
    assert run_per_model(agent_with(2), live_proc(), lambda: jobs, until=time.monotonic() + 0.05) == 2
    assert len(rec.order) == 2  # the two started ones finished

    alive = {"yes": True}
    rec = Recorder()

    def dying():
        job = rec.job("first", "team__first", 0.1)
        return [
            ModelJob(job.key, job.model, lambda: (job.run(), alive.update(yes=False))),
            *[rec.job(f"m{i}", f"team__m{i}") for i in range(3)],
        ]

    assert run_per_model(agent_with(1), live_proc(lambda: alive["yes"]), dying) == 1


def test_an_unexpected_error_in_one_job_does_not_stop_the_others():
    rec = Recorder()

    def broken():
        raise RuntimeError("boom")

    jobs = [ModelJob(("bad",), "team__bad", broken), rec.job("ok", "team__ok", 0.01)]
    assert run_per_model(agent_with(2), live_proc(), lambda: jobs) == 2
    assert rec.order == ["ok"]


def test_overlap_tells_a_meter_whether_its_load_ran_alone():
    loads = LoadOverlap()
    mark = loads.mark()
    with loads.loading():
        pass
    assert loads.alone_since(mark)
    # Another load started during ours (and even finished before it).
    mark = loads.mark()
    with loads.loading(), loads.loading():
        pass
    assert not loads.alone_since(mark)
    # Ours started while another was running.
    outer = loads.loading()
    outer.__enter__()
    mark = loads.mark()
    with loads.loading():
        pass
    outer.__exit__(None, None, None)
    assert not loads.alone_since(mark)


def test_the_option_has_a_flag_a_variable_and_a_minimum():
    assert load(["--platform", "http://p", "--parallel-loads", "6"], {}).parallel_loads == 6
    assert load(["--platform", "http://p"], {"FLEET_PARALLEL_LOADS": "2"}).parallel_loads == 2
    assert load(["--platform", "http://p"], {}).parallel_loads == 4
    with pytest.raises(
        ConfigError, match="--parallel-loads .FLEET_PARALLEL_LOADS. = 0 is below the minimum 1"
    ):
        load(["--platform", "http://p", "--parallel-loads", "0"], {})
