"""The agent's tuning runner without servers: a thread per job of the desired state, one per instance at a
time, a job cancelled or gone from the state is stopped, an ended one is not started again, and its scratch
name is kept from reconcile's clean-up while it runs; the protocol refuses a malformed entry or report."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

from hostagent import tuning_runner
from hostagent.client import DesiredState
from hostagent.protocol import ProtocolError
from hostagent.tuning_protocol import check_tuning_report, check_tunings

VERSION = {
    "id": 7, "number": 1, "label": "vision/mlp v1", "model_name": "vision__mlp", "config_text": "",
    "signature": {}, "instance_limit": 4, "files": [], "steps": [],
}  # fmt: skip


def entry(job_id: int, instance: int, cancel: bool = False) -> dict:
    return {
        "id": job_id, "instance": instance, "version": 7, "objective": {"p99_ms": 10.0, "rate_rps": None},
        "budget_s": 60, "max_candidates": 3, "max_instances": 1, "gears": [], "cancel": cancel,
    }  # fmt: skip


def state(*tunings: dict) -> dict:
    return {
        "generation": 1,
        "instances": [],
        "placements": [],
        "versions": {"7": VERSION},
        "tunings": list(tunings),
    }


@dataclass
class Proc:
    instance_id: int

    def running(self) -> bool:
        return True


@dataclass
class Agent:
    desired: DesiredState


@pytest.fixture
def runs(monkeypatch):
    """run_tuning replaced by a run that lasts until it is cancelled (or a test ends it)."""
    started: dict[int, threading.Event] = {}

    def fake(agent, spec, proc, cancel):
        started[spec.pk] = cancel
        cancel.wait(10)

    monkeypatch.setattr(tuning_runner, "run_tuning", fake)
    return started


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + 5
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_one_job_per_instance_cancel_and_no_second_start(runs):
    desired = DesiredState()
    runner = tuning_runner.TuningRunner(Agent(desired), {1: Proc(1), 2: Proc(2)})
    desired.replace(state(entry(10, 1), entry(11, 1), entry(12, 2)))
    runner.sync()
    wait_until(lambda: set(runs) == {10, 12}, "jobs 10 and 12 to start")  # 11 waits for instance 1
    assert runner.names_on(1) == {"vision__mlp__tuning-10", "vision__mlp__tuning-11"}

    desired.replace(state(entry(10, 1, cancel=True), entry(11, 1)))  # 10 cancelled, 12 gone
    runner.sync()
    wait_until(lambda: runs[10].is_set() and runs[12].is_set(), "both to be asked to stop")
    wait_until(lambda: (runner.sync() or True) and 11 in runs, "job 11 to start once 10 ended")
    desired.replace(state(entry(10, 1), entry(11, 1)))  # 10 listed again (its end not heard yet)
    runner.sync()
    assert list(runs) == [10, 12, 11]  # an ended job is never started twice
    runner.stop()
    assert runs[11].is_set()


def test_the_protocol_refuses_what_does_not_fit():
    with pytest.raises(ProtocolError, match="budget_s"):
        check_tunings(state({**entry(1, 1), "budget_s": 10**6}))
    with pytest.raises(ProtocolError, match="not in 'versions'"):
        check_tunings(state({**entry(1, 1), "version": 8}))
    with pytest.raises(ProtocolError, match="p99_ms"):
        check_tunings(state({**entry(1, 1), "objective": {"p99_ms": 0}}))
    assert check_tunings({"versions": {}}) == []  # a platform before tuning sends none
    with pytest.raises(ProtocolError, match="stopped"):
        check_tuning_report({"event": "finished"})
    with pytest.raises(ProtocolError, match="unknown field"):
        check_tuning_report({"event": "points", "verdict": "best"})
    with pytest.raises(ProtocolError, match="instance_count"):
        bad = {"dynamic_batching": True, "max_batch_size": 8, "max_queue_delay_us": 0, "preferred": [],
               "instance_count": 99}  # fmt: skip
        point = {"candidate": bad, "concurrency": 1, "throughput_rps": 1, "p50_ms": 1, "p99_ms": 1,
                 "avg_batch_size": 1, "queue_us": 0, "at_s": 1}  # fmt: skip
        check_tuning_report({"event": "points", "points": [point]})
