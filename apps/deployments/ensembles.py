"""What deploying an ensemble needs, and what its steps' deployments may no longer do alone.

Triton runs an ensemble inside one server, calling its steps there: an ensemble version can only be served on
instances where every step's pinned version is served (READY). So deploying or switching to an ensemble
version requires each step's live deployment to serve that version on each of those instances (400 naming the
step and the instance), and undeploying, switching or rolling out a step that a live ensemble deployment pins
is a 409 naming the ensembles (undeploy or switch the ensemble first).

Read-only checks; the deployments' rows are written by ``apps.deployments.services``.
"""

from __future__ import annotations

from django.core.exceptions import ValidationError

from apps.core.exceptions import Conflict
from apps.deployments.models import Deployment, DeploymentState, PlacementState
from apps.fleet.models import TritonInstance
from apps.registry.models import EnsembleStep, ModelVersion


def check_steps_served(version: ModelVersion, instances: list[TritonInstance]) -> None:
    """An ensemble version's steps must be served (READY, the pinned version) on every instance."""
    steps = list(version.ensemble_steps.select_related("step_version__model").order_by("position"))
    problems = []
    for step in steps:
        pinned = step.step_version
        deployment = (
            Deployment.objects.filter(model_id=pinned.model_id)
            .exclude(state=DeploymentState.UNDEPLOYED)
            .first()
        )
        ready = set()
        if deployment is not None and deployment.state not in (
            DeploymentState.UNDEPLOYING,
            DeploymentState.UNDEPLOYED,
        ):
            ready = set(
                deployment.placements.filter(state=PlacementState.READY, served_version=pinned).values_list(
                    "instance_id", flat=True
                )
            )
        missing = [str(i) for i in instances if i.pk not in ready]
        if missing:
            problems.append(
                f"step[{step.position}] ({pinned}) is not served on {', '.join(missing)}: deploy "
                f"{pinned.model.slug} version {pinned.number} there first (Triton runs an ensemble and its "
                "steps in one server)"
            )
    if problems:
        raise ValidationError({"steps": problems})


def ensembles_pinning(deployment: Deployment, keep: ModelVersion | None = None) -> list[str]:
    """The live ensemble deployments that call ``deployment``'s model (a version other than ``keep``)."""
    versions = set()
    for live in Deployment.objects.exclude(state__in=(DeploymentState.UNDEPLOYED,)).exclude(pk=deployment.pk):
        versions |= {v for v in (live.active_version_id, live.target_version_id) if v}
    steps = EnsembleStep.objects.filter(
        ensemble_version_id__in=versions, step_version__model_id=deployment.model_id
    ).select_related("ensemble_version__model", "step_version")
    if keep is not None:
        steps = steps.exclude(step_version=keep)
    return sorted({f"{s.ensemble_version.model.slug} (calls {s.step_version})" for s in steps})


def check_no_ensemble_depends(deployment: Deployment, action: str, keep: ModelVersion | None = None) -> None:
    names = ensembles_pinning(deployment, keep)
    if names:
        raise Conflict(
            {
                "ensembles": [
                    f"{deployment.model.slug} cannot be {action} while ensembles depend on it: "
                    f"{', '.join(names)}. Undeploy or switch those ensembles first."
                ]
            }
        )
