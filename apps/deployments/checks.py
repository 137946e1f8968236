"""The checks a deploy, a switch or a rollout makes before anything is written (``check_*`` only read; the
writes are ``apps.deployments.services``'). Each failure is a ValidationError naming the field to fix."""

from __future__ import annotations

from django.core.exceptions import ValidationError

from apps.deployments.models import ACTIVE_STATES, Deployment, DeploymentInstance, Rollout
from apps.fleet.models import TritonInstance
from apps.registry.models import ModelVersion, RegisteredModel


def check_version_servable(version: ModelVersion) -> None:
    if version.is_archived():
        raise ValidationError({"version": [f"{version} is archived; restore it to deploy it."]})
    if not version.is_servable():
        raise ValidationError(
            {
                "version": [
                    f"{version} is {version.state}; only READY versions can be deployed (convert it first)."
                ]
            }
        )


def lock_servable(version: ModelVersion) -> None:
    """Lock the version's row and check it again: archive and delete lock it first too (then the model's
    deployments), so a version archived or deleted meanwhile is refused instead of deployed."""
    check_version_servable(ModelVersion.objects.select_for_update().get(pk=version.pk))


def check_instances_usable(team, instances: list[TritonInstance]) -> None:
    if not instances:
        raise ValidationError({"instances": ["Pick at least one instance to deploy on."]})
    for instance in instances:
        if instance.host.team_id not in (None, team.pk):
            raise ValidationError({"instances": [f"{instance} is dedicated to another team."]})


def check_quota(team, model: RegisteredModel, instances: list[TritonInstance], replicas: int = 0) -> None:
    """Models deployed at once, and instances in use: a pinned deployment's instances, a scheduled one's
    replicas (each takes an instance)."""
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
        DeploymentInstance.objects.filter(deployment__in=live.filter(pinned=True)).values_list(
            "instance_id", flat=True
        )
    ) | {instance.pk for instance in instances}
    scheduled = sum(live.filter(pinned=False).values_list("replicas", flat=True))
    if len(used) + scheduled + replicas > team.quota_instances:
        field = "replicas" if replicas else "instances"
        raise ValidationError(
            {
                field: [
                    f"Team quota exceeded: {team.name} may use {team.quota_instances} instances; this would use "
                    f"{len(used) + scheduled + replicas}."
                ]
            }
        )


def check_no_live_rollout(deployment: Deployment) -> None:
    rollout = Rollout.objects.live().filter(deployment=deployment).select_related("canary_version").first()
    if rollout is not None:
        raise ValidationError(
            {
                "non_field_errors": [
                    f"A rollout of {rollout.canary_version} is {rollout.state}; promote or abort it first."
                ]
            }
        )
