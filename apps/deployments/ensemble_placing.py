"""An ensemble and its steps, placed together: the steps' side of the scheduler's decisions
(``apps.deployments.scheduler.place_replicas`` asks here for an ensemble's replicas).

Triton runs an ensemble inside one server, calling its steps there: an ensemble's replica goes only where
every step version it calls is placed, or where the steps it lacks can be placed with it (the memory of all
of them checked together); those steps' deployments then get a replica there - filling replicas they lack
first (a lost host's), else one more replica each. Moving one (a lost host, a drain) moves them together
(``scheduler.retire``), and a step's replica under a live ensemble replica is never released or removed
(``scheduler.release_retired``, ``scheduler.remove_replicas``).

Writes: the step placements decided with an ensemble's replica, a step deployment's replicas when it gets
one more and its PENDING -> DEPLOYING, and one event per step replica placed - an owner beside the scheduler
(``tests/deployments/test_one_writer.py``). A step deployment's pending reason stays the scheduler's: it is
told when a step lacks no replica any more (``all_placed``).
"""

from __future__ import annotations

from collections.abc import Callable

from django.db.models import F

from apps.deployments import ensembles
from apps.deployments.choice import Candidate, Choice, gib
from apps.deployments.models import Deployment, DeploymentInstance, DeploymentState, PlacementState
from apps.deployments.reserved import refresh_reserved
from apps.fleet.models import Pool

# Told of a step deployment that lacks no replica any more: the scheduler clears its pending reason (with
# its event) there and then, before the next step replica is placed.
AllPlaced = Callable[[Deployment], None]


def ensemble_steps(deployment: Deployment) -> list[ensembles.StepPlacing] | None:
    """None for a model; for an ensemble, its version's steps with their deployments, row-locked (after the
    ensemble's own lock, which the caller holds: always ensemble, then its steps by id)."""
    if not deployment.model.is_ensemble():
        return None
    version = deployment.target_version or deployment.active_version
    model_ids = set(version.ensemble_steps.values_list("step_version__model_id", flat=True))
    # The live step deployments, as ``steps_for_placing`` reads them (not undeploying, not undeployed).
    list(
        Deployment.objects.select_for_update()
        .filter(model_id__in=model_ids)
        .exclude(state__in=ensembles.LIVE)
        .order_by("pk")
        .values_list("pk", flat=True)
    )
    return ensembles.steps_for_placing(version)


def need_with_steps(
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


def place_steps_with(
    ensemble: Deployment,
    decided: list[tuple[Candidate, Pool, Choice]],
    steps: list[ensembles.StepPlacing],
    *,
    all_placed: AllPlaced,
) -> list[DeploymentInstance]:
    """The steps' side of an ensemble's placement: a replica of each step it lacks on each chosen instance,
    and a new decision where a step serves another version there (its agent loads the pinned one beside).
    Returns the placements decided, for ``scheduler.enqueue``."""
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
            decided_rows += _add_step_replica(ensemble, step, candidate, pool, all_placed)
            step.placed.add(candidate.instance_id)
    return decided_rows


def _add_step_replica(
    ensemble: Deployment,
    step: ensembles.StepPlacing,
    candidate: Candidate,
    pool: Pool,
    all_placed: AllPlaced,
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
    refresh_reserved([candidate.instance_id])
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
        all_placed(step_deployment)
    return list(DeploymentInstance.objects.filter(pk=row.pk).select_related("instance__host"))
