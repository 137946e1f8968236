"""The scheduler: where a deployment's replicas run. The one module that decides placements by intent.

A deployment that is not pinned asks for ``replicas`` in a pool (or any pool its team may use). Each instance
has a capacity (``TritonInstance.capacity_mb``: an NPU's HBM minus a reserve, a CPU instance's memory budget,
by default its pool's) and each placed version a footprint (``ModelVersion.footprint_estimate_mb``: measured
by the agent at first load, else estimated from the artifact). A replica goes only where it fits, on the
instance with the most free memory; with ``spread=host`` at most one replica per host while the pool has
enough hosts. What cannot be placed stays pending with the reason, and the beat (``apps.deployments.healing``)
tries again.

Concurrency: the pool's row is locked (``SELECT ... FOR UPDATE``; pools in one order: a team's dedicated ones
first, then by name) before its instances' reserved memory is read, so two deploys into one pool are
serialized and never overcommit an instance. Each instance's reserved memory (``TritonInstance.reserved_mb``)
is kept by the writers of placements inside the same transaction (``apps.deployments.reserved``), so a
decision reads its pool's instances without their placements - and only those its choice can reach, in the
policy's order (``_choose_in``). The pure choice is ``apps.deployments.choice``; an ensemble's replica goes
where its steps are placed or can be placed with it (``apps.deployments.ensemble_placing``).

Writes: placements it creates, retires or releases, the deployment's ``pending_reason`` and PENDING <->
DEPLOYING, and one event per decision with its inputs - an owner beside ``apps.deployments.services``
(``tests/deployments/test_one_writer.py``), because a placement's creation *is* the decision. It never settles
a deployment's state from its placements' reports: that stays with ``services``.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Iterable
from datetime import timedelta

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import connection
from django.db.models import Count, F, IntegerField, Subquery, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from apps.deployments import draining, ensemble_placing, ensembles, room
from apps.deployments.choice import ALTERNATIVES_SHOWN, Candidate, Choice, choose, gib, most_free
from apps.deployments.models import (
    Deployment,
    DeploymentEvent,
    DeploymentInstance,
    DeploymentState,
    PlacementState,
    Spread,
)
from apps.deployments.room import Ledger, footprints
from apps.fleet.models import DesiredInstanceState, InstanceState, PlacementPolicy, Pool, TritonInstance
from apps.fleet.services import notify_hosts

log = logging.getLogger(__name__)

GONE = (DeploymentState.UNDEPLOYING, DeploymentState.UNDEPLOYED)
POLICY_WORDS = {
    PlacementPolicy.SPREAD: "policy spread: the least loaded instance that fits",
    PlacementPolicy.BINPACK: "policy binpack: the most loaded instance that still fits",
}


def grace() -> timedelta:
    """A host unheard of for longer is lost: no new replicas, and its replicas are placed elsewhere."""
    return timedelta(seconds=settings.SCHEDULER_HOST_GRACE_S)


def check_intent(team, *, replicas: int, pool: Pool | None, spread: str) -> None:
    """What a deployment asks the scheduler for is possible to ask: a 400 naming the field otherwise."""
    limit = settings.SCHEDULER_MAX_REPLICAS
    if not (isinstance(replicas, int) and 1 <= replicas <= limit):
        raise ValidationError({"replicas": [f"Ask for 1 to {limit} replicas (got {replicas})."]})
    if pool is not None and pool.team_id not in (None, team.pk):
        raise ValidationError({"pool": [f"Team {team.slug} may not use pool '{pool.name}'."]})
    if spread not in Spread.values:
        raise ValidationError({"spread": [f"'{spread}' is not a spread; use {' or '.join(Spread.values)}."]})


def usable_pool(team, name: str | None) -> Pool | None:
    """The named pool if ``team`` may use it (None for no name); unknown and another team's pools read alike:
    a 400 naming ``pool``."""
    if not name:
        return None
    pool = Pool.objects.usable_by_team(team).filter(name=name).first()
    if pool is None:
        raise ValidationError({"pool": [f"No pool '{name}' that team {team.slug} may use."]})
    return pool


# --- Reading the fleet --------------------------------------------------------------------------------


def replica_held_mb(deployment: Deployment) -> int:
    """What one replica holds: the served version, plus the target during a switch (both are loaded).
    Versions the deployment row has loaded already (a deploy's) are not read again."""
    loaded, unread = {}, []
    for field in ("active_version", "target_version"):
        pk = getattr(deployment, f"{field}_id")
        if pk is not None and Deployment._meta.get_field(field).is_cached(deployment):
            loaded[pk] = getattr(deployment, field).footprint_estimate_mb()
        elif pk is not None:
            unread.append(pk)
    return sum({**loaded, **(footprints(unread) if unread else {})}.values())


def deployment_need_mb(deployment: Deployment) -> int:
    """What one replica needs free (at least 1 MiB, so a deployment without a version still asks)."""
    return replica_held_mb(deployment) or 1


def schedulable_instances(pool: Pool, *, now=None):
    """The pool's instances new replicas may go to (rows not locked)."""
    now = now or timezone.now()
    return (
        TritonInstance.objects.filter(
            host__pool=pool,
            host__revoked_at__isnull=True,
            host__cordoned_at__isnull=True,
            host__last_heartbeat_at__gte=now - grace(),
            desired_state=DesiredInstanceState.RUNNING,
            unwanted_since__isnull=True,
        )
        .exclude(state__in=[InstanceState.QUARANTINED, InstanceState.FAILED])
        .order_by("pk")
    )


def candidates_in(pool: Pool, *, lock: bool) -> list[Candidate]:
    """The pool's schedulable instances with their used memory; ``lock``: the pool's row stays locked until
    the caller's transaction ends, so no other decision can place in the pool meanwhile. (Locking the
    instances' rows instead serializes the same decisions - each reads every instance of the pool - but
    writes a lock on 1,600 rows per decision in a pool of 200 hosts x 8 devices.)"""
    if lock:
        Pool.objects.select_for_update().filter(pk=pool.pk).values_list("pk", flat=True).first()
    # Only the columns a decision reads, and each instance's reserved memory as kept by the writers
    # (``refresh_reserved``): one query that does not grow with the pool's placements.
    return _as_candidates(pool, schedulable_instances(pool))


CANDIDATE_FIELDS = ("pk", "host_id", "host__name", "name", "capacity_mb", "reserved_mb", "hosts", "part")


def _as_candidates(pool: Pool, rows) -> list[Candidate]:
    """Candidates from instance rows: a queryset, or rows of ``CANDIDATE_FIELDS``."""
    if not isinstance(rows, list):
        rows = rows.values_list(*CANDIDATE_FIELDS[:6])
    budget = pool.memory_budget_mb
    return [
        Candidate(row[0], row[1], f"{row[2]}/{row[3]}", budget if row[4] is None else row[4], row[5])
        for row in rows
    ]


def _by_free(pool: Pool, *, most_free: bool):
    """The pool's schedulable instances annotated with their free memory, in the order ``choose`` ranks
    them by the policy (most free first for ``spread``, least for ``binpack``; the id breaks ties)."""
    free = Coalesce(F("capacity_mb"), Value(pool.memory_budget_mb)) - F("reserved_mb")
    rows = schedulable_instances(pool).annotate(free=free)
    return rows.order_by("-free" if most_free else "free", "pk")


# How many instances a decision reads beyond the replicas it places and the alternatives it shows: enough
# that the instances a choice needs are among them unless hosts are nearly full (then it reads them all).
RANKED_MARGIN = 32


def _choose_in(pool: Pool, **intent) -> tuple[Choice, list[Candidate]]:
    """Lock the pool and choose in it; returns the choice and the candidates it was made on.

    A model's replica needs the same memory everywhere, so only a prefix of the pool's instances in the
    policy's order can be chosen (``_by_free``): the decision reads that prefix - those that fit, and for
    the alternatives shown the most free - not the pool's 1,600 rows. The choice on the prefix is the one
    on the whole pool whenever every replica was placed and, if a host had to be shared, no instance was
    left out; otherwise the whole pool is read and the choice made again (the reason then names the
    largest free instance, and ``make_room`` sees every instance). An ensemble's need differs by instance:
    it always reads the whole pool."""
    Pool.objects.select_for_update().filter(pk=pool.pk).values_list("pk", flat=True).first()
    if intent["need_of"] is None:
        binpack = pool.placement_policy == PlacementPolicy.BINPACK
        limit = intent["count"] + ALTERNATIVES_SHOWN + RANKED_MARGIN
        ranked = _by_free(pool, most_free=not binpack)
        if binpack:
            ranked = ranked.filter(free__gte=intent["need_mb"])
        # With spread=host, whether each replica gets a host of its own depends on how many hosts the
        # whole pool has: counted in the same statement.
        hosts = Subquery(
            schedulable_instances(pool).order_by().annotate(one=Value(1)).values("one")
            .annotate(n=Count("host_id", distinct=True)).values("n")
        )  # fmt: skip
        rows = ranked.annotate(hosts=hosts, part=Value(0))[: limit + 1].values_list(*CANDIDATE_FIELDS)
        if binpack:
            # The alternatives shown are the most free instances; a binpack prefix holds the least free
            # that fit: both read in one statement.
            most = _by_free(pool, most_free=True).annotate(hosts=Value(None, IntegerField()), part=Value(1))
            most = most[: intent["count"] + ALTERNATIVES_SHOWN].values_list(*CANDIDATE_FIELDS)
            if connection.features.supports_slicing_ordering_in_compound:
                rows = rows.union(most, all=True)
            else:  # SQLite (the embedded default): two statements
                rows = [*rows, *most]
        rows = list(rows)
        prefix = _as_candidates(pool, [row for row in rows if row[7] == 0])
        # The order the policy ranks them in (a compound statement's parts come in no promised order).
        sign = 1 if binpack else -1
        prefix.sort(key=lambda c: (sign * (c.capacity_mb - c.used_mb), c.instance_id))
        prefix, cut = prefix[:limit], len(prefix) > limit
        hosts_in_pool = next((row[6] for row in rows if row[7] == 0), 0)
        choice = choose(prefix, **intent, hosts_in_pool=hosts_in_pool)
        if not choice.reason and not (choice.shared_host and (cut or binpack)):
            if binpack:
                most_free_rows = _as_candidates(pool, [row for row in rows if row[7] == 1])
                choice.alternatives = _most_free_after(most_free_rows, choice.chosen)
            return choice, prefix
    candidates = candidates_in(pool, lock=False)
    return choose(candidates, **intent), candidates


def _most_free_after(rows: list[Candidate], chosen: list[Candidate]) -> list[dict]:
    """The alternatives a choice shows - the pool's instances with the most free memory once its replicas
    are placed - from the most free before it (``rows``): what the chosen ones took counted."""
    taken = {c.instance_id: c for c in chosen}
    rows = [taken.get(c.instance_id, c) for c in rows]
    return [c.as_dict() for c in heapq.nlargest(ALTERNATIVES_SHOWN, rows, key=most_free)]


def pools_for(deployment: Deployment) -> list[Pool]:
    """The deployment's pool, or every pool its team may use: the team's dedicated pools first."""
    if deployment.pool_id is not None:
        return [deployment.pool]
    return list(Pool.objects.usable_by_team(deployment.team).order_by(F("team").asc(nulls_last=True), "name"))


def counted(deployment: Deployment):
    """The placements that count as replicas: not being replaced, not unloaded."""
    return deployment.placements.filter(retiring_reason="").exclude(state=PlacementState.UNLOADED)


# --- Decisions (the caller holds the deployment's row lock, inside its transaction) ----------------------


# Asked when a pool has no room: (deployment, pool, its candidates as the decision left them, memory one
# replica needs, the room it may count on) -> a note for the pending reason.
# ``apps.deployments.autoscaling.make_room`` evicts idle replicas of scale-to-zero deployments there; what
# they free counts once their hosts report them unloaded.
MakeRoom = Callable[[Deployment, Pool, list[Candidate], int, Ledger], str]


def place_replicas(deployment: Deployment, *, make_room: MakeRoom | None = None) -> list[DeploymentInstance]:
    """Place the replicas the deployment lacks. Returns the placements decided, for the caller to hand to
    their hosts once committed (``enqueue``). A handful of queries whatever the count: the deployment's
    placements, the need, per pool its lock and its candidates with their reserved memory (one query), then
    the rows and events written in bulk. ``make_room``: asked when a pool has no room (eviction)."""
    if deployment.pinned or deployment.state in GONE:
        return []
    rows = list(
        deployment.placements.values_list(
            "pk", "instance_id", "instance__host_id", "retiring_reason", "state"
        )
    )
    existing = {instance_id: pk for pk, instance_id, _, _, _ in rows}
    holding = {instance_id for _, instance_id, _, _, state in rows if state != PlacementState.UNLOADED}
    current = [(instance_id, host_id) for _, instance_id, host_id, retiring, state in rows
               if not retiring and state != PlacementState.UNLOADED]  # fmt: skip
    missing = deployment.replicas - len(current)
    if missing <= 0:
        _set_pending(deployment, "")
        return []
    held = replica_held_mb(deployment)
    need = held or 1
    steps = ensemble_placing.ensemble_steps(deployment)
    needs: dict[int, int] = {}
    taken_hosts = {host_id for _, host_id in current}
    taken_instances = {instance_id for instance_id, _ in current}
    decided: list[tuple[Candidate, Pool, Choice]] = []
    reasons = []
    pools = pools_for(deployment)
    for pool in pools:
        need_of = ensemble_placing.need_with_steps(steps, need, pool) if steps is not None else None
        intent = dict(
            need_mb=need,
            count=missing - len(decided),
            spread=deployment.spread,
            replicas=deployment.replicas,
            taken_hosts=taken_hosts,
            taken_instances=taken_instances,
            pool_name=pool.name,
            policy=pool.placement_policy,
            need_of=need_of,
        )
        choice, candidates = _choose_in(pool, **intent)
        ledger = None
        if choice.reason or room.waiting_in(pool).exclude(pk=deployment.pk).exists():
            # Others wait for room here: the room they are owed is not this deployment's (``room``).
            everything = candidates_in(pool, lock=False)
            ledger = room.ledger(deployment, pool, everything)
            if ledger.held:  # chosen again on what is left, the whole pool read
                candidates = ledger.free_for(everything)
                choice = choose(candidates, **intent)
        for candidate in choice.chosen:
            needs[candidate.instance_id] = need_of(candidate) if need_of else need
            decided.append((candidate, pool, choice))
            taken_hosts.add(candidate.host_id)
            taken_instances.add(candidate.instance_id)
        if choice.reason:
            reasons.append(choice.reason)
            if ledger is not None and ledger.held:
                reasons.append(f"{gib(sum(ledger.held.values()))} free is held for replicas waiting longer")
            if make_room is not None:
                note = make_room(deployment, pool, candidates, need, ledger)
                reasons.extend([note] if note else [])
        if len(decided) == missing:
            break
    if not pools:
        reasons.append(
            f"team {deployment.team.slug} may use no pool (staff create one: POST /api/v1/pools/ or the hosts "
            "page); or deploy on chosen instances"
        )
    placements = _create_placements(deployment, decided, needs, existing)
    # What the new replicas hold is added to their instances' reserved memory, where no placement of the
    # deployment held it already (a retired one placed again before it unloaded). An increment, not
    # ``refresh_reserved``: exact because the deployment's row lock (held by the caller) orders this with
    # every report on its placements, and the UPDATE applies to the row as the last writer left it.
    adding = sorted(c.instance_id for c, _, _ in decided if c.instance_id not in holding)
    if held and adding:
        if len(adding) > 1:
            # Rows locked in id order, as ``refresh_reserved`` locks them: two transactions never wait on
            # each other's instances (one UPDATE locks its rows in the order it finds them).
            list(TritonInstance.objects.select_for_update(no_key=True).filter(pk__in=adding).order_by("pk")
                 .values_list("pk", flat=True))  # fmt: skip
        TritonInstance.objects.filter(pk__in=adding).update(reserved_mb=F("reserved_mb") + held)
    if steps is not None:
        placements += ensemble_placing.place_steps_with(
            deployment, decided, steps, all_placed=lambda step_deployment: _set_pending(step_deployment, "")
        )
    still = missing - len(decided)
    reason = f"{still} of {deployment.replicas} replica(s) pending: {'; '.join(reasons)}" if still else ""
    _set_pending(deployment, reason, need_mb=need)
    if decided and deployment.state == DeploymentState.PENDING:
        deployment.state = DeploymentState.DEPLOYING
        deployment.save(update_fields=["state", "updated_at"])
    return placements


def _create_placements(
    deployment: Deployment,
    decided: list[tuple[Candidate, Pool, Choice]],
    needs: dict[int, int],
    existing: dict[int, int],
) -> list[DeploymentInstance]:
    """The rows and events of the decisions, written in bulk (``needs``: what each chosen instance gave,
    by instance id). A replica placed again where an earlier one was retired reuses its row (one row per
    instance)."""
    if not decided:
        return []
    reused = [existing[c.instance_id] for c, _, _ in decided if c.instance_id in existing]
    if reused:
        # Out of the gateway's rotation until its agent reports it serving again: the row may be one whose
        # model is being unloaded right now (woken again just after it was drained).
        DeploymentInstance.objects.filter(pk__in=reused).update(
            generation=F("generation") + 1,
            state=PlacementState.PENDING,
            served_version=None,
            retiring_reason="",
            unload=False,
            draining_since=None,
            evicted_for=None,
            last_error="",
        )
    created = DeploymentInstance.objects.bulk_create(
        DeploymentInstance(deployment=deployment, instance_id=c.instance_id)
        for c, _, _ in decided
        if c.instance_id not in existing
    )
    DeploymentEvent.objects.bulk_create(
        DeploymentEvent(
            deployment=deployment,
            kind="placed",
            message=(
                f"replica placed on {candidate.label} in {pool.name} ({POLICY_WORDS[pool.placement_policy]}): "
                f"needs {gib(need)}, {gib(candidate.free_mb + need)} was free"
            ),
            instance_id=candidate.instance_id,
            details={
                "pool": pool.name,
                "policy": pool.placement_policy,
                "need_mb": need,
                "free_mb_before": candidate.free_mb + need,
                "capacity_mb": candidate.capacity_mb,
                "alternatives": choice.alternatives,
            },
        )
        for candidate, pool, choice in decided
        for need in [needs[candidate.instance_id]]
    )
    pks = reused + [p.pk for p in created]
    return list(DeploymentInstance.objects.filter(pk__in=pks).select_related("instance__host").order_by("pk"))


# --- An ensemble and its steps: moved together -----------------------------------------------------------
# Placed together by ``apps.deployments.ensemble_placing``; moving an ensemble's replica (a lost host, a
# drain) retires its steps' replicas on the same instance with it (``retire``), and a step's replica under a
# live ensemble replica is never released or removed.


def _retire_steps_with(ensemble: Deployment, placements: list[DeploymentInstance], reason: str) -> list:
    """An ensemble's replicas being replaced take their steps' replicas on the same instances with them,
    unless another ensemble replica that stays there calls the step. Returns the step placements retired."""
    instance_ids = {p.instance_id for p in placements}
    model_ids = ensembles.step_model_ids_of(ensemble)
    step_deployments = list(
        Deployment.objects.select_for_update()
        .filter(model_id__in=model_ids, pinned=False)
        .exclude(state__in=GONE)
        .order_by("pk")
    )
    retired = []
    for step_deployment in step_deployments:
        staying = ensembles.instances_calling(step_deployment.model_id, instance_ids, counted_only=True)
        rows = list(
            counted(step_deployment)
            .filter(instance_id__in=instance_ids - staying)
            .select_related("instance__host")
        )
        if rows:
            retire(step_deployment, rows, f"moves with ensemble {ensemble.model.slug}'s replica: {reason}")
            retired += rows
    return retired


def end_wait(deployment: Deployment) -> list[str]:
    """A wait for room that ended without its replicas (the deployment went to sleep and is woken again, a
    new wait beginning): clear it. Returns the fields to save."""
    if deployment.pending_reason:
        _release_claims(deployment)
    deployment.pending_reason, deployment.waiting_since = "", None
    return ["pending_reason", "waiting_since"]


def _release_claims(deployment: Deployment) -> None:
    """Its wait is over: room evicted for it and not taken is nobody's now (``room``), and a later wait of
    this deployment does not count on it."""
    DeploymentInstance.objects.filter(evicted_for=deployment).update(evicted_for=None)


def _set_pending(deployment: Deployment, reason: str, **details) -> None:
    """Record why replicas are pending; an event only when the reason changes (the beat retries often)."""
    if reason == deployment.pending_reason:
        return
    fields = ["pending_reason", "updated_at"]
    if not reason or not deployment.pending_reason or deployment.waiting_since is None:
        # A wait begins (or ends); a reason that changes while it waits keeps the replica's turn.
        deployment.waiting_since = timezone.now() if reason else None
        fields.append("waiting_since")
    if not reason and deployment.pending_reason:
        _release_claims(deployment)
    deployment.pending_reason = reason
    if reason and not deployment.placements.exists() and deployment.state == DeploymentState.DEPLOYING:
        deployment.state = DeploymentState.PENDING
        fields.append("state")
    deployment.save(update_fields=fields)
    if reason:
        deployment.events.create(kind="unschedulable", message=reason, details=details)
    else:
        deployment.events.create(kind="scheduled", message=f"all {deployment.replicas} replica(s) placed")


def retire(deployment: Deployment, placements: list[DeploymentInstance], reason: str) -> list:
    """These replicas are to be replaced (their host is lost, revoked or draining, or their instance is
    quarantined): they stop counting, and stay loaded until their replacements serve (``release_retired``).
    An ensemble's replicas take their steps' replicas on the same instances along (``_retire_steps_with``);
    returns those step placements (their deployments' states follow from them)."""
    for placement in placements:
        DeploymentInstance.objects.filter(pk=placement.pk).update(retiring_reason=reason[:200])
        deployment.events.create(
            kind="replica_lost",
            message=f"replica on {placement.instance} is replaced: {reason}",
            instance_id=placement.instance_id,
            details={"reason": reason},
        )
    if placements and deployment.model.is_ensemble():
        return _retire_steps_with(deployment, placements, reason)
    return []


def release_retired(deployment: Deployment) -> list[DeploymentInstance]:
    """Once the deployment has its replicas READY elsewhere, its retired replicas are told to unload (a host
    that comes back then drops its surplus). Returns the placements decided, for ``enqueue``."""
    retired = list(
        deployment.placements.exclude(retiring_reason="")
        .filter(unload=False)
        .exclude(state=PlacementState.UNLOADED)
        .select_related("instance__host")
    )
    if not retired:
        return []
    ready = counted(deployment).filter(state=PlacementState.READY).count()
    if ready < deployment.replicas:
        return []
    # A step's replica stays loaded while an ensemble replica on its instance (being replaced too) calls it.
    calling = ensembles.instances_calling(deployment.model_id, {p.instance_id for p in retired})
    retired = [p for p in retired if p.instance_id not in calling]
    if not retired:
        return []
    pks = [p.pk for p in retired]
    draining.tell_to_unload(pks)
    for placement in retired:
        deployment.events.create(
            kind="replica_removed",
            message=f"{ready} replica(s) serve elsewhere: unloading the one on {placement.instance}",
            instance_id=placement.instance_id,
            details={"reason": placement.retiring_reason},
        )
    return list(DeploymentInstance.objects.filter(pk__in=pks).select_related("instance__host"))


def remove_replicas(
    deployment: Deployment, keep: int, reason: str, *, evicted_for: Deployment | None = None
) -> list[DeploymentInstance]:
    """Scaling down: the replicas beyond ``keep`` leave the rotation and unload - those not serving yet first,
    then the newest. Their memory counts until their agents report them unloaded. Returns the placements
    decided, for ``enqueue``."""
    current = list(counted(deployment))
    # A step's replica that an ensemble replica on its instance calls is not removed from under it.
    calling = ensembles.instances_calling(deployment.model_id, {p.instance_id for p in current})
    removable = [p for p in current if p.instance_id not in calling]
    surplus = sorted(removable, key=lambda p: (p.state == PlacementState.READY, -p.pk))[
        : max(0, len(current) - keep)
    ]
    pks = [p.pk for p in surplus]
    draining.tell_to_unload(pks, retiring_reason=reason[:200], evicted_for=evicted_for)
    removed = list(DeploymentInstance.objects.filter(pk__in=pks).select_related("instance__host"))
    for placement in removed:
        deployment.events.create(
            kind="replica_removed",
            message=f"unloading the replica on {placement.instance}: {reason}",
            instance_id=placement.instance_id,
            details={"reason": reason},
        )
    return removed


def enqueue(placements: Iterable[DeploymentInstance]) -> None:
    """After commit: the placements' hosts fetch the new decisions on their next desired-state poll."""
    notify_hosts({placement.instance.host_id for placement in placements})


# --- Reading for the pages --------------------------------------------------------------------------------


def instance_usage(instances: Iterable[TritonInstance]) -> dict[int, dict]:
    """Per instance: capacity (its own, else its host's pool's CPU budget; None outside any pool), the memory
    its live placements hold, and what is free - the figures a decision reads (``reserved_mb``)."""
    instances = list(instances)
    used = {i.pk: i.reserved_mb for i in instances}
    budgets = dict(
        Pool.objects.filter(hosts__instances__in=[i.pk for i in instances]).values_list("hosts__instances", "memory_budget_mb")
    )  # fmt: skip
    usage = {}
    for i in instances:
        capacity = i.capacity_mb if i.capacity_mb is not None else budgets.get(i.pk)
        held = used.get(i.pk, 0)
        usage[i.pk] = {
            "capacity_mb": capacity,
            "used_mb": held,
            "free_mb": None if capacity is None else capacity - held,
        }
    return usage
