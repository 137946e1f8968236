"""Reports from host agents: what a placement's agent did with its latest decision - started, waiting,
loaded, failed, unloaded, lost, a canary loaded or failed beside the stable version - and what one loaded copy
of a version measured. ``apps.deployments.agent_api`` hands each report here; the agent's side is
``hostagent.reports``, whose methods are named after these functions.

Each report carries the generation of the decision it applied; one for an older generation is dropped (returns
False), so a stale task, retry or reconcile never undoes a newer one. A report that changes what a placement
serves settles its deployment in the same transaction, under the deployment's row lock
(``services.settle_locked``).

Writes: the placement reported on and its event - an owner beside ``apps.deployments.services``
(``tests/deployments/test_one_writer.py``); what the deployment's state becomes stays with ``services``.
"""

from __future__ import annotations

from django.db import transaction
from django.db.models import F, Q

from apps.deployments import reserved, services
from apps.deployments.models import Deployment, DeploymentInstance, PlacementState
from apps.deployments.signals import canary_failed
from apps.registry.models import ModelVersion
from apps.registry.services import record_footprint


def _report(
    placement_id: int, generation: int, *, where: Q | None = None, **fields
) -> tuple[Deployment, int] | None:
    """Conditionally update a placement for ``generation``; returns its locked deployment and the placement's
    instance id (for the event), or None when stale. The caller runs inside ``transaction.atomic()``."""
    ids = (
        DeploymentInstance.objects.filter(pk=placement_id)
        .values_list("deployment_id", "instance_id", "state")
        .first()
    )
    if ids is None:
        return None
    deployment_id, instance_id, state = ids
    # The deployment's row lock first, as ``services.switch_version`` and ``undeploy`` take it: a decision and
    # a report on the same deployment are serialized.
    deployment = Deployment.objects.select_for_update().get(pk=deployment_id)
    rows = DeploymentInstance.objects.filter(pk=placement_id, generation=generation)
    if where is not None:
        rows = rows.filter(where)
    if rows.update(**fields) != 1:
        return None
    if PlacementState.UNLOADED in (state, fields.get("state")):
        reserved.refresh_reserved([instance_id])  # the placement stopped (or started) holding memory
    return deployment, instance_id


def _report_progress(placement_id: int, generation: int, **fields) -> bool:
    """A report that neither settles the deployment nor writes an event (started, waiting): the conditional
    UPDATE alone. It needs no deployment row lock: a decision bumps the generation in an UPDATE of the same
    row, so PostgreSQL re-checks ``generation`` after that decision commits and a stale report matches
    nothing; and settling (``services``) counts PENDING and LOADING alike, so none can depend on the order."""
    return DeploymentInstance.objects.filter(pk=placement_id, generation=generation).update(**fields) == 1


def _placement_event(deployment, instance_id: int, kind: str, message: str, version=None, **details):
    deployment.events.create(
        kind=kind, message=message, instance_id=instance_id, version=version, details=details
    )


def placement_started(placement_id: int, generation: int) -> bool:
    """The agent starts loading the placement's decision."""
    return _report_progress(placement_id, generation, state=PlacementState.LOADING)


def placement_waiting(placement_id: int, generation: int, message: str) -> bool:
    """The agent cannot apply the decision yet (its instance is not running); reconcile applies it later."""
    return _report_progress(placement_id, generation, last_error=message)


def placement_loaded(
    placement_id: int,
    generation: int,
    version: ModelVersion,
    *,
    kind: str | None = "serving",
    message: str = "",
    canary: ModelVersion | None = None,
) -> bool:
    """Triton reports ``version`` ready for this placement (and ``canary`` beside it during a rollout; None
    when it serves ``version`` alone): READY, and the decision is applied."""
    with transaction.atomic():
        reported = _report(
            placement_id,
            generation,
            state=PlacementState.READY,
            served_version=version,
            canary_version=canary,
            last_error="",
            applied_generation=generation,
        )
        if reported is None:
            return False
        deployment, instance_id = reported
        if kind:
            _placement_event(deployment, instance_id, kind, message, version=version)
        services.settle_locked(deployment)
        if canary is None and deployment.model.is_ensemble():
            # An ensemble version it no longer serves here (an ended rollout's canary, an old version after
            # a switch) no longer calls its steps: a companion only it called can unload.
            transaction.on_commit(services.follow_ensemble_steps)
        return True


def placement_failed(
    placement_id: int,
    generation: int,
    error: str,
    *,
    version: ModelVersion,
    still_serving: ModelVersion | None,
    kind: str = "load_failed",
    message: str = "",
) -> bool:
    """Loading ``version`` failed; ``still_serving`` is what Triton still serves there (None: nothing)."""
    with transaction.atomic():
        reported = _report(
            placement_id,
            generation,
            state=PlacementState.FAILED,
            served_version=still_serving,
            last_error=error,
            applied_generation=generation,
        )
        if reported is None:
            return False
        deployment, instance_id = reported
        _placement_event(deployment, instance_id, kind, message or error, version=version)
        services.settle_locked(deployment)
        return True


def placement_unloaded(placement_id: int, generation: int, message: str) -> bool:
    with transaction.atomic():
        reported = _report(
            placement_id,
            generation,
            state=PlacementState.UNLOADED,
            served_version=None,
            canary_version=None,
            last_error="",
            applied_generation=generation,
        )
        if reported is None:
            return False
        deployment, instance_id = reported
        _placement_event(deployment, instance_id, "unloaded", message)
        services.settle_locked(deployment)
        return True


def placement_lost(placement_id: int, generation: int, reason: str, *, reloading: bool) -> bool:
    """Triton does not report the placement's served version ready: LOADING while the agent reloads it, or
    FAILED with the reason. Only for an applied decision (in-flight work reports for itself); repeated
    reports of the same failure write nothing."""
    state = PlacementState.LOADING if reloading else PlacementState.FAILED
    with transaction.atomic():
        reported = _report(
            placement_id,
            generation,
            where=Q(applied_generation=F("generation")) & ~Q(state=state, last_error=reason),
            state=state,
            last_error=reason,
        )
        if reported is None:
            return False
        deployment, instance_id = reported
        _placement_event(deployment, instance_id, "reloading" if reloading else "lost", reason)
        services.settle_locked(deployment)
        return True


def placement_canary_loaded(
    placement_id: int, generation: int, stable: ModelVersion, canary: ModelVersion, *, message: str = ""
) -> bool:
    """Triton serves ``stable`` and ``canary`` side by side on this placement. The rollout's weight leaves 0
    once every READY placement reports its canary (the beat task, ``apps.deployments.rollouts``)."""
    return placement_loaded(
        placement_id,
        generation,
        stable,
        kind="canary_loaded" if message else None,
        message=message,
        canary=canary,
    )


def placement_canary_failed(
    placement_id: int,
    generation: int,
    error: str,
    *,
    canary: ModelVersion,
    still_serving: ModelVersion | None,
) -> bool:
    """Loading the canary beside the stable version failed (load or smoke test): the stable version keeps
    serving there and the rollout is rolled back - a canary that does not load everywhere gets no traffic."""
    with transaction.atomic():
        reported = _report(
            placement_id,
            generation,
            state=PlacementState.READY if still_serving else PlacementState.FAILED,
            served_version=still_serving,
            canary_version=None,
            last_error="" if still_serving else error,
            applied_generation=generation,
        )
        if reported is None:
            return False
        deployment, instance_id = reported
        _placement_event(deployment, instance_id, "canary_failed", error, version=canary)
        # Its rollout is rolled back (apps.deployments.rollouts answers, inside this transaction).
        canary_failed.send(sender=Deployment, deployment=deployment, canary=canary, error=error)
        services.settle_locked(deployment)
        return True


def footprint_measured(version_id: int, footprint_mb: int) -> bool:
    """An agent measured what one loaded copy of the version takes: recorded on its first load only
    (``apps.registry.services.record_footprint``), and the instances holding it reserve the measured figure
    instead of the estimate from then on."""
    with transaction.atomic():
        recorded = record_footprint(version_id, footprint_mb)
        if recorded:
            reserved.footprint_changed(version_id)
    return recorded
