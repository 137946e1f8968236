"""Loads in parallel on one instance (``hostagent.placement.run_per_model``): bounded by ``--parallel-loads``,
unloads in a lane of their own, never two jobs of one model at once (nor out of order), an ensemble after the
models it chains, a decision made meanwhile started when a slot frees, nothing new after the deadline or once
the server died unless the pass is extended; the check a pass runs beside its jobs leaves their models alone
(``hostagent.placement._check``); and which loads overlapped (``hostagent.instances.LoadOverlap``) for the
footprint meters. Threads and clocks only: the live tests
(tests/fleet/test_agent.py, tests/fleet/test_serving_truth.py) run it against tritonserver."""

from __future__ import annotations

import contextlib
import threading
import time
from types import SimpleNamespace

import pytest

from hostagent.client import DesiredState
from hostagent.config import AgentConfig, ConfigError, load
from hostagent.instances import LoadOverlap
from hostagent.placement import ModelJob, _check, _reload_if_current, run_per_model


class Recorder:
    """Jobs that sleep and record which ran at the same time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: list[str] = []
        self.peak = 0
        self.overlaps: list[tuple[str, str]] = []
        self.order: list[str] = []

    def job(self, key: str, model: str, seconds: float = 0.15, after=(), unload: bool = False) -> ModelJob:
        def run() -> None:
            with self.lock:
                self.overlaps += [(other, key) for other in self.running]
                self.running.append(key)
                self.peak = max(self.peak, len(self.running))
            time.sleep(seconds)
            with self.lock:
                self.running.remove(key)
                self.order.append(key)

        return ModelJob(key=(key,), model=model, run=run, after=frozenset(after), unload=unload)


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


def test_unloads_have_their_own_lane_and_never_take_a_loads_slot():
    rec = Recorder()
    jobs = [
        rec.job("unload-a", "team__a", 0.3, unload=True),
        rec.job("unload-b", "team__b", 0.05, unload=True),
        rec.job("load-c", "team__c", 0.05),
        rec.job("load-d", "team__d", 0.05),
    ]
    run_per_model(agent_with(1), live_proc(), lambda: jobs)
    # One of each lane at a time: the loads ran beside the long unload, never beside each other.
    assert ("unload-a", "load-c") in rec.overlaps and ("unload-a", "load-d") in rec.overlaps
    assert ("unload-a", "unload-b") not in rec.overlaps and ("load-c", "load-d") not in rec.overlaps
    assert rec.order == ["load-c", "load-d", "unload-a", "unload-b"]


def test_a_model_whose_unload_waits_for_its_lane_loads_after_it_not_before():
    rec = Recorder()
    jobs = [
        rec.job("unload-busy", "team__busy", 0.2, unload=True),
        rec.job("unload-same", "team__same", 0.02, unload=True),
        rec.job("load-same", "team__same", 0.02),
    ]
    run_per_model(agent_with(1), live_proc(), lambda: jobs)
    # The load lane was free all along, but the same model's unload came first and waited for its lane.
    assert rec.order.index("unload-same") < rec.order.index("load-same")
    assert ("unload-same", "load-same") not in rec.overlaps


def test_an_extended_pass_goes_on_starting_jobs_past_its_deadline():
    rec = Recorder()
    jobs = [rec.job("long", "team__long", 0.6)]
    asked: list[frozenset] = []
    started = time.monotonic()

    def listing():
        if time.monotonic() - started > 0.15 and len(jobs) == 1:
            jobs.append(rec.job("late", "team__late", 0.02))
        return list(jobs)

    def extend(busy):
        asked.append(busy)
        return time.monotonic() + 0.3 if len(asked) == 1 else None

    assert run_per_model(agent_with(2), live_proc(), listing, until=started + 0.1, extend=extend) == 2
    # Asked at the first deadline with the running job's model, the late job started before "long" ended.
    assert asked[0] == frozenset({"team__long"}) and rec.order == ["late", "long"]
    assert len(asked) == 2  # the second deadline ended the pass

    # Not extended: a job listed after the deadline does not start.
    rec, started = Recorder(), time.monotonic()
    jobs = [rec.job("long", "team__long", 0.4)]
    assert run_per_model(agent_with(2), live_proc(), listing, until=started + 0.1, extend=lambda _: None) == 1
    assert rec.order == ["long"]


VERSION = {"id": 7, "number": 1, "label": "M v1", "model_name": "t__m", "config_text": "", "signature": {},
           "instance_limit": 1, "files": []}  # fmt: skip


def placement(**fields) -> dict:
    entry = {"id": 1, "instance": 3, "label": "h/cpu-0", "deployment": 5, "model_name": "t__m", "generation": 2,
             "applied_generation": 2, "state": "READY", "undeploy": False, "target": 7, "active": 7,
             "target_version": 7, "canary_target": None, "served": 7, "canary": None, "keep_model": False}  # fmt: skip
    return entry | fields


class FakeServer:
    def __init__(self, index: list[dict]) -> None:
        self.index, self.unloaded = index, []

    def repository_index(self) -> list[dict]:
        return self.index

    def unload_model(self, name: str) -> None:
        self.unloaded.append(name)


def checked(tmp_path, index, busy, *placements):
    desired = DesiredState()
    desired.replace(
        {"generation": 4, "instances": [], "placements": list(placements), "versions": {"7": VERSION}}
    )
    for name in {entry["name"] for entry in index}:
        (tmp_path / name).mkdir(exist_ok=True)
    reports = SimpleNamespace(loaded=[], placement_loaded=lambda pk, *a, **k: reports.loaded.append(pk))
    agent = SimpleNamespace(desired=desired, reports=reports, failed_loads={})
    proc = SimpleNamespace(instance_id=3, server=FakeServer(index), repository=tmp_path, running=lambda: True)
    reloads = _check(agent, SimpleNamespace(pk=3), proc, frozenset(busy))
    return agent, proc, reloads


def test_the_check_beside_running_jobs_leaves_their_models_alone(tmp_path):
    index = [
        {"name": "t__m", "version": "1", "state": "READY"},
        {"name": "t__gone", "version": "1", "state": "READY"},
    ]
    _, proc, reloads = checked(tmp_path, index, {"t__gone"}, placement())
    assert proc.server.unloaded == [] and (tmp_path / "t__gone").is_dir() and reloads == []
    # Without a job of its own, a model no placement wants is unloaded and its files removed.
    _, proc, _ = checked(tmp_path, index, set(), placement())
    assert proc.server.unloaded == ["t__gone"] and not (tmp_path / "t__gone").exists()
    assert (tmp_path / "t__m").is_dir()
    # A served model whose job runs is not reported nor reloaded from a reading taken mid-job.
    agent, _, reloads = checked(tmp_path, [], {"t__m"}, placement(state="LOADING"))
    assert reloads == [] and agent.reports.loaded == []


def test_a_reload_found_missing_is_dropped_when_a_decision_came_since(tmp_path, monkeypatch):
    agent, proc, reloads = checked(tmp_path, [], set(), placement())
    assert [job.key for job in reloads] == [("reload", 1, 2)]
    verified = []
    monkeypatch.setattr("hostagent.placement._verify", lambda *args: verified.append(args[3]))
    found = agent.desired.placement(1)
    agent.desired.replace({"generation": 5, "instances": [], "versions": {"7": VERSION},
                           "placements": [placement(generation=3, undeploy=True)]})  # fmt: skip
    _reload_if_current(agent, proc, found, "t__m", None)
    assert verified == []
    agent.desired.replace(
        {"generation": 6, "instances": [], "versions": {"7": VERSION}, "placements": [placement()]}
    )
    _reload_if_current(agent, proc, found, "t__m", None)
    assert verified == ["t__m"]


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


def instance_entry(pk: int, **fields) -> dict:
    entry = {"id": pk, "name": f"cpu-{pk}", "label": f"h/cpu-{pk}", "http_port": 9000 + pk, "grpc_port": 9100 + pk,
             "metrics_port": 9200 + pk, "device_ids": [], "executor": "cpu", "latency_summaries": False,
             "desired_state": "RUNNING", "state": "READY", "restarts": 0, "crash_times": [], "pid": None,
             "command": "", "command_seq": 0, "api_key": "k"}  # fmt: skip
    return entry | fields


def test_a_pass_holds_its_instance_only_while_nothing_else_waits_for_it(tmp_path, monkeypatch):
    from hostagent import supervisor

    agent = supervisor.HostAgent(
        SimpleNamespace(),
        "h",
        AgentConfig(platform="http://127.0.0.1:1", root=tmp_path, reconcile_interval_ms=100),
    )

    def desired(*placements, **fields):
        agent.desired.replace({"generation": 4, "versions": {"7": VERSION}, "placements": list(placements),
                               "instances": [instance_entry(3, **fields), instance_entry(4)]})  # fmt: skip

    desired(placement(generation=3))  # a decision waits on instance 3 only
    procs = {pk: agent.process_for(agent.desired.instance(pk)) for pk in (3, 4)}
    for proc in procs.values():
        monkeypatch.setattr(proc, "running", lambda: True)
    hold = agent._holder(3, procs[3])
    assert hold()
    desired(placement(generation=3), placement(id=2, instance=4, generation=3))
    assert not hold()  # instance 4 has a decision waiting: the pass goes over to it
    desired(placement(generation=3), command="restart", command_seq=1)
    assert not hold()  # a new command waits for the instance's lock
    desired(placement(generation=3), desired_state="STOPPED")
    assert not hold()
    desired(placement(generation=3))
    assert hold()
    monkeypatch.setattr(supervisor, "HOLD_INTERVALS", 0)
    assert not agent._holder(3, procs[3])()  # bounded: tuning jobs start between passes
    agent._stop.set()
    assert not hold()


def test_an_unload_beside_a_metered_load_means_the_load_did_not_run_alone(tmp_path, monkeypatch):
    from hostagent import placement as placing

    monkeypatch.setattr(placing, "final_counts_reported", lambda *args: contextlib.nullcontext())
    server = SimpleNamespace(
        is_model_ready=lambda name: True, unload_model=lambda name: None, repository_index=lambda: []
    )
    proc = SimpleNamespace(instance_id=3, server=server, repository=tmp_path, loads=LoadOverlap())
    unloaded = []
    agent = SimpleNamespace(
        reports=SimpleNamespace(placement_unloaded=lambda *args: unloaded.append(args[0]))
    )
    spec = SimpleNamespace(pk=1, generation=2, instance="h/cpu-3", keep_model=False)
    mark = proc.loads.mark()
    with proc.loads.loading():  # the metered load
        placing._undeploy(agent, proc, spec, "t__old")
    assert unloaded == [1] and not proc.loads.alone_since(mark)
