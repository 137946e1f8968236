"""Tune a version's serving config on the hardware it serves on, against a latency objective.

A bounded search in the manner of Triton Model Analyzer's quick mode: start from the version's own config
(the generated default or what the tenant set), then move one setting at a time - dynamic batching off or
on, max batch size, max queue delay, preferred batch size, instance count - keeping a move only when it
serves more within the objective, until no move helps, the candidate limit is reached or the time budget
is spent. Each candidate is measured at rising concurrency (1, 2, 4, ...) until its p99 passes the objective
or its throughput stops rising; every point is recorded. The result names the config that meets the
objective with the most throughput, or says that none does and which came closest.

The search does not know how a point is measured: ``tune`` takes a ``measure(candidate, concurrency)``
callable. ``backend_ge.tuning_measure.TritonMeasure`` is the real one: it loads each candidate under a scratch model name on a
running tritonserver (Triton's load API with the candidate's config) and drives it with ``backend_ge.bench``.
On an NPU version the batch sizes a candidate may use are the compiled gears (ATC ``--dynamic_batch_size``);
when the measured batches fall between gears the result says which gear would serve them without padding.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from backend_ge.config import ModelConfig

# Bounds of an objective (the API refuses anything outside them, naming the field).
P99_MS_RANGE = (1.0, 60_000.0)
RATE_RPS_RANGE = (0.1, 1_000_000.0)

# What the search may try for a setting, in order (neighbours are one step apart).
QUEUE_DELAYS_US = (0, 100, 500, 1000, 2000, 5000, 10000)
INSTANCE_COUNTS = (1, 2, 3, 4, 6, 8)
CONCURRENCIES = (1, 2, 4, 8, 16, 32)
SATURATED = 1.05  # a concurrency step that adds less than 5 % throughput ends a candidate's sweep


class TuningError(ValueError):
    """A search that cannot start: a bad objective, limits or base config (the message names the field)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


@dataclass(frozen=True)
class Objective:
    """p99 within ``p99_ms`` at ``rate_rps`` requests per second, or - without a rate - the most throughput
    with p99 within ``p99_ms``."""

    p99_ms: float
    rate_rps: float | None = None

    def __post_init__(self) -> None:
        low, high = P99_MS_RANGE
        if not (
            isinstance(self.p99_ms, int | float) and math.isfinite(self.p99_ms) and low <= self.p99_ms <= high
        ):
            raise TuningError("p99_ms", f"must be a number of milliseconds from {low:g} to {high:g}")
        if self.rate_rps is not None:
            low, high = RATE_RPS_RANGE
            if not (
                isinstance(self.rate_rps, int | float)
                and math.isfinite(self.rate_rps)
                and low <= self.rate_rps <= high
            ):
                raise TuningError(
                    "rate_rps", f"must be requests per second from {low:g} to {high:g}, or none"
                )

    def met_by(self, point: Point) -> bool:
        if point.errors or point.p99_ms > self.p99_ms:
            return False
        return self.rate_rps is None or point.throughput_rps >= self.rate_rps

    def describe(self) -> str:
        if self.rate_rps is None:
            return f"the most throughput with p99 <= {self.p99_ms:g} ms"
        return f"p99 <= {self.p99_ms:g} ms at {self.rate_rps:g} requests/s"


@dataclass(frozen=True)
class Limits:
    """What a candidate may use: the version's max batch size, its compiled gears (an NPU version; empty on
    CPU, where any size up to the maximum runs) and the instances the pool allows per replica."""

    max_batch_size: int
    gears: tuple[int, ...] = ()
    max_instances: int = 1
    concurrencies: tuple[int, ...] = CONCURRENCIES

    def __post_init__(self) -> None:
        if self.max_batch_size < 0:
            raise TuningError("max_batch_size", "must be 0 (not batched) or more")
        if any(g < 1 or g > max(self.max_batch_size, 1) for g in self.gears):
            raise TuningError(
                "gears", f"every gear must be from 1 to the max batch size {self.max_batch_size}"
            )
        if self.max_instances < 1:
            raise TuningError("max_instances", "must be at least 1")
        if not self.concurrencies or any(c < 1 for c in self.concurrencies):
            raise TuningError("concurrencies", "must be one or more positive counts")

    def batch_sizes(self) -> tuple[int, ...]:
        """The max batch sizes a candidate may set: the gears, or powers of two up to the maximum."""
        if self.gears:
            return tuple(sorted(set(self.gears)))
        sizes, b = [], 1
        while b < self.max_batch_size:
            sizes.append(b)
            b *= 2
        return tuple(sizes + [self.max_batch_size]) if self.max_batch_size else ()

    def instance_counts(self) -> tuple[int, ...]:
        return tuple(n for n in INSTANCE_COUNTS if n <= self.max_instances) or (1,)


@dataclass(frozen=True)
class Candidate:
    """The serving settings a candidate changes; everything else in the config stays the version's."""

    dynamic_batching: bool
    max_batch_size: int
    max_queue_delay_us: int = 0
    preferred: tuple[int, ...] = ()
    instance_count: int = 1

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> Candidate:
        batching = cfg.HasField("dynamic_batching")
        return cls(
            dynamic_batching=batching,
            max_batch_size=cfg.max_batch_size,
            max_queue_delay_us=cfg.dynamic_batching.max_queue_delay_microseconds if batching else 0,
            preferred=tuple(sorted(cfg.dynamic_batching.preferred_batch_size)) if batching else (),
            instance_count=sum(g.count or 1 for g in cfg.instance_group) or 1,
        )

    def label(self) -> str:
        if not self.dynamic_batching:
            return f"no batching, max batch {self.max_batch_size}, {self.instance_count} instance(s)"
        preferred = ",".join(map(str, self.preferred)) or "none"
        return (
            f"batching max {self.max_batch_size}, delay {self.max_queue_delay_us} us, preferred {preferred}, "
            f"{self.instance_count} instance(s)"
        )

    def apply(self, cfg: ModelConfig) -> ModelConfig:
        """A copy of ``cfg`` with this candidate's settings."""
        out = ModelConfig()
        out.CopyFrom(cfg)
        out.max_batch_size = self.max_batch_size
        priority = None
        if out.HasField("dynamic_batching"):
            priority = ModelConfig()
            priority.dynamic_batching.CopyFrom(out.dynamic_batching)
        out.ClearField("dynamic_batching")
        if self.dynamic_batching:
            if priority is not None:  # priority levels, queue policies: the version's, kept
                out.dynamic_batching.CopyFrom(priority.dynamic_batching)
            out.dynamic_batching.SetInParent()
            del out.dynamic_batching.preferred_batch_size[:]
            out.dynamic_batching.preferred_batch_size.extend(self.preferred)
            out.dynamic_batching.max_queue_delay_microseconds = self.max_queue_delay_us
        kind = out.instance_group[0].kind if out.instance_group else None
        del out.instance_group[:]
        group = out.instance_group.add(count=self.instance_count)
        if kind is not None:
            group.kind = kind
        return out

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "preferred": list(self.preferred)}

    @classmethod
    def from_dict(cls, raw: dict) -> Candidate:
        """A candidate as ``as_dict`` wrote it; anything else (another field, a number out of range, a
        preferred size above the max batch size) raises ``TuningError`` naming the field."""
        if not isinstance(raw, dict) or set(raw) - CANDIDATE_FIELDS:
            raise TuningError("candidate", f"must be an object of {', '.join(sorted(CANDIDATE_FIELDS))}")
        batching = raw.get("dynamic_batching")
        if not isinstance(batching, bool):
            raise TuningError("dynamic_batching", "must be true or false")
        size = _whole(raw.get("max_batch_size"), "max_batch_size", 0, MAX_BATCH)
        delay = _whole(raw.get("max_queue_delay_us", 0), "max_queue_delay_us", 0, MAX_QUEUE_DELAY_US)
        count = _whole(raw.get("instance_count", 1), "instance_count", 1, max(INSTANCE_COUNTS))
        preferred = raw.get("preferred", [])
        if not isinstance(preferred, list | tuple) or len(preferred) > 8:
            raise TuningError("preferred", "must be a list of at most 8 batch sizes")
        preferred = tuple(_whole(p, "preferred", 1, max(size, 1)) for p in preferred)
        return cls(batching, size, delay, preferred, count)


CANDIDATE_FIELDS = frozenset(
    ("dynamic_batching", "max_batch_size", "max_queue_delay_us", "preferred", "instance_count")
)
MAX_BATCH = 4096
MAX_QUEUE_DELAY_US = 10_000_000
POINT_LIMITS = {  # a reported point's figures, each within a range a real measurement can have
    "throughput_rps": 1e7,
    "p50_ms": 3.6e6,
    "p99_ms": 3.6e6,
    "avg_batch_size": MAX_BATCH,
    "queue_us": 3.6e9,
}


def _whole(value, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise TuningError(name, f"must be a whole number from {low} to {high}")
    return value


def _figure(value, name: str, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TuningError(name, "must be a number")
    if not 0 <= value <= high:
        raise TuningError(name, f"must be from 0 to {high:g}")
    return float(value)


@dataclass(frozen=True)
class Point:
    candidate: Candidate
    concurrency: int
    throughput_rps: float
    p50_ms: float
    p99_ms: float
    errors: int = 0
    avg_batch_size: float = 0.0
    queue_us: float = 0.0

    def as_dict(self) -> dict:
        return {
            "candidate": self.candidate.as_dict(),
            "concurrency": self.concurrency,
            "throughput_rps": round(self.throughput_rps, 2),
            "p50_ms": round(self.p50_ms, 3),
            "p99_ms": round(self.p99_ms, 3),
            "errors": self.errors,
            "avg_batch_size": round(self.avg_batch_size, 2),
            "queue_us": round(self.queue_us, 1),
        }

    @classmethod
    def from_dict(cls, raw: dict) -> Point:
        """A point as ``as_dict`` wrote it (an agent's report): every figure checked, ``TuningError`` naming
        the field otherwise. Other keys (the agent's ``at_s``) are the caller's."""
        if not isinstance(raw, dict):
            raise TuningError("point", "must be an object")
        figures = {name: _figure(raw.get(name), name, high) for name, high in POINT_LIMITS.items()}
        return cls(
            candidate=Candidate.from_dict(raw.get("candidate")),
            concurrency=_whole(raw.get("concurrency"), "concurrency", 1, 4096),
            errors=_whole(raw.get("errors", 0), "errors", 0, 10**9),
            **figures,
        )


@dataclass
class Result:
    objective: Objective
    default: Candidate
    points: list[Point] = field(default_factory=list)
    recommended: Candidate | None = None
    closest: Candidate | None = None
    stopped: str = "done"  # done | budget | candidates
    wall_s: float = 0.0
    regear: tuple[int, ...] = ()  # gears that would serve the measured batches without padding (NPU)

    def points_of(self, candidate: Candidate) -> list[Point]:
        return [p for p in self.points if p.candidate == candidate]

    def score(self, candidate: Candidate) -> float | None:
        """The most throughput a candidate served within the objective; None when no point met it."""
        return score(self.points_of(candidate), self.objective)

    def candidates(self) -> list[Candidate]:
        seen: dict[Candidate, None] = {}
        for p in self.points:
            seen.setdefault(p.candidate, None)
        return list(seen)

    def tuned_over_default(self) -> float | None:
        best, base = (self.score(self.recommended) if self.recommended else None), self.score(self.default)
        if best is None or not base:
            return None
        return best / base

    def message(self) -> str:
        if self.recommended is not None:
            gain = self.tuned_over_default()
            if self.recommended == self.default:
                text = f"the current config is the best measured for {self.objective.describe()}"
            elif gain is None:
                text = f"recommended: {self.recommended.label()} (the current config does not meet the objective)"
            else:
                text = (
                    f"recommended: {self.recommended.label()} ({gain:.2f}x the current config's throughput)"
                )
        elif self.closest is not None:
            best = min(self.points_of(self.closest), key=lambda p: p.p99_ms)
            text = (
                f"no candidate meets {self.objective.describe()}; closest: {self.closest.label()} "
                f"(p99 {best.p99_ms:.1f} ms at {best.throughput_rps:.0f} requests/s)"
            )
        else:
            text = "nothing was measured"
        if self.regear:
            text += (
                f"; the measured batches fall between the compiled gears: re-converting with gears "
                f"{','.join(map(str, self.regear))} would serve them without padding"
            )
        return text

    def as_dict(self) -> dict:
        return {
            "objective": dataclasses.asdict(self.objective),
            "default": self.default.as_dict(),
            "recommended": self.recommended.as_dict() if self.recommended else None,
            "closest": self.closest.as_dict() if self.closest else None,
            "tuned_over_default": self.tuned_over_default(),
            "stopped": self.stopped,
            "wall_s": round(self.wall_s, 2),
            "regear": list(self.regear),
            "message": self.message(),
            "candidates": [
                {"candidate": c.as_dict(), "label": c.label(), "score_rps": self.score(c)}
                for c in self.candidates()
            ],
            "points": [p.as_dict() for p in self.points],
        }


def score(points: Iterable[Point], objective: Objective) -> float | None:
    met = [p.throughput_rps for p in points if objective.met_by(p)]
    return max(met) if met else None


def _closeness(points: Sequence[Point], objective: Objective) -> float:
    """How far a candidate that meets nothing is from the objective (smaller is closer)."""
    if not points:
        return math.inf
    if objective.rate_rps is None:
        return min(p.p99_ms for p in points) / objective.p99_ms
    return min(
        p.p99_ms / objective.p99_ms + max(0.0, objective.rate_rps - p.throughput_rps) / objective.rate_rps
        for p in points
    )


def _neighbours(values: Sequence, current) -> list:
    """The values one step either side of ``current`` in ``values`` (or the nearest ones when it is not in it)."""
    values = list(values)
    if current in values:
        i = values.index(current)
        return [values[j] for j in (i + 1, i - 1) if 0 <= j < len(values)]
    return sorted(values, key=lambda v: abs(v - current))[:2]


def _moves(c: Candidate, limits: Limits) -> list[Candidate]:
    """Candidates one setting away from ``c``, the most promising first."""
    moves: list[Candidate] = []
    if limits.max_batch_size > 0:
        if not c.dynamic_batching:
            moves.append(dataclasses.replace(c, dynamic_batching=True, max_batch_size=limits.max_batch_size))
        else:
            moves += [
                dataclasses.replace(c, max_queue_delay_us=d)
                for d in _neighbours(QUEUE_DELAYS_US, c.max_queue_delay_us)
            ]
            moves += [
                dataclasses.replace(c, max_batch_size=b, preferred=tuple(p for p in c.preferred if p <= b))
                for b in _neighbours(limits.batch_sizes(), c.max_batch_size)
            ]
            sizes = [b for b in limits.batch_sizes() if 1 < b <= c.max_batch_size]
            if c.preferred:
                moves.append(dataclasses.replace(c, preferred=()))
            elif sizes:
                # One preferred size: the largest gear below the maximum (a batch is sent when it fills).
                moves.append(dataclasses.replace(c, preferred=(sizes[-2] if len(sizes) > 1 else sizes[-1],)))
            moves.append(dataclasses.replace(c, dynamic_batching=False, max_queue_delay_us=0, preferred=()))
    moves += [
        dataclasses.replace(c, instance_count=n)
        for n in _neighbours(limits.instance_counts(), c.instance_count)
    ]
    return moves


def _paired(
    current: Candidate, moves: Sequence[Candidate], score: Callable[[Candidate], float | None]
) -> Candidate | None:
    """The two best-scoring moves from ``current`` that change different settings, applied together."""
    fields = [f.name for f in dataclasses.fields(Candidate)]

    def changed(move: Candidate) -> frozenset[str]:
        return frozenset(f for f in fields if getattr(move, f) != getattr(current, f))

    ranked = sorted((m for m in moves if score(m) is not None), key=lambda m: score(m), reverse=True)
    for i, first in enumerate(ranked):
        for second in ranked[i + 1 :]:
            if changed(first) & changed(second) or not first.dynamic_batching or not second.dynamic_batching:
                continue
            combined = dataclasses.replace(first, **{f: getattr(second, f) for f in changed(second)})
            combined = dataclasses.replace(
                combined, preferred=tuple(p for p in combined.preferred if p <= combined.max_batch_size)
            )
            return combined
    return None


def _regear(points: Sequence[Point], gears: Sequence[int]) -> tuple[int, ...]:
    """Gears that fit the measured batches (NPU): when the average batch sits well between two compiled
    gears, each execution pads up to the next gear and computes rows nobody sent."""
    if not gears:
        return ()
    observed = sorted({round(p.avg_batch_size) for p in points if p.avg_batch_size >= 1.5})
    gears = sorted(gears)
    wanted = []
    for size in observed:
        above = next((g for g in gears if g >= size), None)
        if above is not None and above not in (size,) and size / above < 0.75:
            wanted.append(size)
    return tuple(sorted(set(gears) | set(wanted))) if wanted else ()


def tune(
    measure: Callable[[Candidate, int], Point],
    base: Candidate,
    limits: Limits,
    objective: Objective,
    *,
    budget_s: float,
    max_candidates: int = 12,
    clock: Callable[[], float] = time.monotonic,
    log: Callable[[str], None] = lambda line: None,
    on_point: Callable[[Point], None] = lambda point: None,
    cancelled: Callable[[], bool] = lambda: False,
) -> Result:
    """Search from ``base`` (the version's config) and return every point and the recommendation.

    Never runs past ``budget_s`` by more than one point's measurement: the clock is checked before each."""
    if budget_s <= 0:
        raise TuningError("budget_s", "must be more than 0 seconds")
    if max_candidates < 1:
        raise TuningError("max_candidates", "must be at least 1")
    started = clock()
    result = Result(objective=objective, default=base)

    def out_of_time() -> bool:
        return clock() - started >= budget_s

    def sweep(candidate: Candidate) -> float | None:
        best = 0.0
        for concurrency in limits.concurrencies:
            if out_of_time() or cancelled():
                result.stopped = "cancelled" if cancelled() else "budget"
                break
            point = measure(candidate, concurrency)
            result.points.append(point)
            on_point(point)
            log(
                f"{candidate.label()} at concurrency {concurrency}: {point.throughput_rps:.0f} requests/s, "
                f"p50 {point.p50_ms:.2f} ms, p99 {point.p99_ms:.2f} ms"
                + (f", {point.errors} errors" if point.errors else "")
            )
            if point.errors or point.p99_ms > objective.p99_ms:
                break  # more concurrency only queues longer
            if objective.rate_rps is not None and point.throughput_rps >= objective.rate_rps * 1.5:
                break  # the rate is met with room: more load says nothing about the objective
            if best and point.throughput_rps < best * SATURATED:
                break  # saturated
            best = max(best, point.throughput_rps)
        return result.score(candidate)

    tried: set[Candidate] = set()

    def better(a: Candidate, b: Candidate | None) -> bool:
        if b is None:
            return True
        sa, sb = result.score(a), result.score(b)
        if sa is not None or sb is not None:
            return (sa or 0.0) > (sb or 0.0) * 1.02  # a move must beat noise to be kept
        return _closeness(result.points_of(a), objective) < _closeness(result.points_of(b), objective)

    current = base
    tried.add(base)
    sweep(base)
    improved = True
    while improved and result.stopped == "done":
        improved = False
        for move in _moves(current, limits):
            if move in tried:
                continue
            if len(tried) >= max_candidates:
                result.stopped = "candidates"
                break
            if out_of_time():
                result.stopped = "budget"
                break
            tried.add(move)
            sweep(move)
            if result.stopped != "done":
                break
            if better(move, current):
                current, improved = move, True
                break  # climb from the new best
        if not improved and result.stopped == "done":
            # A local optimum of single moves: try the two best of them together (two settings that each
            # help a little within the noise - a longer delay and a preferred size - may help together).
            paired = _paired(current, [m for m in _moves(current, limits) if m in tried], result.score)
            if paired is not None and paired not in tried:
                if len(tried) >= max_candidates:
                    result.stopped = "candidates"
                elif out_of_time():
                    result.stopped = "budget"
                else:
                    tried.add(paired)
                    sweep(paired)
                    if result.stopped == "done" and better(paired, current):
                        current, improved = paired, True
    recommend(result, limits.gears)
    result.wall_s = clock() - started
    return result


def recommend(result: Result, gears: Sequence[int] = ()) -> Result:
    """Name the candidate that met the objective with the most throughput (or else the closest) from the
    points measured, and the gears that would serve its batches (NPU). The platform calls it on the points
    an agent reported: the recommendation is its own reading of the figures."""
    scored = [(result.score(c), c) for c in result.candidates()]
    met = [(s, c) for s, c in scored if s is not None]
    result.recommended, result.closest = None, None
    if met:
        result.recommended = max(met, key=lambda sc: sc[0])[1]
    else:
        result.closest = min(
            result.candidates(), key=lambda c: _closeness(result.points_of(c), result.objective), default=None
        )
    chosen = result.recommended or result.closest
    result.regear = _regear(result.points_of(chosen), gears) if chosen else ()
    return result
