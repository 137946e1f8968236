"""Tuning jobs on this host (runs inside the host agent): each job the desired state lists measures its
version's candidate configs on one instance's tritonserver under a scratch name (``backend_ge.tuning.tune``
with ``backend_ge.tuning_measure.TritonMeasure``), and reports every point over the agent API
(``hostagent.tuning_protocol``).

A job never touches a served model: its files are materialized under ``<model>__tuning-<id>`` (kept by
reconcile while the job runs, ``hostagent.placement.reconcile_instance``), loaded and unloaded by that name
only, and removed when it ends, whatever the ending. The whole run - download, loads, measurements, unload -
fits the job's time budget: the search gets what the download left, less the time to clean up.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field

from backend_ge import config as ge_config
from backend_ge.errors import public_error
from backend_ge.tuning import Candidate, Limits, Objective, Point, tune
from backend_ge.tuning_measure import TritonMeasure
from hostagent.client import PlatformError, TuningSpec
from hostagent.instances import InstanceProcess
from hostagent.placement import AgentState, _materialize
from hostagent.repository import remove_model
from hostagent.tuning_protocol import MAX_POINTS_PER_REPORT, TuningEvent

log = logging.getLogger(__name__)

REPORT_EVERY_S = 2.0  # points are sent in batches at most this often (and at the end)
CLEANUP_S = 10.0  # kept from the search's budget for unloading and removing the scratch replica
MAX_LOG_LINES = 400
FINISHED_KEPT = 256  # jobs this agent ended, not started again while the platform still lists them
PER_REPORT = MAX_POINTS_PER_REPORT


@dataclass
class _Reporter:
    """Batches a run's points and log lines into reports; an answer that is not accepted (the job ended on
    the platform: cancelled, timed out) or that asks to cancel sets ``cancel``."""

    agent: AgentState
    job_id: int
    cancel: threading.Event
    started: float = field(default_factory=time.monotonic)
    points: list[dict] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    sent_at: float = 0.0
    logged: int = 0

    def line(self, text: str) -> None:
        if self.logged < MAX_LOG_LINES:
            self.lines.append(text)
            self.logged += 1

    def point(self, point: Point) -> None:
        self.points.append({**point.as_dict(), "at_s": round(time.monotonic() - self.started, 2)})
        if time.monotonic() - self.sent_at >= REPORT_EVERY_S:
            self.send(TuningEvent.POINTS)

    def send(self, event: TuningEvent, **fields) -> bool:
        body = {
            "event": event.value,
            "points": self.points[:PER_REPORT],
            "log": "\n".join(self.lines),
            **fields,
        }
        try:
            accepted, cancel = self.agent.client.report_tuning(self.job_id, body)
        except PlatformError as exc:
            log.warning("tuning %s: report not sent (kept for the next): %s", self.job_id, exc)
            return True
        del self.points[:PER_REPORT]
        self.lines.clear()
        self.sent_at = time.monotonic()
        if cancel or not accepted:
            self.cancel.set()
        return accepted


def run_tuning(agent: AgentState, spec: TuningSpec, proc: InstanceProcess, cancel: threading.Event) -> None:
    """One job from start to cleanup; every outcome is reported (a failure with Triton's own words)."""
    reporter = _Reporter(agent, spec.pk, cancel)
    name, measure = spec.scratch_name, None
    deadline = reporter.started + spec.budget_s - CLEANUP_S
    try:
        _materialize(agent, proc, name, [spec.version])
        base = ge_config.parse_config((proc.repository / name / "config.pbtxt").read_text())
        if not reporter.send(TuningEvent.STARTED) or cancel.is_set():
            return
        measure = TritonMeasure(proc.server, name, base)
        limits = Limits(base.max_batch_size, gears=spec.gears, max_instances=spec.max_instances)
        reporter.line(f"measuring {spec.version} on instance {proc.instance_id} as {name}")
        result = tune(
            measure,
            Candidate.from_config(base),
            limits,
            Objective(spec.p99_ms, spec.rate_rps),
            budget_s=max(0.001, deadline - time.monotonic()),
            max_candidates=spec.max_candidates,
            log=reporter.line,
            on_point=reporter.point,
            cancelled=lambda: cancel.is_set() or not proc.running(),
        )
        if not proc.running():
            raise RuntimeError(f"instance {proc.instance_id}'s server stopped during the tuning")
        for _ in range(len(reporter.points) // PER_REPORT + 1):  # bounded: a platform that does not answer
            if len(reporter.points) <= PER_REPORT:
                break
            reporter.send(TuningEvent.POINTS)
        reporter.send(TuningEvent.FINISHED, stopped=result.stopped, wall_s=round(result.wall_s, 2))
    except Exception as exc:
        log.warning("tuning %s failed: %s", spec.pk, exc)
        with contextlib.suppress(Exception):
            reporter.send(TuningEvent.FAILED, error=public_error(str(exc)) or exc.__class__.__name__)
    finally:
        if measure is not None:
            with contextlib.suppress(Exception):
                measure.close()
        remove_model(proc.repository, name)


@dataclass
class _Run:
    spec: TuningSpec
    instance_id: int
    thread: threading.Thread
    cancel: threading.Event


class TuningRunner:
    """Starts a thread per tuning job of the desired state (one per instance at a time: a second would
    measure the first's load), cancels those no longer wanted. ``sync`` after each desired state."""

    def __init__(self, agent: AgentState, processes: dict[int, InstanceProcess]) -> None:
        self.agent = agent
        self.processes = processes
        self._runs: dict[int, _Run] = {}
        self._finished: dict[int, None] = {}
        self._lock = threading.Lock()

    def sync(self) -> None:
        wanted = {t.pk: t for t in self.agent.desired.all_tunings()}
        with self._lock:
            for pk, run in list(self._runs.items()):
                if not run.thread.is_alive():
                    del self._runs[pk]
                    self._finished[pk] = None
                    while len(self._finished) > FINISHED_KEPT:
                        del self._finished[next(iter(self._finished))]
                elif pk not in wanted or wanted[pk].cancel:
                    run.cancel.set()
            busy = {run.instance_id for run in self._runs.values()}
            for pk, spec in wanted.items():
                if pk in self._runs or pk in self._finished or spec.cancel or spec.instance_id in busy:
                    continue
                proc = self.processes.get(spec.instance_id)
                if proc is None or not proc.running():
                    continue  # the platform times the job out if its instance never comes back
                cancel = threading.Event()
                thread = threading.Thread(
                    target=run_tuning,
                    args=(self.agent, spec, proc, cancel),
                    name=f"tuning-{pk}",
                    daemon=True,
                )
                self._runs[pk] = _Run(spec, spec.instance_id, thread, cancel)
                busy.add(spec.instance_id)
                thread.start()

    def names_on(self, instance_id: int) -> set[str]:
        """The scratch names in use on an instance: reconcile keeps them."""
        with self._lock:
            running = {r.spec.scratch_name for r in self._runs.values() if r.instance_id == instance_id}
        return running | {t.scratch_name for t in self.agent.desired.tunings_on(instance_id)}

    def stop(self, timeout: float = 30.0) -> None:
        with self._lock:
            runs = list(self._runs.values())
        for run in runs:
            run.cancel.set()
        for run in runs:
            run.thread.join(timeout)
