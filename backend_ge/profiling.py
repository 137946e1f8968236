"""Opt-in measurements of the serving hot path inside a python stub; off (and never imported) by default.

Set ``GE_PROFILE_DIR`` in the environment of ``tritonserver`` (the ``GE_`` prefix reaches the stubs) and
every model instance writes into that directory, once a second while it serves and when it unloads:

- ``GE_PROFILE=timing`` (the default): ``<model>-<pid>.json`` with counters - ``execute()`` calls,
  requests, and the thread CPU and wall time spent in ``execute()`` and in the executor call within it.
  Compared with the stub process's CPU from ``/proc/<pid>/stat``, it splits a request's cost between the
  python backend's own work (outside ``execute()``), this backend's Python and the model's compute.
- ``GE_PROFILE=cprofile``: ``<model>-<pid>.prof``, :mod:`cProfile` statistics of ``execute()`` (read with
  ``python -m pstats``). The profiler slows calls down: use it for where the time goes, not how much.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

PROFILE_DIR_ENV = "GE_PROFILE_DIR"
PROFILE_MODE_ENV = "GE_PROFILE"
MODES = ("timing", "cprofile")
_FLUSH_EVERY_NS = 1_000_000_000


def enabled() -> bool:
    return bool(os.environ.get(PROFILE_DIR_ENV))


class _Recorder:
    def __init__(self, directory: Path, model_name: str, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"{PROFILE_MODE_ENV}={mode!r} is not one of {', '.join(MODES)}")
        directory.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_name) or "model"
        self.path = directory / f"{safe}-{os.getpid()}.{'prof' if mode == 'cprofile' else 'json'}"
        self.mode = mode
        self.counters = {
            "calls": 0,
            "requests": 0,
            "execute_cpu_ns": 0,
            "execute_wall_ns": 0,
            "executor_cpu_ns": 0,
            "executor_wall_ns": 0,
        }
        self.profiler = None
        if mode == "cprofile":
            import cProfile

            self.profiler = cProfile.Profile()
        self._next_flush = time.perf_counter_ns() + _FLUSH_EVERY_NS

    def maybe_flush(self, now: int) -> None:
        if now >= self._next_flush:
            self._next_flush = now + _FLUSH_EVERY_NS
            self.flush()

    def flush(self) -> None:
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        if self.profiler is not None:
            self.profiler.dump_stats(tmp)
        else:
            tmp.write_text(json.dumps(self.counters))
        os.replace(tmp, self.path)  # readers never see half a file


def instrument(model, directory: str | os.PathLike, mode: str = "timing") -> Callable:
    """Wrap ``model.execute`` (and its executor call) with counters or cProfile; return the new execute.

    ``model`` is a :class:`backend_ge.serving.GeModel`; its ``_run`` is replaced so that only the
    executor's own time is counted as the model's.
    """
    recorder = _Recorder(Path(directory), model.name, mode)
    counters = recorder.counters
    thread_ns, wall_ns = time.thread_time_ns, time.perf_counter_ns
    execute = model.execute
    model.profile_recorder = recorder  # flushed by close()

    if recorder.profiler is not None:
        profiler = recorder.profiler

        def profiled_execute(requests: list) -> list:
            profiler.enable()
            try:
                return execute(requests)
            finally:
                profiler.disable()
                counters["calls"] += 1
                counters["requests"] += len(requests)
                recorder.maybe_flush(wall_ns())

        return profiled_execute

    run = model._run

    def timed_run(feeds):
        c0, w0 = thread_ns(), wall_ns()
        try:
            return run(feeds)
        finally:
            counters["executor_cpu_ns"] += thread_ns() - c0
            counters["executor_wall_ns"] += wall_ns() - w0

    model._run = timed_run

    def timed_execute(requests: list) -> list:
        c0, w0 = thread_ns(), wall_ns()
        try:
            return execute(requests)
        finally:
            w1 = wall_ns()
            counters["execute_cpu_ns"] += thread_ns() - c0
            counters["execute_wall_ns"] += w1 - w0
            counters["calls"] += 1
            counters["requests"] += len(requests)
            recorder.maybe_flush(w1)

    return timed_execute
