"""The scheduler's beat (every ``SCHEDULER_TICK_S``): keep every scheduled deployment at its replicas.

One tick, each deployment in its own short transaction under its row lock:
1. replicas whose host is lost (no heartbeat past the grace), revoked, or whose instance is quarantined are
   retired: they stop counting and stay loaded (a host that comes back still serves them meanwhile);
2. a draining host (and a template instance its pool no longer wants) gives up one replica at a time: the
   next only once the previous one is unloaded; pinned replicas are not moved and hold the drain; an
   unwanted instance left without replicas is stopped, then removed;
3. deployments short of replicas get them placed where they fit (a pending one as soon as capacity appears;
   where none is, idle replicas of scale-to-zero deployments are evicted: ``autoscaling.make_room``);
4. retired replicas are told to unload once the deployment has its replicas READY elsewhere;
5. replicas told to unload that no gateway confirmed drained within ``GATEWAY_DRAIN_TIMEOUT_S`` are handed
   to their agents anyway (``apps.deployments.draining``).
First, each instance's reserved memory (``TritonInstance.reserved_mb``) is checked against the sum over its
placements and recomputed where it drifted (0 expected: the writers keep it, ``reserved.refresh_reserved``).
The decisions are ``apps.deployments.scheduler``'s; a deployment's state follows from its placements in
``apps.deployments.services``.
"""

from __future__ import annotations

from django.db import transaction
from django.db.models import Case, Count, F, Q, Value, When

from apps.deployments import (
    autoscaling,
    draining,
    ensembles,
    lost,
    reserved,
    room,
    scheduler,
    services,
    tuning_jobs,
)
from apps.deployments.models import Deployment, DeploymentInstance, DeploymentState, PlacementState
from apps.fleet import pools
from apps.fleet.models import Host, Pool, TritonInstance
from apps.registry.models import ModelKind


def _locked(deployment_id: int) -> Deployment | None:
    """The deployment's row, locked, with what its decisions read besides (one statement, not five)."""
    rows = Deployment.objects.select_for_update(of=("self",)).select_related(
        "model", "pool", "active_version", "target_version"
    )
    deployment = rows.filter(pk=deployment_id).first()
    return None if deployment is None or deployment.state in scheduler.GONE else deployment


def _retire(deployment_id: int, items: list[tuple[int, str]]) -> int:
    with transaction.atomic():
        deployment = _locked(deployment_id)
        if deployment is None:
            return 0
        fresh = {p.pk: p for p in deployment.placements.filter(pk__in=[pk for pk, _ in items], retiring_reason="")
                 .select_related("instance__host")}  # fmt: skip
        by_reason: dict[str, list[DeploymentInstance]] = {}
        for pk, why in items:
            if pk in fresh:
                by_reason.setdefault(why, []).append(fresh[pk])
        steps = []
        for why, placements in by_reason.items():
            steps += scheduler.retire(deployment, placements, why)
        placed = scheduler.place_replicas(deployment)
        transaction.on_commit(lambda: scheduler.enqueue(placed))
        # The deployments' states follow from the replicas that still count (an ensemble's steps moved too).
        services.settle_locked(deployment)
        settled: set[int] = {deployment.pk}
        for placement in steps:
            if placement.deployment_id not in settled:
                settled.add(placement.deployment_id)
                services.placement_finished(placement)
        return len(fresh)


def live_on(instances: Q):
    """The placements that still hold these instances: not unloaded, of deployments not undeployed."""
    return (
        DeploymentInstance.objects.filter(instances)
        .exclude(state=PlacementState.UNLOADED)
        .exclude(deployment__state=DeploymentState.UNDEPLOYED)
    )


def pinned_on(instances: Q):
    """Pinned replicas on these instances: a drain does not move them (the people who pinned them chose the
    instances; ``docs/operators/pools-and-scaling.md``), so they hold the drain until redeployed or undeployed."""
    return live_on(instances).filter(deployment__pinned=True).exclude(deployment__state__in=scheduler.GONE)


def _drain_one(where: Q, why: str) -> int:
    on_it = live_on(where)
    if on_it.exclude(retiring_reason="").exists():
        return 0  # a move is in flight: its replacement serves, then the old one unloads, then the next
    movable = (
        on_it.filter(retiring_reason="", deployment__pinned=False)
        .exclude(deployment__state__in=scheduler.GONE)
        .order_by("pk")
        .values_list("pk", "deployment_id", "instance_id", "deployment__model_id")
    )
    for pk, deployment_id, instance_id, model_id in movable:
        # A step's replica under an ensemble replica moves with it: the ensemble's is moved (and takes its
        # steps along); one under a pinned ensemble stays, as that ensemble does.
        calling = ensembles.replicas_calling(model_id, {instance_id}, counted_only=True)
        caller = calling.values_list("pk", "deployment_id", "deployment__pinned").order_by("pk").first()
        if caller is None:
            return _retire(deployment_id, [(pk, why)])
        if not caller[2]:
            return _retire(caller[1], [(caller[0], why)])
    return 0


def drain_next() -> int:
    """Each draining host, and each template instance its pool no longer wants, gives up its next replica
    once the previous move has finished. Pinned replicas stay (``pinned_on``)."""
    moved = 0
    for host in Host.objects.filter(draining_at__isnull=False).order_by("pk"):
        moved += _drain_one(Q(instance__host=host), f"host {host.name} is draining")
    unwanted = TritonInstance.objects.filter(unwanted_since__isnull=False).select_related("host")
    for instance in unwanted.order_by("pk"):
        moved += _drain_one(Q(instance=instance), f"instance {instance} is no longer wanted by its pool")
    return moved


def remove_unwanted_instances() -> int:
    """Unwanted template instances that hold no replica any more are stopped, then removed (``pools``)."""
    unwanted = TritonInstance.objects.filter(unwanted_since__isnull=False)
    busy = set(live_on(Q(instance__in=unwanted)).values_list("instance_id", flat=True))
    emptied = [pk for pk in unwanted.values_list("pk", flat=True) if pk not in busy]
    return pools.remove_unwanted(emptied) if emptied else 0


def ensembles_first():
    """Ensembles before models: an ensemble's replica placed again takes the replicas its steps lost with it
    (``ensemble_placing.place_steps_with``), instead of each step placing its own wherever it fits."""
    return Case(When(model__kind=ModelKind.ENSEMBLE, then=Value(0)), default=Value(1))


def short_of_replicas(**filters) -> list[int]:
    """Scheduled live deployments with fewer counted replicas than they ask for (ensembles first);
    ``filters``: of these deployments only."""
    counted = Count(
        "placements",
        filter=Q(placements__retiring_reason="") & ~Q(placements__state=PlacementState.UNLOADED),
    )
    return list(
        Deployment.objects.filter(pinned=False, **filters)
        .exclude(state__in=scheduler.GONE)
        .annotate(counted=counted)
        .filter(counted__lt=F("replicas"))
        # Those waiting for room longest first: the room held for them (``room``) is theirs this tick.
        .order_by(ensembles_first(), F("waiting_since").asc(nulls_last=True), "pk")
        .values_list("pk", flat=True)
    )


def with_retired_replicas() -> list[int]:
    """Deployments with retired replicas still loaded whose replacements serve: as many READY replicas as
    they ask for (``scheduler.release_retired`` unloads the retired ones then; the others wait, unread)."""
    rows = DeploymentInstance.objects.exclude(retiring_reason="").filter(unload=False)
    rows = rows.exclude(state=PlacementState.UNLOADED).exclude(deployment__state__in=scheduler.GONE)
    ready = Count(
        "placements",
        filter=Q(placements__retiring_reason="", placements__state=PlacementState.READY),
    )
    deployments = Deployment.objects.filter(pk__in=rows.values("deployment_id"))
    ready_ones = deployments.annotate(ready=ready).filter(ready__gte=F("replicas"))
    return list(ready_ones.order_by("pk").values_list("pk", flat=True))


def place_short(deployment_ids: list[int] | None = None) -> int:
    """Place the replicas deployments lack (``deployment_ids``: only these), where they fit now (else
    evicting idle ones: ``make_room``). The tick's step 3; also run for the deployment an evicted replica
    made room for as soon as its agent reports it unloaded, rather than at the next tick."""
    count = 0
    wanted = short_of_replicas() if deployment_ids is None else short_of_replicas(pk__in=deployment_ids)
    for deployment_id in wanted:
        with transaction.atomic():
            deployment = _locked(deployment_id)
            placed = (
                scheduler.place_replicas(deployment, make_room=autoscaling.make_room) if deployment else []
            )
            if placed:
                autoscaling.note_placed(deployment, placed)
            transaction.on_commit(lambda placed=placed: scheduler.enqueue(placed))
        count += len(placed)
    return count


def waiting_for_room(pool_id: int | None, limit: int = 1) -> list[int]:
    """Deployments that may use the pool, short of a replica because no instance had room (a pending reason
    is set), the longest waiting first: the ones an unload in that pool may let in."""
    pool = Pool.objects.filter(pk=pool_id).first()
    if pool is None:
        return []
    rows = room.waiting_in(pool)
    short = set(short_of_replicas(pk__in=rows.values("pk")))
    order = rows.filter(pk__in=short)
    return list(order.values_list("pk", flat=True)[:limit])


def tick() -> dict[str, int]:
    counts = {"retired": 0, "drained": 0, "removed_instances": 0, "placed": 0, "released": 0, "undrained": 0}
    # The reserved memory the decisions read is kept by the writers of placements; a figure that drifted (a
    # row changed behind their back) is recomputed before this tick decides anything on it.
    counts["reserved_repaired"] = reserved.repair_reserved()
    gone = lost.lost_placements()
    order = Deployment.objects.filter(pk__in=list(gone)).order_by(ensembles_first(), "pk")
    for deployment_id in order.values_list("pk", flat=True):
        counts["retired"] += _retire(deployment_id, gone[deployment_id])
    counts["drained"] = drain_next()
    counts["removed_instances"] = remove_unwanted_instances()
    counts["placed"] = place_short()
    for deployment_id in with_retired_replicas():
        with transaction.atomic():
            deployment = _locked(deployment_id)
            released = scheduler.release_retired(deployment) if deployment else []
            transaction.on_commit(lambda released=released: scheduler.enqueue(released))
        counts["released"] += len(released)
    counts["undrained"] = draining.release_undrained()
    counts.update(tuning_jobs.tick())  # after the replicas: a serving replica's room comes first
    return counts
