"""Deploy, switch and undeploy. The platform decides; each host's agent applies the placements on its
instances (``apps.fleet.placement``) and reports back through ``placement_finished``."""

from __future__ import annotations

from collections.abc import Iterable

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q

from apps.audit.services import record
from apps.deployments.models import (
    ACTIVE_STATES,
    Deployment,
    DeploymentInstance,
    DeploymentState,
    PlacementState,
)
from apps.fleet.models import TritonInstance
from apps.registry.models import ModelVersion, RegisteredModel


def _enqueue(placements: Iterable[DeploymentInstance]) -> None:
    from apps.fleet.tasks import apply_placement

    for placement in placements:
        apply_placement.apply_async(args=[placement.pk], queue=placement.instance.host.queue)


def check_version_servable(version: ModelVersion) -> None:
    if not version.is_servable():
        raise ValidationError(
            {
                "version": [
                    f"{version} is {version.state}; only READY versions can be deployed (convert it first)."
                ]
            }
        )


def check_instances_usable(team, instances: list[TritonInstance]) -> None:
    if not instances:
        raise ValidationError({"instances": ["Pick at least one instance to deploy on."]})
    for instance in instances:
        if instance.host.team_id not in (None, team.pk):
            raise ValidationError({"instances": [f"{instance} is dedicated to another team."]})


def check_quota(team, model: RegisteredModel, instances: list[TritonInstance]) -> None:
    live = Deployment.objects.filter(team=team, state__in=ACTIVE_STATES).exclude(model=model)
    if live.count() + 1 > team.quota_deployed_models:
        raise ValidationError(
            {
                "non_field_errors": [
                    f"Team quota exceeded: {team.name} may deploy {team.quota_deployed_models} models at once; undeploy one first."
                ]
            }
        )
    used = set(
        DeploymentInstance.objects.filter(deployment__in=live).values_list("instance_id", flat=True)
    ) | {instance.pk for instance in instances}
    if len(used) > team.quota_instances:
        raise ValidationError(
            {
                "instances": [
                    f"Team quota exceeded: {team.name} may use {team.quota_instances} instances; this would use {len(used)}."
                ]
            }
        )


def deploy_version(
    *, actor, model: RegisteredModel, version: ModelVersion, instances: list[TritonInstance]
) -> Deployment:
    """Deploy a READY version of a model on instances (the model must not be deployed already)."""
    if version.model_id != model.pk:
        raise ValidationError({"version": [f"{version} is not a version of {model}."]})
    check_version_servable(version)
    check_instances_usable(model.team, instances)
    with transaction.atomic():
        if (
            Deployment.objects.select_for_update()
            .filter(model=model)
            .exclude(state=DeploymentState.UNDEPLOYED)
            .exists()
        ):
            raise ValidationError(
                {"model": [f"{model} is already deployed; switch its version or undeploy it first."]}
            )
        check_quota(model.team, model, instances)
        deployment = Deployment.objects.create(
            team=model.team,
            model=model,
            target_version=version,
            state=DeploymentState.DEPLOYING,
            created_by=actor,
        )
        placements = [DeploymentInstance.objects.create(deployment=deployment, instance=i) for i in instances]
        deployment.events.create(
            kind="deploy_requested",
            message=f"deploy {version} on {', '.join(map(str, instances))}",
            version=version,
        )
        record(
            actor=actor,
            team=model.team,
            action="deployment.created",
            target=deployment,
            details={"version": version.number, "instances": [str(i) for i in instances]},
        )
        transaction.on_commit(lambda: _enqueue(placements))
    return deployment


def switch_version(*, actor, deployment: Deployment, version: ModelVersion) -> Deployment:
    """Roll out another READY version; the old one keeps serving until the new one passed its smoke test."""
    if version.model_id != deployment.model_id:
        raise ValidationError({"version": [f"{version} is not a version of {deployment.model}."]})
    check_version_servable(version)
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().get(pk=deployment.pk)
        if deployment.state not in (DeploymentState.SERVING, DeploymentState.FAILED):
            raise ValidationError(
                {"non_field_errors": [f"The deployment is {deployment.state}; wait until it is SERVING."]}
            )
        if version == deployment.active_version:
            raise ValidationError({"version": [f"{version} is already the served version."]})
        deployment.target_version = version
        deployment.state = (
            DeploymentState.SWITCHING if deployment.active_version else DeploymentState.DEPLOYING
        )
        deployment.last_error = ""
        deployment.save(update_fields=["target_version", "state", "last_error", "updated_at"])
        placements = list(deployment.placements.select_related("instance__host"))
        DeploymentInstance.objects.filter(deployment=deployment).update(
            state=PlacementState.PENDING, last_error=""
        )
        deployment.events.create(kind="switch_requested", message=f"switch to {version}", version=version)
        record(
            actor=actor,
            team=deployment.team,
            action="deployment.switch",
            target=deployment,
            details={"from": getattr(deployment.active_version, "number", None), "to": version.number},
        )
        transaction.on_commit(lambda: _enqueue(placements))
    return deployment


def undeploy(*, actor, deployment: Deployment) -> Deployment:
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().get(pk=deployment.pk)
        if deployment.state in (DeploymentState.UNDEPLOYING, DeploymentState.UNDEPLOYED):
            return deployment
        deployment.state = DeploymentState.UNDEPLOYING
        deployment.save(update_fields=["state", "updated_at"])
        placements = list(deployment.placements.select_related("instance__host"))
        deployment.events.create(kind="undeploy_requested", message="undeploy")
        record(actor=actor, team=deployment.team, action="deployment.undeploy", target=deployment)
        if not placements:
            deployment.state = DeploymentState.UNDEPLOYED
            deployment.save(update_fields=["state", "updated_at"])
        transaction.on_commit(lambda: _enqueue(placements))
    return deployment


def placement_finished(placement: DeploymentInstance) -> None:
    """An agent finished a placement: advance the deployment when every placement has settled."""
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().get(pk=placement.deployment_id)
        placements = list(deployment.placements.select_related("instance__host"))
        states = {p.state for p in placements}
        if deployment.state == DeploymentState.UNDEPLOYING:
            if states <= {PlacementState.UNLOADED}:
                deployment.state = DeploymentState.UNDEPLOYED
                deployment.save(update_fields=["state", "updated_at"])
                deployment.events.create(kind="undeployed", message="undeployed from every instance")
            return
        target = deployment.target_version
        if target is None or states & {PlacementState.PENDING, PlacementState.LOADING}:
            return
        if all(p.state == PlacementState.READY and p.served_version_id == target.pk for p in placements):
            switched = deployment.active_version is not None
            deployment.active_version, deployment.target_version = target, None
            deployment.state, deployment.last_error = DeploymentState.SERVING, ""
            deployment.save(
                update_fields=["active_version", "target_version", "state", "last_error", "updated_at"]
            )
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
            # The old version still serves where the switch failed; instances that already switched go back.
            deployment.state = DeploymentState.SERVING
            back = [p for p in placements if p.served_version_id != deployment.active_version_id]
            kept = [p.pk for p in placements if p.state == PlacementState.FAILED and p not in back]
            DeploymentInstance.objects.filter(pk__in=kept).update(state=PlacementState.READY)
            DeploymentInstance.objects.filter(pk__in=[p.pk for p in back]).update(
                state=PlacementState.PENDING
            )
            deployment.events.create(
                kind="switch_failed",
                message=f"switch to {target} failed, {deployment.active_version} keeps serving: {errors}",
                version=target,
            )
            transaction.on_commit(lambda: _enqueue(back))
        else:
            deployment.state = DeploymentState.FAILED
            deployment.events.create(
                kind="deploy_failed", message=f"deploying {target} failed: {errors}", version=target
            )
        deployment.save(update_fields=["target_version", "last_error", "state", "updated_at"])


def live_deployments_on(instance: TritonInstance):
    return Deployment.objects.filter(~Q(state=DeploymentState.UNDEPLOYED), placements__instance=instance)
