"""What deploying an ensemble needs, and what its steps' deployments may no longer do alone.

Triton runs an ensemble inside one server, calling its steps there: an ensemble version can only be served on
instances where every step's pinned version is served. Deploying, switching or rolling out an ensemble version
needs each step's live deployment on each of those instances (400 naming the step and the instance); a
step's deployment that serves another version there gets the pinned one loaded beside it - a *companion*
version, no traffic of its own (the gateway pins the step's own clients to its active version) - and the
ensemble's agent loads the new ensemble version once its steps' versions are ready on that server. When the
ensembles calling a step have all moved to the companion, the step's deployment switches to it (the old
version unloads); when none calls it any more (a rollback), the companion unloads. Undeploying, switching or
rolling out a step by itself while an ensemble pins another of its versions is a 409 naming the ensembles.

Read-only; the deployments' rows are written by ``apps.deployments.services``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from django.core.exceptions import ValidationError

from apps.core.exceptions import Conflict
from apps.deployments.models import Deployment, DeploymentInstance, DeploymentState, PlacementState, Rollout
from apps.fleet.models import TritonInstance
from apps.registry.models import EnsembleStep, ModelKind, ModelVersion

LIVE = (DeploymentState.UNDEPLOYING, DeploymentState.UNDEPLOYED)


def check_steps_served(version: ModelVersion, instances: list[TritonInstance]) -> list[Deployment]:
    """An ensemble version's steps must be served on every instance: the pinned version READY there (as the
    served version or a companion), or a SERVING step deployment placed there that can load it beside its
    own (no rollout or switch of its own in flight). Returns the step deployments that get a companion."""
    steps = list(version.ensemble_steps.select_related("step_version__model").order_by("position"))
    problems, staged = [], {}
    for step in steps:
        pinned = step.step_version
        deployment = Deployment.objects.filter(model_id=pinned.model_id).exclude(state__in=LIVE).first()
        placements = list(deployment.placements.filter(state=PlacementState.READY)) if deployment else []
        served = {
            p.instance_id for p in placements if pinned.pk in (p.served_version_id, p.canary_version_id)
        }
        missing = [i for i in instances if i.pk not in served]
        if not missing:
            continue
        placed = {p.instance_id for p in placements if p.served_version_id}
        stageable = (
            deployment is not None
            and deployment.state == DeploymentState.SERVING
            and deployment.target_version_id is None
            and not Rollout.objects.live().filter(deployment=deployment).exists()
            and all(i.pk in placed for i in missing)
        )
        if stageable:
            staged[deployment.pk] = deployment
            continue
        problems.append(
            f"step[{step.position}] ({pinned}) is not served on {', '.join(map(str, missing))}: deploy "
            f"{pinned.model.slug} version {pinned.number} there first (Triton runs an ensemble and its steps "
            "in one server)"
            + (
                f"; its deployment is {deployment.state}"
                + (" with a rollout of its own" if deployment.state == DeploymentState.SERVING else "")
                if deployment is not None and all(i.pk in placed for i in missing)
                else ""
            )
        )
    if problems:
        raise ValidationError({"steps": problems})
    return list(staged.values())


def _live_ensemble_versions() -> dict[int, set[int]]:
    """{ensemble version id: the instance ids it is placed on} for every version a live ensemble deployment
    serves, switches to, or rolls out (stable and canary) - and every version its agents still report loaded
    on a placement: an ended rollout's canary keeps calling its steps until its agent has unloaded it, so a
    rolled-back companion step version stays loaded until then."""
    out: dict[int, set[int]] = {}
    live = (
        Deployment.objects.filter(model__kind=ModelKind.ENSEMBLE)
        .exclude(state__in=LIVE)
        .prefetch_related("placements")
    )
    canaries = dict(Rollout.objects.live().values_list("deployment_id", "canary_version_id"))
    for deployment in live:
        placed = [p for p in deployment.placements.all() if p.state != PlacementState.UNLOADED]
        instances = {p.instance_id for p in placed}
        for pk in (deployment.active_version_id, deployment.target_version_id, canaries.get(deployment.pk)):
            if pk:
                out.setdefault(pk, set()).update(instances)
        for p in placed:
            for pk in (p.served_version_id, p.canary_version_id):
                if pk:
                    out.setdefault(pk, set()).add(p.instance_id)
    return out


def pinned_step_versions(model_id: int) -> dict[int, set[int]]:
    """{version id of the step model ``model_id``: instance ids} that live ensembles call."""
    ensembles = _live_ensemble_versions()
    out: dict[int, set[int]] = {}
    steps = EnsembleStep.objects.filter(
        ensemble_version_id__in=list(ensembles), step_version__model_id=model_id
    ).values_list("ensemble_version_id", "step_version_id")
    for ensemble_id, step_id in steps:
        out.setdefault(step_id, set()).update(ensembles[ensemble_id])
    return out


def step_model_ids(model_ids: set[int]) -> set[int]:
    """Which of these models some ensemble version calls (one query: the desired state asks per host)."""
    return set(
        EnsembleStep.objects.filter(step_version__model_id__in=model_ids).values_list(
            "step_version__model_id", flat=True
        )
    )


def companion_of(deployment: Deployment, instance_id: int) -> int | None:
    """The step version a live ensemble calls on this instance that ``deployment`` does not serve as its own
    version: loaded beside it. None while the deployment has a rollout or a switch of its own."""
    if deployment.target_version_id or deployment.state in LIVE:
        return None
    wanted = [
        pk
        for pk, instances in pinned_step_versions(deployment.model_id).items()
        if instance_id in instances and pk != deployment.active_version_id
    ]
    return max(wanted) if wanted else None


def step_deployments_to_follow() -> list[int]:
    """Step deployments that may have a companion to switch to or unload: those of every model a live
    ensemble version calls, and those whose placements still carry a version beside their own."""
    versions = _live_ensemble_versions()
    models = set(
        EnsembleStep.objects.filter(ensemble_version_id__in=list(versions)).values_list(
            "step_version__model_id", flat=True
        )
    )
    with_rollout = Rollout.objects.live().values_list("deployment_id", flat=True)
    beside = set(
        Deployment.objects.exclude(state__in=LIVE)
        .filter(placements__canary_version__isnull=False)
        .exclude(pk__in=with_rollout)
        .values_list("pk", flat=True)
    )
    steps = set(
        Deployment.objects.exclude(state__in=LIVE).filter(model_id__in=models).values_list("pk", flat=True)
    )
    return sorted(beside | steps)


def ensembles_pinning(deployment: Deployment, keep: ModelVersion | None = None) -> list[str]:
    """The live ensemble deployments that call ``deployment``'s model (a version other than ``keep``)."""
    versions = set()
    for live in Deployment.objects.exclude(state__in=(DeploymentState.UNDEPLOYED,)).exclude(pk=deployment.pk):
        versions |= {v for v in (live.active_version_id, live.target_version_id) if v}
    versions |= set(
        Rollout.objects.live().exclude(deployment=deployment).values_list("canary_version_id", flat=True)
    )
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


# --- Placing an ensemble's replicas with its steps (``apps.deployments.ensemble_placing`` decides) ----------


@dataclass
class StepPlacing:
    """What placing an ensemble replica needs of one step: the step's live deployment, the instances where it
    has a replica that counts, and the memory a replica of the step or the pinned version beside it needs."""

    position: int
    pinned: ModelVersion
    deployment: Deployment
    placed: set[int] = field(default_factory=set)
    # The pinned version is not the step deployment's own (a companion loads beside it): its memory on top.
    companion_mb: int = 0
    # A new replica of the step's deployment (its own version, plus the companion).
    new_mb: int = 0
    # Where a replica of the step may be added: None for any pool the team may use, else these pool ids
    # (none for a deployment on instances picked by hand: it only serves where it was put).
    pools: set[int] | None = None
    short: int = (
        0  # replicas the step's deployment lacks: a replica placed with the ensemble fills them first
    )

    def label(self) -> str:
        return f"step[{self.position}] ({self.pinned})"

    def addable_in(self, pool_id: int) -> bool:
        return self.pools is None or pool_id in self.pools


def check_steps_deployed(version: ModelVersion) -> list[Deployment]:
    """An ensemble version placed by the scheduler needs each step deployed (anywhere in a pool the scheduler
    may use): serving the pinned version, or able to load it beside its own (SERVING, no rollout or switch of
    its own). A 400 naming each step that is not. Returns the step deployments."""
    problems, found = [], []
    for step in version.ensemble_steps.select_related("step_version__model").order_by("position"):
        pinned = step.step_version
        deployment = Deployment.objects.filter(model_id=pinned.model_id).exclude(state__in=LIVE).first()
        if deployment is None:
            problems.append(
                f"step[{step.position}] ({pinned}) is not deployed: deploy {pinned.model.slug} first (the "
                "scheduler places the ensemble where its steps serve, adding a replica of a step where needed)"
            )
            continue
        own = pinned.pk in (deployment.active_version_id, deployment.target_version_id)
        if not own and (
            deployment.state != DeploymentState.SERVING
            or deployment.target_version_id
            or Rollout.objects.live().filter(deployment=deployment).exists()
        ):
            problems.append(
                f"step[{step.position}] ({pinned}): its deployment serves another version and is "
                f"{deployment.state}{' with a switch or rollout of its own' if deployment.state == DeploymentState.SERVING else ''}; "
                "the pinned version can be loaded beside it once it is SERVING alone"
            )
            continue
        found.append(deployment)
    if problems:
        raise ValidationError({"steps": problems})
    return found


def steps_for_placing(version: ModelVersion) -> list[StepPlacing]:
    """Each step of the ensemble version with its live deployment and where it counts a replica (the caller
    holds the step deployments' row locks). A step with no live deployment is left out (the deploy checked
    ``check_steps_deployed``; one undeployed since is refused by the 409 of its undeploy)."""
    out = []
    for step in version.ensemble_steps.select_related("step_version").order_by("position"):
        pinned = step.step_version
        deployment = Deployment.objects.filter(model_id=pinned.model_id).exclude(state__in=LIVE).first()
        if deployment is None:
            continue
        counted = deployment.placements.filter(retiring_reason="").exclude(state=PlacementState.UNLOADED)
        placed = set(counted.values_list("instance_id", flat=True))
        own = {deployment.active_version_id, deployment.target_version_id} - {None}
        sizes = {
            v.pk: v.footprint_estimate_mb()
            for v in ModelVersion.objects.filter(pk__in=own | {pinned.pk}).only(
                "pk", "footprint_mb", "size_bytes"
            )
        }
        companion = 0 if pinned.pk in own else sizes[pinned.pk]
        out.append(
            StepPlacing(
                position=step.position,
                pinned=pinned,
                deployment=deployment,
                placed=placed,
                companion_mb=companion,
                new_mb=sum(sizes[pk] for pk in own) + companion,
                pools=set() if deployment.pinned else ({deployment.pool_id} if deployment.pool_id else None),
                short=max(0, deployment.replicas - len(placed)) if not deployment.pinned else 0,
            )
        )
    return out


def replicas_calling(model_id: int, instance_ids: set[int], *, counted_only: bool = False):
    """The placements, on these instances, of live ensemble deployments (not unloaded yet; ``counted_only``:
    nor being replaced) that call a version of the model ``model_id``: a step replica there must stay until
    they are gone, and moves with them."""
    calling = EnsembleStep.objects.filter(step_version__model_id=model_id).values_list(
        "ensemble_version__model_id", flat=True
    )
    rows = (
        DeploymentInstance.objects.filter(instance_id__in=instance_ids, deployment__model_id__in=calling)
        .exclude(state=PlacementState.UNLOADED)
        .exclude(deployment__state=DeploymentState.UNDEPLOYED)
    )
    return rows.filter(retiring_reason="") if counted_only else rows


def instances_calling(model_id: int, instance_ids: set[int], *, counted_only: bool = False) -> set[int]:
    """Of these instances, those where an ensemble replica calls the model (``replicas_calling``)."""
    rows = replicas_calling(model_id, instance_ids, counted_only=counted_only)
    return set(rows.values_list("instance_id", flat=True))


def step_model_ids_of(deployment: Deployment) -> set[int]:
    """The models an ensemble deployment's versions (served and switched to) call."""
    versions = {deployment.active_version_id, deployment.target_version_id} - {None}
    return set(
        EnsembleStep.objects.filter(ensemble_version_id__in=versions).values_list(
            "step_version__model_id", flat=True
        )
    )
