"""What deployments say when a version is about to be archived or deleted (apps.registry.signals)."""

from __future__ import annotations

from django.db.models import Q
from django.dispatch import receiver

from apps.deployments.models import Deployment, DeploymentInstance, DeploymentState, PlacementState, Rollout
from apps.registry.signals import VersionUse, version_deleting, version_retiring


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
