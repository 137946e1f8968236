"""Deploy, switch and undeploy. The platform decides; each host's agent applies the placements on its
instances (``hostagent.placement``) and reports back (``apps.deployments.reports``, which settles the
deployment's state here: ``settle_locked``).

The owner of ``Deployment``, ``DeploymentInstance`` (placements) and ``DeploymentEvent`` rows, with the
scheduler's decisions and the agents' reports beside it: signal receivers, the rollout state machine and
other apps call the functions here. ``Rollout`` and ``RolloutAnalysis`` rows are written by the rollout
state machine's owner, ``apps.deployments.rollouts``, which builds on this module; what ends a rollout here
(an undeploy; in ``reports``, a canary that fails to load) is announced with a signal
(``apps.deployments.signals``) that the rollouts answer. Checked by ``tests/deployments/test_one_writer.py``.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import F, Q

from apps.audit.services import record
from apps.deployments import draining, ensembles, reserved, scheduler
from apps.deployments.checks import (
    check_instances_usable,
    check_no_live_rollout,
    check_quota,
    check_version_servable,
    lock_servable,
)
from apps.deployments.ensembles import check_no_ensemble_depends, check_steps_served
from apps.deployments.models import (
    Deployment,
    DeploymentInstance,
    DeploymentState,
    PlacementState,
    Rollout,
    Spread,
)
from apps.deployments.signals import deployment_created, deployment_undeploying
from apps.fleet.models import Pool, TritonInstance
from apps.fleet.services import notify_hosts
from apps.registry.models import ModelVersion, RegisteredModel


def _enqueue(placements: Iterable[DeploymentInstance]) -> None:
    """Hand each placement's latest decision to its host's agent: the host's desired generation goes up, and
    its agent's next poll of the desired state (within a second) fetches the decision with its generation."""
    notify_hosts({placement.instance.host_id for placement in placements})


def _decide(placements: list[DeploymentInstance], **fields) -> list[DeploymentInstance]:
    """Record a new decision on placements: bump their generation (older agent reports become stale).
    Returns the placements re-read with their new generation, for ``_enqueue``."""
    pks = [p.pk for p in placements]
    DeploymentInstance.objects.filter(pk__in=pks).update(generation=F("generation") + 1, **fields)
    if "state" in fields:
        # An unloaded placement set PENDING holds memory again (and a switch's target just began to count).
        reserved.refresh_reserved(p.instance_id for p in placements)
    return list(DeploymentInstance.objects.filter(pk__in=pks).select_related("instance__host"))


def deploy_version(
    *,
    actor,
    model: RegisteredModel,
    version: ModelVersion,
    instances: list[TritonInstance] | None = None,
    replicas: int = 1,
    pool: Pool | None = None,
    spread: str = Spread.HOST,
) -> Deployment:
    """Deploy a READY version of a model (the model must not be deployed already): on ``instances`` picked
    by hand (pinned), or else as ``replicas`` the scheduler places in ``pool`` (None: any pool the team may
    use) - a replica that fits nowhere yet leaves the deployment PENDING with the reason."""
    if version.model_id != model.pk:
        raise ValidationError({"version": [f"{version} is not a version of {model}."]})
    check_version_servable(version)
    pinned = bool(instances)
    if pinned:
        check_instances_usable(model.team, instances)
    else:
        scheduler.check_intent(model.team, replicas=replicas, pool=pool, spread=spread)
        if model.is_ensemble():
            # Triton runs an ensemble inside the server of its steps: the scheduler places each replica
            # where its steps serve, or places the steps it lacks there with it.
            ensembles.check_steps_deployed(version)
    with transaction.atomic():
        lock_servable(version)
        if (
            Deployment.objects.select_for_update()
            .filter(model=model)
            .exclude(state=DeploymentState.UNDEPLOYED)
            .exists()
        ):
            raise ValidationError(
                {"model": [f"{model} is already deployed; switch its version or undeploy it first."]}
            )
        check_quota(model.team, model, instances or [], 0 if pinned else replicas)
        staged = stage_steps(check_steps_served(version, instances)) if pinned else []
        deployment = Deployment.objects.create(
            team=model.team,
            model=model,
            target_version=version,
            state=DeploymentState.DEPLOYING if pinned else DeploymentState.PENDING,
            created_by=actor,
            pinned=pinned,
            replicas=len(instances) if pinned else replicas,
            pool=pool,
            spread=spread,
        )
        where = ", ".join(map(str, instances)) if pinned else f"{replicas} replica(s) in {pool or 'any pool'}"
        deployment.events.create(
            kind="deploy_requested", message=f"deploy {version} on {where}", version=version
        )
        if pinned:
            placements = [
                DeploymentInstance.objects.create(deployment=deployment, instance=i) for i in instances
            ]
            reserved.refresh_reserved(i.pk for i in instances)
        else:
            placements = scheduler.place_replicas(deployment)
        record(
            actor=actor,
            team=model.team,
            action="deployment.created",
            target=deployment,
            details={"version": version.number, "instances": [str(i) for i in instances or []],
                     "replicas": deployment.replicas, "pool": getattr(pool, "name", None)},
        )  # fmt: skip
        deployment_created.send(sender=Deployment, deployment=deployment, actor=actor)
        transaction.on_commit(lambda: _enqueue([*placements, *staged]))
    return deployment


def switch_version(*, actor, deployment: Deployment, version: ModelVersion) -> Deployment:
    """Roll out another READY version; the old one keeps serving until the new one passed its smoke test."""
    if version.model_id != deployment.model_id:
        raise ValidationError({"version": [f"{version} is not a version of {deployment.model}."]})
    check_version_servable(version)
    with transaction.atomic():
        lock_servable(version)
        deployment = Deployment.objects.select_for_update().get(pk=deployment.pk)
        if deployment.state not in (DeploymentState.SERVING, DeploymentState.FAILED):
            raise ValidationError(
                {"non_field_errors": [f"The deployment is {deployment.state}; wait until it is SERVING."]}
            )
        if version == deployment.active_version:
            raise ValidationError({"version": [f"{version} is already the served version."]})
        check_no_live_rollout(deployment)
        instances = [p.instance for p in deployment.placements.select_related("instance")]
        staged = stage_steps(check_steps_served(version, instances))
        check_no_ensemble_depends(deployment, "switched", keep=version)
        _begin_switch(actor, deployment, version, f"switch to {version}", staged)
    return deployment


def _begin_switch(actor, deployment: Deployment, version: ModelVersion, message: str, also=()) -> None:
    """The switch's writes (the caller holds the deployment's row lock and has checked it may switch)."""
    deployment.target_version = version
    deployment.state = DeploymentState.SWITCHING if deployment.active_version else DeploymentState.DEPLOYING
    deployment.last_error = ""
    deployment.save(update_fields=["target_version", "state", "last_error", "updated_at"])
    placements = _decide(list(deployment.placements.all()), state=PlacementState.PENDING, last_error="")
    deployment.events.create(kind="switch_requested", message=message, version=version)
    record(
        actor=actor,
        team=deployment.team,
        action="deployment.switch",
        target=deployment,
        details={"from": getattr(deployment.active_version, "number", None), "to": version.number},
    )
    transaction.on_commit(lambda: _enqueue([*placements, *also]))


def stage_steps(step_deployments: list[Deployment]) -> list[DeploymentInstance]:
    """A new decision on the placements of step deployments that get a companion version (an ensemble
    version being deployed, switched or rolled out calls it): their agents load it beside the served one.
    States unchanged; the caller enqueues the result once committed."""
    placements = []
    for deployment in step_deployments:
        placements += _decide(list(deployment.placements.exclude(state=PlacementState.UNLOADED)))
    return placements


def follow_ensemble_steps() -> int:
    """Step deployments follow the ensembles calling them: once every live ensemble calls a companion version
    and none the step's own, the step switches to it (the old version unloads; the companion loaded and
    answered beside it already); a companion no live ensemble calls any more is unloaded. Returns the step
    deployments decided. Run after an ensemble's deployment settles, and by the rollouts' beat."""
    decided = 0
    for pk in ensembles.step_deployments_to_follow():
        with transaction.atomic():
            deployment = Deployment.objects.select_for_update().get(pk=pk)
            if deployment.state != DeploymentState.SERVING or deployment.target_version_id:
                continue
            if Rollout.objects.live().filter(deployment=deployment).exists():
                continue
            pinned = ensembles.pinned_step_versions(deployment.model_id)
            others = set(pinned) - {deployment.active_version_id}
            if pinned and deployment.active_version_id not in pinned and len(others) == 1:
                version = ModelVersion.objects.get(pk=others.pop())
                _begin_switch(
                    None,
                    deployment,
                    version,
                    f"switch to {version}: the ensembles calling {deployment.model.slug} moved to it",
                )
                decided += 1
                continue
            if Rollout.objects.filter(deployment=deployment, canary_unload_at__isnull=False).exists():
                continue  # an ended rollout's canary: the rollouts unload it
            # Only a decision the agent has applied: a companion being unloaded is not decided again.
            beside = deployment.placements.exclude(state=PlacementState.UNLOADED).filter(
                canary_version__isnull=False, applied_generation=F("generation")
            )
            if beside.exclude(canary_version_id__in=list(pinned)).exists():
                placements = redecide(deployment)
                record_event(deployment, "companion_unloaded", "no live ensemble calls the version beside it")
                transaction.on_commit(lambda placements=placements: _enqueue(placements))
                decided += 1
    return decided


def undeploy(*, actor, deployment: Deployment) -> Deployment:
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().get(pk=deployment.pk)
        if deployment.state in (DeploymentState.UNDEPLOYING, DeploymentState.UNDEPLOYED):
            return deployment
        check_no_ensemble_depends(deployment, "undeployed")
        deployment.state = DeploymentState.UNDEPLOYING
        deployment.save(update_fields=["state", "updated_at"])
        # Its live rollout is aborted (apps.deployments.rollouts answers, inside this transaction).
        deployment_undeploying.send(sender=Deployment, deployment=deployment, actor=actor)
        # Drain, then unload: the gateway drops its route and servers at its next sync, but a replica it routes
        # to is handed to its agent only once its requests in flight finished (apps.deployments.draining);
        # the others are unloaded at once. UNDEPLOYED once every replica reports unloaded (``_settle``).
        pks = list(deployment.placements.values_list("pk", flat=True))
        draining.tell_to_unload(pks)
        placements = list(DeploymentInstance.objects.filter(pk__in=pks).select_related("instance__host"))
        deployment.events.create(kind="undeploy_requested", message="undeploy")
        record(actor=actor, team=deployment.team, action="deployment.undeploy", target=deployment)
        if not placements:
            deployment.state = DeploymentState.UNDEPLOYED
            deployment.save(update_fields=["state", "updated_at"])
        transaction.on_commit(lambda: _enqueue(placements))
    return deployment


def placement_finished(placement: DeploymentInstance) -> None:
    """A placement changed (an agent finished it, or it lost its model): advance the deployment."""
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().get(pk=placement.deployment_id)
        _settle(deployment)


def settle_locked(deployment: Deployment) -> None:
    """``placement_finished`` for a deployment whose row the caller has locked in its transaction (an agent's
    report, ``apps.deployments.reports``; the beat, having moved its replicas): its state follows from its
    placements."""
    _settle(deployment)


def _settle(deployment: Deployment) -> None:
    """Derive the deployment's state from its placements. The caller holds the deployment's row lock.

    Most reports change nothing here (others are still loading, or the deployment already serves): that is
    decided from the placements' states alone, and the placements are read in full (instances and hosts, for
    the messages) only when the deployment's state changes - every report of a deploy waits for this lock."""
    if deployment.state == DeploymentState.UNDEPLOYED:
        return
    if deployment.state == DeploymentState.UNDEPLOYING:
        if set(deployment.placements.values_list("state", flat=True)) <= {PlacementState.UNLOADED}:
            deployment.state = DeploymentState.UNDEPLOYED
            deployment.save(update_fields=["state", "updated_at"])
            deployment.events.create(kind="undeployed", message="undeployed from every instance")
        return
    rows = list(_replicas(deployment).order_by().values_list("state", "served_version_id"))
    states = {state for state, _ in rows}
    if not rows:
        return  # nothing placed (yet): the scheduler keeps it PENDING with the reason
    if deployment.target_version_id is None:
        _follow_placements(deployment, rows)
        return
    if states & {PlacementState.PENDING, PlacementState.LOADING}:
        return
    # The state changes: the same checks on the placements read in full (a started or waiting report, which
    # takes no lock, may have landed since).
    placements = _placements_in_full(deployment)
    if {p.state for p in placements} & {PlacementState.PENDING, PlacementState.LOADING}:
        return
    target = deployment.target_version
    if deployment.model.is_ensemble():
        # Its steps follow it: a companion it no longer needs unloads, a step it moved switches.
        transaction.on_commit(follow_ensemble_steps)
    if all(p.state == PlacementState.READY and p.served_version_id == target.pk for p in placements):
        switched = deployment.active_version is not None
        deployment.active_version, deployment.target_version = target, None
        deployment.state, deployment.last_error = DeploymentState.SERVING, ""
        deployment.save(
            update_fields=["active_version", "target_version", "state", "last_error", "updated_at"]
        )
        if switched:
            reserved.refresh_reserved_of([deployment.pk])  # the old version no longer counts
        deployment.events.create(
            kind="switched" if switched else "deployed",
            message=f"{target} serves on every instance",
            version=target,
        )
        return
    errors = "; ".join(
        f"{p.instance}: {p.last_error}" for p in placements if p.state == PlacementState.FAILED
    )
    deployment.target_version, deployment.last_error = None, errors
    if deployment.active_version is not None:
        # The old version still serves where the switch failed (the agent reports served_version only while
        # Triton serves it); instances that already switched, or lost the old version, go back to it.
        deployment.state = DeploymentState.SERVING
        back = [p for p in placements if p.served_version_id != deployment.active_version_id]
        kept = [p.pk for p in placements if p.state == PlacementState.FAILED and p not in back]
        DeploymentInstance.objects.filter(pk__in=kept).update(state=PlacementState.READY)
        back = _decide(back, state=PlacementState.PENDING)
        deployment.events.create(
            kind="switch_failed",
            message=f"switch to {target} failed, {deployment.active_version} keeps serving: {errors}",
            version=target,
        )
        deployment.save(update_fields=["target_version", "last_error", "state", "updated_at"])
        reserved.refresh_reserved_of([deployment.pk])  # the failed target no longer counts
        transaction.on_commit(lambda: _enqueue(back))
        rows = list(_replicas(deployment).order_by().values_list("state", "served_version_id"))
        _follow_placements(deployment, rows)
        return
    deployment.state = DeploymentState.FAILED
    deployment.events.create(
        kind="deploy_failed", message=f"deploying {target} failed: {errors}", version=target
    )
    deployment.save(update_fields=["target_version", "last_error", "state", "updated_at"])
    reserved.refresh_reserved_of([deployment.pk])  # the failed target no longer counts


def _replicas(deployment: Deployment):
    """The placements a deployment's state follows: not those being replaced (``scheduler.retire``)."""
    return deployment.placements.filter(retiring_reason="")


def _placements_in_full(deployment: Deployment) -> list[DeploymentInstance]:
    return list(_replicas(deployment).select_related("instance__host"))


def _follow_state(active_id: int, rows: list[tuple[str, int | None]]) -> DeploymentState:
    if any(state == PlacementState.READY and served == active_id for state, served in rows):
        return DeploymentState.SERVING
    if any(state in (PlacementState.PENDING, PlacementState.LOADING) for state, _ in rows):
        return DeploymentState.DEPLOYING
    return DeploymentState.FAILED


def _follow_placements(deployment: Deployment, rows: list[tuple[str, int | None]]) -> None:
    """No rollout in flight: SERVING while at least one placement serves the active version, else DEPLOYING
    while one is being (re)loaded, else FAILED with the placements' errors. ``rows`` are the placements'
    (state, served_version_id); they are read in full (for the messages) only when the state changes."""
    active_id = deployment.active_version_id
    if active_id is None or _follow_state(active_id, rows) == deployment.state:
        return
    placements = _placements_in_full(deployment)
    state = _follow_state(active_id, [(p.state, p.served_version_id) for p in placements])
    if state == deployment.state:
        return
    active = deployment.active_version
    ready = [p for p in placements if p.state == PlacementState.READY and p.served_version_id == active.pk]
    was_serving = deployment.state == DeploymentState.SERVING
    deployment.state = state
    if state == DeploymentState.SERVING:
        deployment.last_error = ""
        message = f"{active} serves again on {', '.join(str(p.instance) for p in ready)}"
        deployment.events.create(kind="serving", message=message, version=active)
    else:
        errors = "; ".join(f"{p.instance}: {p.last_error}" for p in placements if p.last_error)
        deployment.last_error = errors or f"{active} is not loaded on any instance"
        if was_serving:
            deployment.events.create(
                kind="not_serving",
                message=f"{active} is not ready on any instance: {deployment.last_error}",
                version=active,
            )
    deployment.save(update_fields=["state", "last_error", "updated_at"])


def live_deployments_on(instance: TritonInstance):
    return Deployment.objects.filter(~Q(state=DeploymentState.UNDEPLOYED), placements__instance=instance)


# --- For the rollout state machine (apps.deployments.rollouts): what a rollout does to its deployment.


def record_event(
    deployment: Deployment, kind: str, message: str, *, version=None, details: dict | None = None
) -> None:
    """One step of the deployment's history, for a step that is not this module's own (a rollout's)."""
    deployment.events.create(kind=kind, message=message, version=version, details=details or {})


def redecide(deployment: Deployment) -> list[DeploymentInstance]:
    """A new decision on the deployment's placements but the unloaded ones, states unchanged (a rollout
    started: load the canary beside the stable version). The caller holds the deployment's row lock and
    hands the result to ``_enqueue`` once committed."""
    return _decide(list(deployment.placements.exclude(state=PlacementState.UNLOADED)))


def promote(deployment: Deployment, version: ModelVersion) -> list[DeploymentInstance]:
    """A rollout's canary becomes the served version: the switch, every placement told to serve ``version``
    alone. The caller holds the deployment's row lock, has checked it SERVING, and hands the result to
    ``_enqueue`` once committed."""
    deployment.target_version, deployment.state, deployment.last_error = (
        version,
        DeploymentState.SWITCHING,
        "",
    )
    deployment.save(update_fields=["target_version", "state", "last_error", "updated_at"])
    return _decide(list(deployment.placements.all()), state=PlacementState.PENDING, last_error="")


def serve_stable_alone(deployment_id: int) -> int:
    """An ended rollout's canary gets no traffic any more: a new decision on the placements, so their agents
    serve the stable version alone. Returns the placements decided (0: undeployed, or a new rollout started
    meanwhile and its own decision placed what it needs). Inside the caller's transaction."""
    deployment = Deployment.objects.select_for_update().get(pk=deployment_id)
    if deployment.state in (DeploymentState.UNDEPLOYING, DeploymentState.UNDEPLOYED):
        return 0
    if Rollout.objects.live().filter(deployment=deployment).exists():
        return 0
    # Every placement, not only those reporting the canary: one may be loading it right now (its report
    # then comes for an older generation and is dropped; the new decision takes the canary out).
    placements = redecide(deployment)
    transaction.on_commit(lambda: _enqueue(placements))
    if deployment.model.is_ensemble():
        transaction.on_commit(follow_ensemble_steps)
    return len(placements)


# --- For the registry (apps.deployments.receivers answers its signals): versions and models that go.


def release_version(version: ModelVersion) -> None:
    """Undeployed deployments and unloaded placements keep their last version for display only; they let go
    of a version being deleted (their events and the audit log still name it)."""
    done = Deployment.objects.filter(model_id=version.model_id, state=DeploymentState.UNDEPLOYED)
    done.filter(active_version_id=version.pk).update(active_version=None)
    done.filter(target_version_id=version.pk).update(target_version=None)
    DeploymentInstance.objects.filter(served_version_id=version.pk).filter(
        state=PlacementState.UNLOADED
    ).update(served_version=None)
    DeploymentInstance.objects.filter(
        served_version_id=version.pk, deployment__state=DeploymentState.UNDEPLOYED
    ).update(served_version=None)
    DeploymentInstance.objects.filter(canary_version_id=version.pk).filter(
        Q(state=PlacementState.UNLOADED) | Q(deployment__state=DeploymentState.UNDEPLOYED)
    ).update(canary_version=None)


def delete_history(model: RegisteredModel) -> list[int]:
    """A model being deleted takes its ended deployments with it: their placements, events, rollouts and
    analyses (the audit log keeps what they did). The registry has checked, with the model's versions and
    live deployments locked, that none is live; one that is would keep its versions and fail the delete.
    Returns the ids of the deployments removed."""
    ended = Deployment.objects.filter(model_id=model.pk, state=DeploymentState.UNDEPLOYED).order_by("pk")
    removed = list(ended.values_list("pk", flat=True))
    ended.delete()
    return removed
