"""The scheduler: where a deployment's replicas run. The one module that decides placements by intent.

A deployment that is not pinned asks for ``replicas`` in a pool (or any pool its team may use). Each instance
has a capacity (``TritonInstance.capacity_mb``: an NPU's HBM minus a reserve, a CPU instance's memory budget,
by default its pool's) and each placed version a footprint (``ModelVersion.footprint_estimate_mb``: measured
by the agent at first load, else estimated from the artifact). A replica goes only where it fits, on the
instance with the most free memory; with ``spread=host`` at most one replica per host while the pool has
enough hosts. What cannot be placed stays pending with the reason, and the beat (``apps.deployments.healing``)
tries again.

Concurrency: the pool's row is locked (``SELECT ... FOR UPDATE``; pools in one order: a team's dedicated ones
first, then by name) before its instances' used memory is summed, so two deploys into one pool are
serialized and never overcommit an instance.

Writes: placements it creates, retires or releases, the deployment's ``pending_reason`` and PENDING <->
DEPLOYING, and one event per decision with its inputs - an owner beside ``apps.deployments.services``
(``tests/deployments/test_one_writer.py``), because a placement's creation *is* the decision. It never settles
a deployment's state from its placements' reports: that stays with ``services``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db.models import Case, F, IntegerField, Q, Sum, Value, When
from django.db.models.functions import Cast, Ceil, Coalesce
from django.utils import timezone

from apps.deployments import draining, ensembles
from apps.deployments.models import (
    Deployment,
    DeploymentEvent,
    DeploymentInstance,
    DeploymentState,
    PlacementState,
    Spread,
)
from apps.fleet.models import DesiredInstanceState, InstanceState, PlacementPolicy, Pool, TritonInstance
from apps.fleet.services import notify_hosts
from apps.registry.models import FOOTPRINT_BASE_MB, FOOTPRINT_MARGIN, ModelVersion

GONE = (DeploymentState.UNDEPLOYING, DeploymentState.UNDEPLOYED)
ALTERNATIVES_SHOWN = 5
POLICY_WORDS = {
    PlacementPolicy.SPREAD: "policy spread: the least loaded instance that fits",
    PlacementPolicy.BINPACK: "policy binpack: the most loaded instance that still fits",
}


def grace() -> timedelta:
    """A host unheard of for longer is lost: no new replicas, and its replicas are placed elsewhere."""
    return timedelta(seconds=settings.SCHEDULER_HOST_GRACE_S)


def gib(mb: int) -> str:
    return f"{mb / 1024:.1f} GiB"


@dataclass
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
) -> Choice:
    """Pick ``count`` instances for replicas of ``need_mb`` each. Pure: ``candidates`` are updated in place
    (their used memory grows by what was placed), nothing is read or written. ``taken_*``: where the
    deployment's other replicas run (never two on one instance; with spread=host, one per host while the
    pool has at least ``replicas`` hosts). ``need_of``: what a replica needs on that instance when it
    differs by instance (an ensemble: itself, plus the steps not placed there yet; None: it cannot go
    there); instances needing no more than ``need_mb`` come first."""
    hosts, instances = set(taken_hosts), set(taken_instances)
    strict = spread == Spread.HOST and len({c.host_id for c in candidates}) >= replicas
    chosen: list[Candidate] = []
    reason = ""

    def need(c: Candidate) -> int | None:
        return need_mb if need_of is None else need_of(c)

    for _ in range(count):
        open_ = [c for c in candidates if c.instance_id not in instances]
        if strict:
            open_ = [c for c in open_ if c.host_id not in hosts]
        fits = [c for c in open_ if need(c) is not None and c.free_mb >= need(c)]
        if not fits:
            reason = _why_not(open_, candidates, need_mb, pool_name, strict, need_of)
            break
        # With spread=host, a host without a replica first; then an instance that needs nothing placed
        # beside the replica (an ensemble's steps already there); then by the pool's policy - ``spread``: the
        # least loaded (most free), ``binpack``: the most loaded that still fits (least free); the id breaks
        # ties.
        sign = 1 if policy == PlacementPolicy.BINPACK else -1
        best = min(
            fits, key=lambda c: (c.host_id in hosts, need(c) > need_mb, sign * c.free_mb, c.instance_id)
        )
        best.used_mb += need(best)
        hosts.add(best.host_id)
        instances.add(best.instance_id)
        chosen.append(best)
    ranked = sorted(candidates, key=lambda c: -c.free_mb)[:ALTERNATIVES_SHOWN]
    return Choice(chosen, reason, [c.as_dict() for c in ranked])


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


def check_intent(team, *, replicas: int, pool: Pool | None, spread: str) -> None:
    """What a deployment asks the scheduler for is possible to ask: a 400 naming the field otherwise."""
    limit = settings.SCHEDULER_MAX_REPLICAS
    if not (isinstance(replicas, int) and 1 <= replicas <= limit):
        raise ValidationError({"replicas": [f"Ask for 1 to {limit} replicas (got {replicas})."]})
    if pool is not None and pool.team_id not in (None, team.pk):
        raise ValidationError({"pool": [f"Team {team.slug} may not use pool '{pool.name}'."]})
    if spread not in Spread.values:
        raise ValidationError({"spread": [f"'{spread}' is not a spread; use {' or '.join(Spread.values)}."]})


# --- Reading the fleet --------------------------------------------------------------------------------


def footprints(version_ids: Iterable[int]) -> dict[int, int]:
    ids = {pk for pk in version_ids if pk}
    rows = ModelVersion.objects.filter(pk__in=ids).only("pk", "footprint_mb", "size_bytes")
    return {v.pk: v.footprint_estimate_mb() for v in rows}


def deployment_need_mb(deployment: Deployment) -> int:
    """What one replica holds: the served version, plus the target during a switch (both are loaded)."""
    sizes = footprints([deployment.active_version_id, deployment.target_version_id])
    return sum(sizes.values()) or 1


def _footprint_sql(version: str):
    """``ModelVersion.footprint_estimate_mb`` of the version at the path ``version``, in SQL (0 for none)."""
    estimate = Value(FOOTPRINT_BASE_MB) + Cast(
        Ceil(F(f"{version}__size_bytes") * FOOTPRINT_MARGIN / 2**20), IntegerField()
    )
    return Case(
        When(**{f"{version}__footprint_mb__gt": 0}, then=F(f"{version}__footprint_mb")),
        When(**{f"{version}__isnull": False}, then=estimate),
        default=Value(0),
        output_field=IntegerField(),
    )


def used_mb_sql(placements: str = "placements"):
    """The memory an instance's live placements hold (retiring ones too: they hold it until unloaded), as one
    SQL aggregate over the relation ``placements`` of the rows annotated: per placement its deployment's
    served version, plus the target during a switch (both are loaded). The same sum as ``deployment_need_mb``
    per replica, so a decision never reads more than one query for its whole pool."""
    deployment = f"{placements}__deployment"
    target = Case(
        When(
            **{f"{deployment}__target_version": F(f"{deployment}__active_version")},
            then=Value(0),
        ),
        default=_footprint_sql(f"{deployment}__target_version"),
        output_field=IntegerField(),
    )
    live = Q(**{f"{placements}__isnull": False}) & ~Q(**{f"{placements}__state": PlacementState.UNLOADED})
    live &= ~Q(**{f"{deployment}__state": DeploymentState.UNDEPLOYED})
    return Coalesce(
        Sum(_footprint_sql(f"{deployment}__active_version") + target, filter=live),
        Value(0),
        output_field=IntegerField(),
    )


def used_by_instance(instance_ids: list[int] | None = None, *, pool: Pool | None = None) -> dict[int, int]:
    """Memory the live placements on these instances (or the pool's) hold (``used_mb_sql``)."""
    where = Q(host__pool=pool) if pool is not None else Q(pk__in=instance_ids or [])
    rows = TritonInstance.objects.filter(where).annotate(used=used_mb_sql()).values_list("pk", "used")
    return {pk: used for pk, used in rows if used}


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
    # Only the columns a decision reads: a pool of 1,600 instances is read on every decision.
    # Only the columns a decision reads, and the memory each instance's placements hold summed by the
    # database: a pool of 1,600 instances is read on every decision, in one query.
    instances = schedulable_instances(pool).annotate(used=used_mb_sql())
    rows = instances.values_list("pk", "host_id", "host__name", "name", "capacity_mb", "used")
    return [
        Candidate(
            instance_id=pk,
            host_id=host_id,
            label=f"{host_name}/{name}",  # as str(instance)
            capacity_mb=capacity if capacity is not None else pool.memory_budget_mb,
            used_mb=used,
        )
        for pk, host_id, host_name, name, capacity, used in rows
    ]


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
# replica needs) -> a note for the pending reason. ``apps.deployments.autoscaling.make_room`` evicts idle
# replicas of scale-to-zero deployments there; what they free counts once their hosts report them unloaded.
MakeRoom = Callable[[Deployment, Pool, list[Candidate], int], str]


def place_replicas(deployment: Deployment, *, make_room: MakeRoom | None = None) -> list[DeploymentInstance]:
    """Place the replicas the deployment lacks. Returns the placements decided, for the caller to hand to
    their hosts once committed (``enqueue``). A handful of queries whatever the count: the deployment's
    placements, the need, per pool its lock and its candidates with their used memory (one aggregate), then
    the rows and events written in bulk. ``make_room``: asked when a pool has no room (eviction)."""
    if deployment.pinned or deployment.state in GONE:
        return []
    rows = list(
        deployment.placements.values_list(
            "pk", "instance_id", "instance__host_id", "retiring_reason", "state"
        )
    )
    existing = {instance_id: pk for pk, instance_id, _, _, _ in rows}
    current = [(instance_id, host_id) for _, instance_id, host_id, retiring, state in rows
               if not retiring and state != PlacementState.UNLOADED]  # fmt: skip
    missing = deployment.replicas - len(current)
    if missing <= 0:
        _set_pending(deployment, "")
        return []
    need = deployment_need_mb(deployment)
    steps = _ensemble_steps(deployment)
    needs: dict[int, int] = {}
    taken_hosts = {host_id for _, host_id in current}
    taken_instances = {instance_id for instance_id, _ in current}
    decided: list[tuple[Candidate, Pool, Choice]] = []
    reasons = []
    pools = pools_for(deployment)
    for pool in pools:
        candidates = candidates_in(pool, lock=True)
        need_of = _need_with_steps(steps, need, pool) if steps is not None else None
        choice = choose(
            candidates,
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
        for candidate in choice.chosen:
            needs[candidate.instance_id] = need_of(candidate) if need_of else need
            decided.append((candidate, pool, choice))
            taken_hosts.add(candidate.host_id)
            taken_instances.add(candidate.instance_id)
        if choice.reason:
            reasons.append(choice.reason)
            if make_room is not None:
                note = make_room(deployment, pool, candidates, need)
                reasons.extend([note] if note else [])
        if len(decided) == missing:
            break
    if not pools:
        reasons.append(
            f"team {deployment.team.slug} may use no pool (staff create one: POST /api/v1/pools/ or the hosts "
            "page); or deploy on chosen instances"
        )
    placements = _create_placements(deployment, decided, needs, existing)
    if steps is not None:
        placements += _place_steps_with(deployment, decided, steps)
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


# --- An ensemble and its steps: placed together, moved together --------------------------------------------
# Triton runs an ensemble inside one server, calling its steps there: an ensemble's replica goes only where
# every step version it calls is placed, or where the steps it lacks can be placed with it (the memory of
# all of them checked together); those steps' deployments then get a replica there - filling replicas they
# lack first (a lost host's), else one more replica each. Moving one (a lost host, a drain) moves them
# together (``retire``), and a step's replica under a live ensemble replica is never released or removed.


def _ensemble_steps(deployment: Deployment) -> list[ensembles.StepPlacing] | None:
    """None for a model; for an ensemble, its version's steps with their deployments, row-locked (after the
    ensemble's own lock, which the caller holds: always ensemble, then its steps by id)."""
    if not deployment.model.is_ensemble():
        return None
    version = deployment.target_version or deployment.active_version
    model_ids = set(version.ensemble_steps.values_list("step_version__model_id", flat=True))
    list(
        Deployment.objects.select_for_update()
        .filter(model_id__in=model_ids)
        .exclude(state__in=GONE)
        .order_by("pk")
        .values_list("pk", flat=True)
    )
    return ensembles.steps_for_placing(version)


def _need_with_steps(
    steps: list[ensembles.StepPlacing], base_mb: int, pool: Pool
) -> Callable[[Candidate], int | None]:
    """What an ensemble replica needs on an instance: itself, a pinned step version beside a step's own
    where the step is placed, a whole replica of each step where it is not (None where one cannot go)."""

    def need_of(candidate: Candidate) -> int | None:
        total = base_mb
        for step in steps:
            if candidate.instance_id in step.placed:
                total += step.companion_mb
            elif step.addable_in(pool.pk):
                total += step.new_mb
            else:
                return None
        return total

    return need_of


def _place_steps_with(
    ensemble: Deployment, decided: list[tuple[Candidate, Pool, Choice]], steps: list[ensembles.StepPlacing]
) -> list[DeploymentInstance]:
    """The steps' side of an ensemble's placement: a replica of each step it lacks on each chosen instance,
    and a new decision where a step serves another version there (its agent loads the pinned one beside).
    Returns the placements decided, for ``enqueue``."""
    decided_rows: list[DeploymentInstance] = []
    for candidate, pool, _ in decided:
        for step in steps:
            step_deployment = step.deployment
            if candidate.instance_id in step.placed:
                if step.companion_mb:
                    rows = step_deployment.placements.filter(
                        instance_id=candidate.instance_id, retiring_reason=""
                    )
                    pks = list(rows.values_list("pk", flat=True))
                    DeploymentInstance.objects.filter(pk__in=pks).update(generation=F("generation") + 1)
                    decided_rows += DeploymentInstance.objects.filter(pk__in=pks).select_related(
                        "instance__host"
                    )
                continue
            decided_rows += _add_step_replica(ensemble, step, candidate, pool)
            step.placed.add(candidate.instance_id)
    return decided_rows


def _add_step_replica(
    ensemble: Deployment, step: ensembles.StepPlacing, candidate: Candidate, pool: Pool
) -> list[DeploymentInstance]:
    step_deployment = step.deployment
    row = step_deployment.placements.filter(instance_id=candidate.instance_id).first()
    if row is not None:
        DeploymentInstance.objects.filter(pk=row.pk).update(
            generation=F("generation") + 1,
            state=PlacementState.PENDING,
            retiring_reason="",
            unload=False,
            draining_since=None,
            evicted_for=None,
            last_error="",
        )
    else:
        row = DeploymentInstance.objects.create(deployment=step_deployment, instance_id=candidate.instance_id)
    grew = ""
    if step.short > 0:
        step.short -= 1  # a replica it lacked (its own was on a lost or drained instance)
    else:
        before = step_deployment.replicas
        step_deployment.replicas = before + 1
        step_deployment.save(update_fields=["replicas", "updated_at"])
        grew = f"; its replicas {before} -> {step_deployment.replicas}"
    if step_deployment.state == DeploymentState.PENDING:
        step_deployment.state = DeploymentState.DEPLOYING
        step_deployment.save(update_fields=["state", "updated_at"])
    step_deployment.events.create(
        kind="placed",
        message=(
            f"replica placed on {candidate.label} in {pool.name} with a replica of ensemble "
            f"{ensemble.model.slug}, which calls {step.pinned} there: needs {gib(step.new_mb)}{grew}"
        ),
        instance_id=candidate.instance_id,
        details={
            "pool": pool.name,
            "ensemble": ensemble.pk,
            "ensemble_model": ensemble.model.slug,
            "step": step.position,
            "need_mb": step.new_mb,
            "instance_free_mb_after": candidate.free_mb,
            "capacity_mb": candidate.capacity_mb,
            "replicas": step_deployment.replicas,
        },
    )
    if step.short == 0:
        _set_pending(step_deployment, "")
    return list(DeploymentInstance.objects.filter(pk=row.pk).select_related("instance__host"))


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


def _set_pending(deployment: Deployment, reason: str, **details) -> None:
    """Record why replicas are pending; an event only when the reason changes (the beat retries often)."""
    if reason == deployment.pending_reason:
        return
    deployment.pending_reason = reason
    fields = ["pending_reason", "updated_at"]
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


def lost_placements(now=None) -> dict[int, list[tuple[int, str]]]:
    """Replicas of scheduled deployments whose instance can no longer serve them, per deployment:
    [(placement id, why)]. A host unheard of past the grace, a revoked host, a quarantined instance."""
    now = now or timezone.now()
    rows = (
        DeploymentInstance.objects.filter(retiring_reason="", deployment__pinned=False)
        .exclude(state=PlacementState.UNLOADED)
        .exclude(deployment__state__in=GONE)
        .filter(
            Q(instance__host__revoked_at__isnull=False)
            | Q(instance__host__last_heartbeat_at__lt=now - grace())
            | Q(instance__host__last_heartbeat_at__isnull=True)
            | Q(instance__state=InstanceState.QUARANTINED)
        )
        .values_list(
            "pk", "deployment_id", "instance__host__name", "instance__host__revoked_at",
            "instance__host__last_heartbeat_at", "instance__state",
        )
    )  # fmt: skip
    found: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for pk, deployment_id, host, revoked, beat, state in rows:
        if revoked is not None:
            why = f"host {host} was revoked"
        elif beat is None or beat < now - grace():
            why = f"host {host} sent no heartbeat for more than {settings.SCHEDULER_HOST_GRACE_S} s"
        else:
            why = f"its instance is {state}"
        found[deployment_id].append((pk, why))
    return found


# --- Reading for the pages --------------------------------------------------------------------------------


def instance_usage(instances: Iterable[TritonInstance]) -> dict[int, dict]:
    """Per instance: capacity (its own, else its host's pool's CPU budget; None outside any pool), the memory
    its live placements hold, and what is free - the figures a decision would read."""
    instances = list(instances)
    used = used_by_instance([i.pk for i in instances])
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
