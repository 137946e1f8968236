"""What deployments say to the registry when a version or a model is about to go (apps.registry.signals), and
how the rollout state machine hears what ends a rollout (apps.deployments.signals).

Receivers only read, lock and answer; the rows they change are changed by their owners
(``apps.deployments.services`` for deployments and placements, ``apps.deployments.rollouts`` for rollouts).
"""

from __future__ import annotations

from django.db.models import Q
from django.dispatch import receiver

from apps.deployments import rollouts, services
from apps.deployments.models import Deployment, DeploymentState, PlacementState, Rollout
from apps.deployments.signals import canary_failed, deployment_undeploying
from apps.registry.signals import (
    VersionUse,
    model_deleting,
    model_retiring,
    serving_version,
    version_deleting,
    version_retiring,
)


@receiver(version_retiring, dispatch_uid="deployments-version-in-use")
def deployments_using_version(sender, version, action, **kwargs) -> list[VersionUse]:
    """A live deployment's served or target version, or a version an instance still serves, is in use.
    The model's live deployments are locked, so a switch cannot start while the version is retired."""
    uses: list[VersionUse] = []
    live = (
        Deployment.objects.select_for_update()
        .filter(model_id=version.model_id)
        .exclude(state=DeploymentState.UNDEPLOYED)
        .order_by("pk")
    )
    for deployment in live:
        state = deployment.get_state_display().lower()
        rollout = Rollout.objects.live().filter(deployment=deployment).first()
        if rollout is not None and version.pk in (rollout.canary_version_id, rollout.stable_version_id):
            role = "canary" if rollout.canary_version_id == version.pk else "stable version"
            uses.append(
                VersionUse(
                    f"deployment #{deployment.pk} is rolling it out as its {role} ({rollout.state.lower()})",
                    "deployment",
                    deployment.pk,
                )
            )
        elif deployment.active_version_id == version.pk:
            uses.append(
                VersionUse(f"deployment #{deployment.pk} serves it ({state})", "deployment", deployment.pk)
            )
        elif deployment.target_version_id == version.pk:
            uses.append(
                VersionUse(
                    f"deployment #{deployment.pk} is rolling it out ({state})", "deployment", deployment.pk
                )
            )
        else:
            placed = (
                deployment.placements.filter(
                    Q(served_version_id=version.pk) | Q(canary_version_id=version.pk)
                )
                .exclude(state=PlacementState.UNLOADED)
                .select_related("instance")
            )
            for placement in placed:
                uses.append(
                    VersionUse(
                        f"instance {placement.instance} still serves it for deployment #{deployment.pk}",
                        "deployment",
                        deployment.pk,
                    )
                )
    return uses


@receiver(version_deleting, dispatch_uid="deployments-release-deleted-version")
def release_deleted_version(sender, version, **kwargs) -> None:
    services.release_version(version)


@receiver(model_retiring, dispatch_uid="deployments-model-in-use")
def deployments_of_model(sender, model, **kwargs) -> list[VersionUse]:
    """A model with a live deployment (anything but UNDEPLOYED: an undeploy in flight still has instances
    serving it) cannot be deleted; each one is named, to be undeployed first. They are locked, so none
    changes state while the model goes."""
    live = (
        Deployment.objects.select_for_update()
        .filter(model_id=model.pk)
        .exclude(state=DeploymentState.UNDEPLOYED)
        .order_by("pk")
    )
    return [
        VersionUse(f"deployment #{d.pk} ({d.get_state_display().lower()})", "deployment", d.pk) for d in live
    ]


@receiver(model_deleting, dispatch_uid="deployments-delete-model-history")
def delete_model_history(sender, model, **kwargs) -> dict:
    return {"deployments": services.delete_history(model)}


@receiver(deployment_undeploying, dispatch_uid="rollouts-end-with-deployment")
def end_rollout_of_undeployed(sender, deployment, actor, **kwargs) -> None:
    rollouts.end_with_deployment(deployment, actor=actor)


@receiver(canary_failed, dispatch_uid="rollouts-roll-back-failed-canary")
def roll_back_failed_canary(sender, deployment, canary, error, **kwargs) -> None:
    rollouts.roll_back_failed_canary(deployment, canary, error)


@receiver(serving_version, dispatch_uid="deployments-serving-version")
def version_serving(sender, model, **kwargs):
    """The version the model's live deployment serves (an ensemble step given as "the version serving")."""
    live = (
        Deployment.objects.filter(model=model, state__in=(DeploymentState.SERVING, DeploymentState.SWITCHING))
        .select_related("active_version")
        .first()
    )
    return live.active_version if live is not None else None
