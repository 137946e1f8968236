"""The scheduler's choice, pure: which of a pool's instances get a deployment's replicas, given each one's
capacity and reserved memory (``Candidate``), the spread and the pool's placement policy - and when none
fits, the reason in words. Nothing here reads or writes the database: ``apps.deployments.scheduler`` reads
the candidates (under the pool's lock) and writes what was chosen.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from apps.deployments.models import Spread
from apps.fleet.models import PlacementPolicy

ALTERNATIVES_SHOWN = 5


def gib(mb: int) -> str:
    return f"{mb / 1024:.1f} GiB"


@dataclass(slots=True)
class Candidate:
    """One instance the scheduler may place on, with its memory as the locked rows say."""

    instance_id: int
    host_id: int
    label: str
    capacity_mb: int
    used_mb: int

    @property
    def free_mb(self) -> int:
        return self.capacity_mb - self.used_mb

    def as_dict(self) -> dict:
        return {"instance": self.label, "capacity_mb": self.capacity_mb, "free_mb": self.free_mb}


@dataclass
class Choice:
    chosen: list[Candidate]
    reason: str  # empty when every replica asked for was placed
    alternatives: list[dict]
    shared_host: bool = False  # a replica went to a host that has one already (no host was left without)


def choose(
    candidates: list[Candidate],
    *,
    need_mb: int,
    count: int,
    spread: str,
    replicas: int,
    taken_hosts: Iterable[int] = (),
    taken_instances: Iterable[int] = (),
    pool_name: str = "the pool",
    policy: str = PlacementPolicy.SPREAD,
    need_of: Callable[[Candidate], int | None] | None = None,
    hosts_in_pool: int | None = None,
) -> Choice:
    """Pick ``count`` instances for replicas of ``need_mb`` each. Pure: ``candidates`` are updated in place
    (their used memory grows by what was placed), nothing is read or written. ``taken_*``: where the
    deployment's other replicas run (never two on one instance; with spread=host, one per host while the
    pool has at least ``replicas`` hosts). ``need_of``: what a replica needs on that instance when it
    differs by instance (an ensemble: itself, plus the steps not placed there yet; None: it cannot go
    there); instances needing no more than ``need_mb`` come first. ``hosts_in_pool``: how many hosts the
    pool's schedulable instances are on, when ``candidates`` are not all of them (``_choose_in``)."""
    hosts, instances = set(taken_hosts), set(taken_instances)
    if hosts_in_pool is None:
        hosts_in_pool = len({c.host_id for c in candidates})
    strict = spread == Spread.HOST and hosts_in_pool >= replicas
    shared = False
    chosen: list[Candidate] = []
    reason = ""
    sign = 1 if policy == PlacementPolicy.BINPACK else -1
    for _ in range(count):
        # With spread=host, a host without a replica first; then an instance that needs nothing placed
        # beside the replica (an ensemble's steps already there); then by the pool's policy - ``spread``: the
        # least loaded (most free), ``binpack``: the most loaded that still fits (least free); the id breaks
        # ties. One pass over the pool per replica (a decision reads 1,600 instances at fleet size).
        best, best_key, best_need = None, None, 0
        for c in candidates:
            if c.instance_id in instances or (strict and c.host_id in hosts):
                continue
            need = need_mb if need_of is None else need_of(c)
            free = c.capacity_mb - c.used_mb
            if need is None or free < need:
                continue
            key = (c.host_id in hosts, need > need_mb, sign * free, c.instance_id)
            if best_key is None or key < best_key:
                best, best_key, best_need = c, key, need
        if best is None:
            open_ = [c for c in candidates if c.instance_id not in instances]
            if strict:
                open_ = [c for c in open_ if c.host_id not in hosts]
            reason = _why_not(open_, candidates, need_mb, pool_name, strict, need_of)
            break
        best.used_mb += best_need
        shared = shared or best.host_id in hosts
        hosts.add(best.host_id)
        instances.add(best.instance_id)
        chosen.append(best)
    ranked = heapq.nlargest(ALTERNATIVES_SHOWN, candidates, key=most_free)
    return Choice(chosen, reason, [c.as_dict() for c in ranked], shared)


def most_free(c: Candidate) -> tuple[int, int]:
    return c.capacity_mb - c.used_mb, -c.instance_id  # the lower id first among equals


def _why_not(
    open_: list[Candidate],
    every: list[Candidate],
    need_mb: int,
    pool_name: str,
    strict: bool,
    need_of: Callable[[Candidate], int | None] | None = None,
) -> str:
    if not every:
        return (
            f"no schedulable instance in {pool_name} (hosts online, not cordoned, instances not quarantined)"
        )
    if not open_:
        return f"every schedulable host of {pool_name} already has a replica (spread=host)"
    if need_of is not None:
        sized = [(c, need_of(c)) for c in open_]
        possible = [(c, n) for c, n in sized if n is not None]
        if not possible:
            return (
                f"no instance in {pool_name} serves its steps or may get a replica of each step it lacks "
                "(a step deployed on chosen instances, or in another pool)"
            )
        best, n = min(possible, key=lambda item: (item[1] - item[0].free_mb, item[0].instance_id))
        return (
            f"no instance in {pool_name} has room for it with the steps it lacks there; the closest is "
            f"{best.label}: needs {gib(n)}, {gib(max(0, best.free_mb))} free"
        )
    largest = max(open_, key=lambda c: c.free_mb)
    where = " on a host without a replica" if strict and len(open_) < len(every) else ""
    return (
        f"no instance in {pool_name} has {gib(need_mb)} free{where}; "
        f"the largest free is {gib(max(0, largest.free_mb))} on {largest.label}"
    )
