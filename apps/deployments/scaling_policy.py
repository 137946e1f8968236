"""The autoscaler's decision: how many replicas a deployment should have now. Pure - no database, no clock.

Inputs: the deployment's policy (min/max replicas, a target of in-flight requests per replica, a stabilisation
window for scaling down, an idle period for scaling to zero), the replicas it asks for now, one observation
of the gateway (requests in flight - HAProxy's current plus queued sessions of its backends -, the
cumulative request count and HAProxy's average time per request), and the memory the previous decision
returned.

* The load is an average over the evaluation interval, not one snapshot (``window_in_flight``): by Little's
  law, requests forwarded since the previous evaluation per second times the average time of a request is
  the mean number in flight over that interval. A level the snapshots show twice in a row counts too (a
  request longer than the interval has not finished yet, so the rate does not see it). A momentary spike
  in one snapshot, or a snapshot that falls in a gap between requests, therefore never decides alone.

* Scaling up follows the load at once: ``ceil(in_flight / target)``, capped at ``max_replicas``.
* Scaling down takes the *highest* recommendation of the last ``down_window_s`` seconds (the recommendation
  in effect when the window opened included; while the memory does not cover the whole window the current
  count counts too). A burst every few minutes therefore never makes the replicas go up and down (flapping):
  they come down only after a whole window below.
* Scaling to zero (``min_replicas == 0``): no request in flight and the request count unchanged for
  ``idle_period_s`` seconds. Waking is the gateway's (a held request), not this function's: a sleeping
  deployment stays at zero here unless requests are in flight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Policy:
    min_replicas: int
    max_replicas: int
    target: float = 4.0  # in-flight requests per replica
    down_window_s: int = 300
    idle_period_s: int = 900


@dataclass(frozen=True)
class Observation:
    at: float  # seconds (epoch)
    in_flight: float  # current + queued sessions at the gateway, summed over the deployment's backends
    total: int | None = None  # cumulative requests the gateway forwarded (None: unknown)
    avg_time_s: float | None = None  # HAProxy's average total time of the backends' last requests


@dataclass
class Memory:
    """What a decision needs from the previous ones: the recommendations (changes only, ``[at, n]``) of the
    last window, the last request count seen and when traffic was last seen."""

    recommendations: list[list[float]] = field(default_factory=list)
    last_total: int | None = None
    last_traffic_at: float | None = None
    last_at: float | None = None  # when the previous observation was made
    last_snapshot: float | None = None  # its in-flight snapshot

    @classmethod
    def load(cls, data: dict | None) -> Memory:
        data = data or {}
        recs = [[float(a), int(n)] for a, n in data.get("recommendations", []) if isinstance(n, int | float)]
        return cls(
            recs,
            data.get("last_total"),
            data.get("last_traffic_at"),
            data.get("last_at"),
            data.get("last_snapshot"),
        )

    def dump(self) -> dict:
        return {
            "recommendations": self.recommendations,
            "last_total": self.last_total,
            "last_traffic_at": self.last_traffic_at,
            "last_at": self.last_at,
            "last_snapshot": self.last_snapshot,
        }


@dataclass
class Decision:
    replicas: int
    recommended: int
    per_replica: float
    memory: Memory
    message: str = ""  # empty when nothing changes
    in_flight: float = 0.0  # the load decided on: the average over the interval (``window_in_flight``)

    @property
    def changed(self) -> bool:
        return bool(self.message)


def recommend(policy: Policy, in_flight: float) -> int:
    """Replicas for this load alone, within [max(min, 1), max]."""
    wanted = math.ceil(in_flight / policy.target - 1e-9) if in_flight > 0 else 0
    return max(max(policy.min_replicas, 1), min(policy.max_replicas, wanted))


def window_in_flight(memory: Memory, observation: Observation) -> float:
    """The requests in flight over the interval since the previous observation (see the module's doc).
    Without a previous observation, a request count or an average time (or after a gateway restart reset
    the count) there is only the snapshot."""
    snapshot = max(0.0, observation.in_flight)
    previous, total, avg = memory.last_snapshot, observation.total, observation.avg_time_s
    if previous is None or memory.last_at is None:
        return snapshot
    sustained = min(snapshot, max(0.0, previous))
    elapsed = observation.at - memory.last_at
    if total is None or memory.last_total is None or total < memory.last_total or avg is None or elapsed <= 0:
        return sustained if avg is not None else snapshot
    little = (total - memory.last_total) / elapsed * max(0.0, avg)
    return max(little, sustained)


def _remember(memory: Memory, at: float, value: int, window_s: int) -> None:
    recs = memory.recommendations
    if not recs or recs[-1][1] != value:
        recs.append([at, value])
    start = at - window_s
    # Keep the recommendation in effect when the window opened (the last one before it), drop older ones.
    while len(recs) >= 2 and recs[1][0] <= start:
        recs.pop(0)


def _window_max(memory: Memory, at: float, window_s: int, current: int) -> int:
    recs = memory.recommendations
    highest = max((int(n) for _, n in recs), default=current)
    if not recs or recs[0][0] > at - window_s:
        highest = max(highest, current)  # the memory does not cover the window: be as cautious as now
    return highest


def decide(policy: Policy, current: int, observation: Observation, memory: Memory | None = None) -> Decision:
    memory = Memory.load((memory or Memory()).dump())  # never mutate the caller's memory
    # Asleep, only a request in flight now wakes it: the interval's average would count the requests it
    # served before it was put to sleep, and wake it for nobody.
    asleep = current == 0
    in_flight = max(0.0, observation.in_flight) if asleep else window_in_flight(memory, observation)
    decision = _decide(policy, current, observation, memory, in_flight)
    decision.memory.last_at = observation.at
    decision.memory.last_snapshot = max(0.0, observation.in_flight)
    decision.in_flight = in_flight
    return decision


def _decide(
    policy: Policy, current: int, observation: Observation, memory: Memory, in_flight: float
) -> Decision:
    at, total = observation.at, observation.total
    # Any change of the count is traffic (a gateway reload restarts it at zero: counted as traffic, which
    # only delays a sleep).
    traffic = (
        in_flight > 0
        or observation.in_flight > 0
        or (total is not None and memory.last_total is not None and total != memory.last_total)
    )
    if traffic or memory.last_traffic_at is None:
        memory.last_traffic_at = at  # the idle period counts from the first observation, not from the epoch
    memory.last_total = total if total is not None else memory.last_total
    per_replica = in_flight / current if current else in_flight

    if current == 0:
        if in_flight <= 0:
            memory.recommendations = []
            return Decision(0, 0, per_replica, memory)
        woken = recommend(policy, in_flight)
        memory.recommendations = [[at, woken]]
        return Decision(woken, woken, per_replica, memory,
                        f"0 -> {woken} replicas: {in_flight:.1f} in flight while asleep, target {policy.target:g}")  # fmt: skip

    recommended = recommend(policy, in_flight)
    _remember(memory, at, recommended, policy.down_window_s)
    figures = f"{per_replica:.1f} in flight per replica, target {policy.target:g}"
    idle_s = at - memory.last_traffic_at
    if policy.min_replicas == 0 and not traffic and idle_s >= policy.idle_period_s:
        memory.recommendations = []
        return Decision(0, 0, 0.0, memory,
                        f"{current} -> 0 replicas: no request for {idle_s:.0f} s (idle period {policy.idle_period_s} s)")  # fmt: skip
    if recommended > current:
        return Decision(
            recommended, recommended, per_replica, memory, f"{current} -> {recommended} replicas: {figures}"
        )
    held = min(current, _window_max(memory, at, policy.down_window_s, current))
    # Bounds changed by a person apply at once, in both directions.
    target = max(max(policy.min_replicas, 1), min(policy.max_replicas, held))
    if target == current:
        return Decision(current, recommended, per_replica, memory)
    why = figures if target > current else f"{figures}, the highest over the last {policy.down_window_s} s"
    return Decision(target, recommended, per_replica, memory, f"{current} -> {target} replicas: {why}")
