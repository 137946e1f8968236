"""The reference a bounded tuning search is judged by (``backend_ge.tuning``): the whole space the search
could reach, measured candidate by candidate (Model Analyzer's brute mode). ``benchmarks/tuning.py --brute``
runs it; nothing in the platform does - it costs many times the search's time."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from backend_ge.tuning import QUEUE_DELAYS_US, SATURATED, Candidate, Limits, Objective, Point, Result


def grid(base: Candidate, limits: Limits, delays: Sequence[int] = QUEUE_DELAYS_US) -> list[Candidate]:
    """Every candidate the search could reach from ``base`` (the brute-force space it is compared with):
    batching off, or on with each max batch size, queue delay, preferred size (none or the one the search
    tries) and instance count."""
    out: list[Candidate] = []
    for n in limits.instance_counts():
        out.append(
            dataclasses.replace(
                base, dynamic_batching=False, max_queue_delay_us=0, preferred=(), instance_count=n
            )
        )
        if limits.max_batch_size <= 0:
            continue
        for b in limits.batch_sizes():
            sizes = [s for s in limits.batch_sizes() if 1 < s <= b]
            preferred_options = [()] + ([(sizes[-2] if len(sizes) > 1 else sizes[-1],)] if sizes else [])
            for d in delays:
                for preferred in preferred_options:
                    out.append(Candidate(True, b, d, preferred, n))
    return list(dict.fromkeys(out))


def brute_force(
    measure: Callable[[Candidate, int], Point],
    candidates: Sequence[Candidate],
    limits: Limits,
    objective: Objective,
    *,
    budget_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> Result:
    """Measure every candidate (each swept like the search's) - the reference a bounded search is judged by."""
    started = clock()
    result = Result(objective=objective, default=candidates[0])
    for candidate in candidates:
        best = 0.0
        for concurrency in limits.concurrencies:
            if clock() - started >= budget_s:
                result.stopped = "budget"
                break
            point = measure(candidate, concurrency)
            result.points.append(point)
            if (
                point.errors
                or point.p99_ms > objective.p99_ms
                or (best and point.throughput_rps < best * SATURATED)
            ):
                break
            best = max(best, point.throughput_rps)
        if result.stopped != "done":
            break
    met = [(result.score(c), c) for c in result.candidates() if result.score(c) is not None]
    result.recommended = max(met, key=lambda sc: sc[0])[1] if met else None
    result.wall_s = clock() - started
    return result
