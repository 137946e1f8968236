"""Steps of the deployment state machine as an agent's reports would drive them (no agent process)."""

from __future__ import annotations

from apps.deployments import reports, services
from apps.deployments.models import Deployment, DeploymentInstance, DeploymentState, PlacementState, Rollout


def finish(deployment: Deployment, instance, **fields) -> Deployment:
    placement = DeploymentInstance.objects.get(deployment=deployment, instance=instance)
    DeploymentInstance.objects.filter(pk=placement.pk).update(**fields)
    placement.refresh_from_db()
    services.placement_finished(placement)
    return Deployment.objects.get(pk=deployment.pk)


def serving(owner, version, instances) -> Deployment:
    deployment = services.deploy_version(
        actor=owner, model=version.model, version=version, instances=list(instances)
    )
    for instance in instances:
        deployment = finish(deployment, instance, state=PlacementState.READY, served_version=version)
    assert deployment.state == DeploymentState.SERVING
    return deployment


def report_canary(rollout: Rollout) -> None:
    for placement in rollout.deployment.placements.all():
        reports.placement_canary_loaded(
            placement.pk, placement.generation, rollout.stable_version, rollout.canary_version
        )
