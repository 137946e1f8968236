"""Whose room it is: the replicas waiting for room in a pool take it in the order they began to wait.

Under a stream of wake-ups into a full pool, room that frees up (an evicted replica reported unloaded, one
gone to sleep by itself) went to whichever decision asked next - often a wake-up that had just arrived -
while the replica it was evicted for, or one waiting longer, waited on and evicted again: the measured
p99 of "seen -> placed" was a chain of such losses. So a decision for a deployment counts a pool's room
only after the deployments that wait longer were served (``Ledger``):

* room evicted for a deployment that still waits is that one's, free already or still being unloaded
  (``DeploymentInstance.evicted_for``);
* the deployments that wait longer take what they still need of the rest, first the free room, then the
  room being unloaded, each the first instance where it fits (``healing.waiting_for_room``'s order: the
  least recently updated first - the order an unload report places them in);
* what is left is the deciding deployment's: free now (the scheduler places there), or coming (eviction
  waits for it instead of evicting more).

Pure reads, a few queries, and only when others wait in the pool (no waiting deployment: nothing held).
``headroom_short`` counts the same way what an instance will have free, for the autoscaler's headroom.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from django.db.models import F, Q

from apps.deployments.choice import Candidate
from apps.deployments.models import (
    ACTIVE_STATES,
    Deployment,
    DeploymentInstance,
    DeploymentState,
    PlacementState,
)
from apps.fleet.models import Pool
from apps.registry.models import ModelVersion


@dataclass
class Ledger:
    """A pool's room as one deployment may count on it, per instance id."""

    held: dict[int, int] = field(default_factory=dict)  # free now, but another waiting deployment's
    coming: dict[int, int] = field(default_factory=dict)  # being unloaded, and this deployment's

    def free_for(self, candidates: list[Candidate]) -> list[Candidate]:
        """The candidates with the held room counted as used."""
        return [
            Candidate(
                c.instance_id, c.host_id, c.label, c.capacity_mb, c.used_mb + self.held.get(c.instance_id, 0)
            )
            for c in candidates
        ]


def may_use(pool: Pool) -> Q:
    """The deployments that may use ``pool``: its own, and those without a pool of their own (they may use
    the shared pools and their team's dedicated ones) - ``scheduler.pools_for`` seen from the pool."""
    anywhere = Q(pool__isnull=True) if pool.team_id is None else Q(pool__isnull=True, team_id=pool.team_id)
    return Q(pool=pool) | anywhere


def waiting_in(pool: Pool):
    """Deployments short of a replica because no instance of a pool they may use had room, the longest
    waiting first."""
    return (
        Deployment.objects.filter(may_use(pool))
        .exclude(pending_reason="")
        .filter(state__in=ACTIVE_STATES, replicas__gt=0)
        .order_by(F("waiting_since").asc(nulls_last=True), "pk")
    )


def ledger(deployment: Deployment, pool: Pool, candidates: list[Candidate]) -> Ledger:
    """The room of ``candidates`` (the pool's instances, their reserved memory as read under the pool's
    lock) that ``deployment`` may count on."""
    others = list(
        waiting_in(pool)
        .exclude(pk=deployment.pk)
        .values_list("pk", "waiting_since", "active_version_id", "target_version_id")
    )
    instance_ids = [c.instance_id for c in candidates]
    rows = list(
        DeploymentInstance.objects.filter(instance_id__in=instance_ids, unload=True)
        .exclude(deployment__state=DeploymentState.UNDEPLOYED)
        .filter(
            ~Q(state=PlacementState.UNLOADED) | Q(evicted_for_id__in=[deployment.pk, *(pk for pk, *_ in others)])
        )
        .values_list(
            "instance_id", "state", "evicted_for_id", "deployment__active_version_id",
            "deployment__target_version_id",
        )
    )  # fmt: skip
    result = Ledger()
    if not others and not rows:
        return result
    sizes = footprints([v for row in others for v in row[2:]] + [v for row in rows for v in row[3:]])

    def size(active, target) -> int:
        return sum(sizes.get(v, 0) for v in {active, target} if v)

    needs = {pk: size(active, target) or 1 for pk, _, active, target in others}
    owed = dict(needs)  # what each waiting one still needs beyond the room evicted for it
    held: dict[int, int] = defaultdict(int)
    coming: dict[int, int] = defaultdict(int)  # nobody's yet
    mine_free: dict[int, int] = defaultdict(int)  # evicted for this deployment: no one else's
    mine_coming: dict[int, int] = defaultdict(int)
    # Unloaded first: a waiting replica's freed room covers its need before its room still unloading does.
    for instance_id, state, evicted_for, active, target in sorted(
        rows, key=lambda r: r[1] != PlacementState.UNLOADED
    ):
        mb = size(active, target)
        if evicted_for == deployment.pk:
            (mine_free if state == PlacementState.UNLOADED else mine_coming)[instance_id] += mb
        elif evicted_for in owed:
            claimed = min(mb, owed[evicted_for])  # an earlier wait's claim never holds more than it needs
            owed[evicted_for] -= claimed
            if state == PlacementState.UNLOADED:
                held[instance_id] += claimed
            else:
                coming[instance_id] += mb - claimed
        elif state != PlacementState.UNLOADED:
            coming[instance_id] += mb

    ahead = others
    if deployment.waiting_since is not None:  # waiting already: only those that wait longer come first
        mine = (deployment.waiting_since, deployment.pk)
        ahead = [row for row in others if row[1] is not None and (row[1], row[0]) < mine]
    free = {c.instance_id: c.free_mb - held[c.instance_id] - mine_free[c.instance_id] for c in candidates}
    taken = _counted_on(ahead, instance_ids)
    for pk, *_ in ahead:
        if owed[pk] <= 0:
            continue
        where = taken.get(pk, set())
        spot = _first_fit(free, owed[pk], where)
        if spot is not None:
            free[spot] -= owed[pk]
            held[spot] += owed[pk]
            continue
        spot = _first_fit(coming, owed[pk], where)
        if spot is not None:
            coming[spot] -= owed[pk]
    result.held = {i: mb for i, mb in held.items() if mb > 0}
    for instance_id, mb in mine_coming.items():
        coming[instance_id] += mb
    result.coming = {i: mb for i, mb in coming.items() if mb > 0}
    return result


def headroom_short(pool: Pool, candidates: list[Candidate], headroom_mb: int) -> dict[int, int]:
    """Per instance of ``candidates`` that will have less than ``headroom_mb`` free, how much more must be
    freed: counted once the room being unloaded there is free and the deployments waiting in the pool took
    what they need (longest waiting first, each the first instance where it fits)."""
    ids = [c.instance_id for c in candidates]
    unloading = list(
        DeploymentInstance.objects.filter(instance_id__in=ids, unload=True)
        .exclude(state=PlacementState.UNLOADED)
        .exclude(deployment__state=DeploymentState.UNDEPLOYED)
        .values_list("instance_id", "deployment__active_version_id", "deployment__target_version_id")
    )
    waiting = list(waiting_in(pool).values_list("pk", "active_version_id", "target_version_id"))
    sizes = footprints([v for row in unloading + waiting for v in row[1:]])

    def size(active, target) -> int:
        return sum(sizes.get(v, 0) for v in {active, target} if v)

    free = {c.instance_id: c.free_mb for c in candidates}
    for instance_id, active, target in unloading:
        free[instance_id] += size(active, target)
    taken = _counted_on(waiting, ids)
    for pk, active, target in waiting:
        need = size(active, target) or 1
        spot = _first_fit(free, need, taken.get(pk, set()))
        if spot is not None:
            free[spot] -= need
    return {i: headroom_mb - mb for i, mb in free.items() if mb < headroom_mb}


def _first_fit(room: dict[int, int], need: int, excluded: set[int]) -> int | None:
    return next((i for i in sorted(room) if i not in excluded and room[i] >= need), None)


def _counted_on(rows: list[tuple], instance_ids: list[int]) -> dict[int, set[int]]:
    """The instances (of ``instance_ids``) where each deployment already has a replica: never a second."""
    placed = DeploymentInstance.objects.filter(
        deployment_id__in=[pk for pk, *_ in rows], instance_id__in=instance_ids, retiring_reason=""
    ).exclude(state=PlacementState.UNLOADED)
    taken: dict[int, set[int]] = defaultdict(set)
    for deployment_id, instance_id in placed.values_list("deployment_id", "instance_id"):
        taken[deployment_id].add(instance_id)
    return taken


def footprints(version_ids: Iterable[int]) -> dict[int, int]:
    """Each version's reserved memory (its measured footprint, else its estimate)."""
    ids = {pk for pk in version_ids if pk}
    rows = ModelVersion.objects.filter(pk__in=ids).only("pk", "footprint_mb", "size_bytes")
    return {v.pk: v.footprint_estimate_mb() for v in rows}
