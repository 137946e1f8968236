"""The deployments' part of the agent API (``/agent/v1/``, host credential only; see ``apps.fleet.agent_api``).

- ``GET desired-state``: the host's instances (flags, commands) and placements (the versions each must serve,
  a rollout's canary included), with every placed version's artifact manifest (paths relative to the version,
  size, sha256). ``ETag`` is the host's desired generation: an agent polling with ``If-None-Match`` gets a 304
  for one indexed query while nothing changed.
- ``POST placements/<id>/report``: loaded / failed (with Triton's own error) / unloaded / lost / started /
  waiting, with the generation the agent applied; ``apps.deployments.reports`` drops a stale one.
- ``POST tunings/<id>/report``: a running tuning job's points and its end (``apps.deployments.tuning_jobs``).
- ``GET versions/<id>/manifest`` and ``versions/<id>/files/<path>``: only versions placed on this host (or
  tuned on it by a running job).

Another host's placements and instances, and versions not placed on this host, are 404.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from django.db.models import F, Q
from django.http import FileResponse, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET, require_POST

from apps.deployments import autoscaling, ensembles, healing, reports, tuning_jobs
from apps.deployments.models import (
    Deployment,
    DeploymentInstance,
    DeploymentState,
    PlacementState,
    Rollout,
    TuningJob,
    TuningState,
)
from apps.fleet import long_poll
from apps.fleet.agent_api import BadReport, error, host_instances, host_only, read_json, unauthorized
from apps.fleet.models import hash_host_secret
from apps.fleet.services import host_for_credential
from apps.registry.models import EnsembleStep, ModelVersion
from backend_ge import naming
from backend_ge.errors import public_error
from hostagent.protocol import PlacementResult, check_placement_report
from hostagent.repository import file_manifest

log = logging.getLogger(__name__)

# Deployments in these states want nothing served.
GONE = (DeploymentState.UNDEPLOYING, DeploymentState.UNDEPLOYED)

_manifests: dict[tuple, list[dict]] = {}
_manifests_lock = threading.Lock()


def version_manifest_cached(version: ModelVersion) -> list[dict] | None:
    """The version's manifest, hashed once per content (the key holds each file's size and mtime): a desired
    state names every placed version, and re-hashing multi-GB models on every poll would be the platform's
    whole CPU."""
    servable = version.servable_dir()
    if not servable.is_dir():
        return None
    key_parts = [version.pk]
    for root, _dirs, files in os.walk(servable):
        for name in sorted(files):
            stat = os.stat(os.path.join(root, name))
            key_parts.append((os.path.join(root, name), stat.st_size, stat.st_mtime_ns))
    key = tuple(key_parts)
    with _manifests_lock:
        cached = _manifests.get(key)
    if cached is None:
        cached = file_manifest(servable)
        with _manifests_lock:
            if len(_manifests) > 4096:
                _manifests.clear()
            _manifests[key] = cached
    return cached


# What a placement's entry reads (``placement_entry``, ``_beside``, ``_reused``): a desired state follows every
# change of the host's placements, and building every column of five tables per placement was most of it.
PLACEMENT_FIELDS = (
    "id", "deployment_id", "instance_id", "generation", "applied_generation", "state", "unload", "routed",
    "served_version_id", "canary_version_id",
    "deployment__id", "deployment__state", "deployment__model_id", "deployment__active_version_id",
    "deployment__target_version_id",
    "deployment__model__id", "deployment__model__slug", "deployment__model__team_id",
    "deployment__model__team__id", "deployment__model__team__slug",
    "instance__id", "instance__name", "instance__host_id",
)  # fmt: skip
# What a version's entry reads (``version_entry``).
VERSION_FIELDS = (
    "id", "number", "model_id", "config_text", "signature",
    "model__id", "model__slug", "model__name", "model__kind", "model__team_id",
    "model__team__id", "model__team__slug", "model__team__quota_model_instances",
)  # fmt: skip


def _live_placements(host, done_unloading: bool = True, **filters) -> list[DeploymentInstance]:
    """The host's placements of deployments not undeployed; without those whose unload their agent
    confirmed (UNLOADED at the decision's generation) unless ``done_unloading``."""
    rows = DeploymentInstance.objects.filter(instance__host=host, **filters).exclude(
        deployment__state=DeploymentState.UNDEPLOYED
    )
    if not done_unloading:
        rows = rows.exclude(state=PlacementState.UNLOADED, applied_generation=F("generation"))
    placements = list(
        rows.select_related("deployment__model__team", "instance").only(*PLACEMENT_FIELDS).order_by("pk")
    )
    for placement in placements:
        placement.instance.host = host  # its label names the host: no join for a row the caller holds
    return placements


def placement_entry(placement: DeploymentInstance, canary_id: int | None, reused: bool) -> dict:
    deployment: Deployment = placement.deployment
    target_id = deployment.target_version_id or deployment.active_version_id
    draining = placement.unload and placement.routed  # told to unload, the gateway not done with it yet
    return {
        "id": placement.pk,
        "instance": placement.instance_id,
        "label": str(placement.instance),
        "deployment": deployment.pk,
        "model_name": deployment.triton_model_name(),
        "generation": placement.generation,
        "applied_generation": placement.applied_generation,
        "state": placement.state,
        # Undeployed, or a replica retired once its replacement serves (apps.deployments.scheduler) - once the
        # gateway no longer routes to it (apps.deployments.draining): until then its agent keeps serving it.
        "undeploy": (deployment.state in GONE or placement.unload) and not draining,
        "target": target_id,
        "active": deployment.active_version_id,
        "target_version": deployment.target_version_id,
        # A live rollout's canary, served beside the active version - unless a switch is in flight.
        "canary_target": None if deployment.target_version_id else canary_id,
        "served": placement.served_version_id,
        "canary": placement.canary_version_id,
        # Undeploying, but a newer live deployment of the same model uses the same Triton name here.
        "keep_model": reused,
    }


def _canaries(deployment_ids) -> dict[int, int]:
    rows = Rollout.objects.live().filter(deployment_id__in=deployment_ids)
    return dict(rows.values_list("deployment_id", "canary_version_id"))


def _reused(placement: DeploymentInstance, live: list[DeploymentInstance]) -> bool:
    return placement.deployment.state in GONE and any(
        other.instance_id == placement.instance_id
        and other.deployment.model_id == placement.deployment.model_id
        and other.deployment.state not in GONE
        for other in live
    )


def version_entry(version: ModelVersion, steps: list[str]) -> dict:
    return {
        "id": version.pk,
        "number": version.number,
        "label": str(version),
        "model_name": version.model.triton_model_name(),
        "config_text": version.config_text,
        "signature": version.signature,
        "instance_limit": version.model.team.model_instance_limit(),
        "files": version_manifest_cached(version),
        # An ensemble's steps (Triton names): the only models its config may call on the host.
        "steps": steps,
    }


def _step_names(versions: list[ModelVersion]) -> dict[int, list[str]]:
    """Each ensemble version's steps as Triton names, in order (one query, none without an ensemble: a
    prefetch built a related manager for every version, a third of a desired state's time)."""
    ensembles_ = [v.pk for v in versions if v.model.is_ensemble()]
    names: dict[int, list[str]] = {}
    if ensembles_:
        rows = (
            EnsembleStep.objects.filter(ensemble_version_id__in=ensembles_)
            .order_by("ensemble_version_id", "position")
            .values_list(
                "ensemble_version_id", "step_version__model__team__slug", "step_version__model__slug"
            )
        )
        for version_id, team_slug, model_slug in rows:
            names.setdefault(version_id, []).append(naming.triton_model_name(team_slug, model_slug))
    return names


def placed_version_ids(entries: list[dict]) -> set[int]:
    ids = set()
    for entry in entries:
        ids |= {entry[k] for k in ("target", "active", "canary_target", "served", "canary") if entry[k]}
    return ids


def _beside(placement: DeploymentInstance, canaries: dict[int, int], steps: set[int]) -> int | None:
    """The version to serve beside the placement's own: its rollout's canary, or the companion a live
    ensemble calls on this instance (``apps.deployments.ensembles``)."""
    if placement.deployment_id in canaries:
        return canaries[placement.deployment_id]
    if placement.deployment.model_id in steps:
        return ensembles.companion_of(placement.deployment, placement.instance_id)
    return None


def desired_state_of(host) -> dict:
    # A replica its agent reported unloaded (asleep, evicted, retired) is left out, with its versions: its
    # agent has nothing to do for it, and one that is absent is not served either. A dense host keeps a row
    # for every model that ever slept there (300 models: 219 entries for 6 loaded, ~120 ms a fetch).
    live = _live_placements(host, done_unloading=False)
    canaries = _canaries({p.deployment_id for p in live})
    steps = ensembles.step_model_ids({p.deployment.model_id for p in live})
    placements = [placement_entry(p, _beside(p, canaries, steps), _reused(p, live)) for p in live]
    tunings = [tuning_entry(job) for job in _running_tunings(host)]
    versions = list(
        ModelVersion.objects.filter(pk__in=placed_version_ids(placements) | {t["version"] for t in tunings})
        .select_related("model__team")
        .only(*VERSION_FIELDS)
    )
    steps_of = _step_names(versions)
    return {
        "host": host.name,
        "generation": host.desired_generation,
        "instances": host_instances(host),
        "placements": placements,
        "versions": {str(v.pk): version_entry(v, steps_of.get(v.pk, [])) for v in versions},
        "tunings": tunings,
    }


def _running_tunings(host):
    return TuningJob.objects.filter(state=TuningState.RUNNING, instance__host=host).order_by("pk")


def tuning_entry(job: TuningJob) -> dict:
    """A running tuning job as its agent runs it (``hostagent.tuning_protocol``)."""
    return {
        "id": job.pk,
        "instance": job.instance_id,
        "version": job.version_id,
        "objective": {"p99_ms": job.objective["p99_ms"], "rate_rps": job.objective.get("rate_rps")},
        "budget_s": job.budget_s,
        "max_candidates": job.max_candidates,
        "max_instances": job.max_instances,
        "gears": list(job.gears),
        "cancel": job.cancel_requested,
    }


@require_POST
@host_only
def tuning_report(request, job_id: int):
    """Points, the start, the end or the failure of a tuning job running on this host
    (``apps.deployments.tuning_jobs.report``)."""
    status, answer = tuning_jobs.report(job_id, request.host, read_json(request))
    return JsonResponse(answer, status=status)


@require_GET
@host_only
def desired_state(request):
    """What this host must run and serve. 304 while the host's generation equals the agent's ETag; with
    ``?wait=N`` that 304 is held up to N s (``apps.fleet.long_poll``) and a change is answered at once.

    Behind gunicorn the fast path (``apps.fleet.agent_fastpath``) holds the poll before Django; this view
    holds it where that path is not in front (``runserver``, the test server)."""
    try:
        wait = long_poll.parse_wait(request.META.get("QUERY_STRING", ""))
    except long_poll.BadWait as exc:
        return error(400, "invalid", str(exc))
    etag = f'"{request.host.desired_generation}"'
    sent = request.headers.get("If-None-Match")
    if wait and sent == etag and not request.META.get(long_poll.HELD):
        credential = request.headers["Authorization"].partition(" ")[2].strip()
        if long_poll.watcher().wait_for_change(hash_host_secret(credential), etag, wait):
            request.host = host_for_credential(credential)
            if request.host is None:
                return unauthorized()
            etag = f'"{request.host.desired_generation}"'
    response = HttpResponse(status=304) if sent == etag else JsonResponse(desired_state_of(request.host))
    response["ETag"] = etag
    return response


def _version_of(deployment: Deployment, value, name: str) -> ModelVersion | None:
    if value is None:
        return None
    if not isinstance(value, int):
        raise BadReport(f"'{name}' must be a version id or null.")
    version = ModelVersion.objects.filter(pk=value, model_id=deployment.model_id).first()
    if version is None:
        raise BadReport(f"'{name}' is not a version of {deployment.model}.")
    return version


def _public(text: str) -> str:
    return public_error(text) if text else ""


@require_POST
@host_only
def placement_report(request, placement_id: int):
    """Hand the agent's result to ``apps.deployments.reports``; answers whether it was accepted (a report
    for an older generation is not: a newer decision was made) and the placement as it is now."""
    arrived = time.time()  # a cold start's breakdown: when the agent's report reached the platform
    placement = (
        DeploymentInstance.objects.filter(pk=placement_id, instance__host=request.host)
        .select_related("deployment__model")
        .first()
    )
    if placement is None:
        return error(404, "not_found", "No such placement on this host.")
    report = check_placement_report(read_json(request))
    generation, result = report.generation, report.result
    deployment = placement.deployment
    version = _version_of(deployment, report.version, "version")
    canary = _version_of(deployment, report.canary, "canary")
    still = _version_of(deployment, report.still_serving, "still_serving")
    message, err = _public(report.message), _public(report.error)
    if result == PlacementResult.STARTED:
        accepted = reports.placement_started(placement.pk, generation)
    elif result == PlacementResult.WAITING:
        accepted = reports.placement_waiting(placement.pk, generation, message or err)
    elif result == PlacementResult.LOADED:
        kind = report.kind.value if report.kind else None
        accepted = reports.placement_loaded(
            placement.pk, generation, version, kind=kind, message=message, canary=canary
        )
        if accepted and report.footprint_mb is not None:
            reports.footprint_measured(version.pk, report.footprint_mb)
        if accepted and report.timings and "cold" in (deployment.scaling_memory or {}):
            autoscaling.note_loaded(deployment.pk, report.timings, arrived_at=arrived)
    elif result == PlacementResult.FAILED:
        accepted = reports.placement_failed(
            placement.pk, generation, err, version=version, still_serving=still, message=message
        )
    elif result == PlacementResult.CANARY_LOADED:
        accepted = reports.placement_canary_loaded(placement.pk, generation, version, canary, message=message)
    elif result == PlacementResult.CANARY_FAILED:
        accepted = reports.placement_canary_failed(
            placement.pk, generation, err, canary=canary, still_serving=still
        )
    elif result == PlacementResult.UNLOADED:
        accepted = reports.placement_unloaded(placement.pk, generation, message)
        if accepted:
            _place_in_freed_room(placement.evicted_for_id, request.host.pool_id)
    else:
        accepted = reports.placement_lost(placement.pk, generation, err, reloading=report.reloading)
    # Only this instance's placements of the model decide the answer (``_reused``): a host with many
    # placements of one model must not make every report read them all.
    live = _live_placements(
        request.host, deployment__model_id=deployment.model_id, instance_id=placement.instance_id
    )
    fresh = next((p for p in live if p.pk == placement.pk), None)
    entry = None
    if fresh is not None:
        canaries = _canaries([fresh.deployment_id])
        steps = ensembles.step_model_ids({fresh.deployment.model_id})
        entry = placement_entry(fresh, _beside(fresh, canaries, steps), _reused(fresh, live))
    return JsonResponse({"accepted": accepted, "placement": entry})


def _place_in_freed_room(evicted_for: int | None, pool_id: int | None) -> None:
    """A replica freed its memory: the replica it was evicted for (a woken model whose request is held at
    the gateway), else the one waiting longest for room in its pool, is placed now instead of at the
    scheduler's next tick (a wake-up does not queue behind the tick). One deployment, so a report costs one
    decision however many wait. Best effort: the tick places it anyway, so a failure never fails the report."""
    try:
        wanted = [evicted_for] if evicted_for is not None else healing.waiting_for_room(pool_id)
        if wanted:
            healing.place_short(wanted)
    except Exception:
        log.exception("placing the replicas waiting for room after an unload failed")


def _placed_version(host, version_id: int) -> ModelVersion | None:
    """A version this host may download: one its live placements serve, are to serve, or canary."""
    refs = (
        Q(deployment__active_version_id=version_id)
        | Q(deployment__target_version_id=version_id)
        | Q(served_version_id=version_id)
        | Q(canary_version_id=version_id)
        | Q(
            deployment__rollouts__canary_version_id=version_id,
            deployment__rollouts__state__in=["RUNNING", "PAUSED"],
        )
    )
    live = DeploymentInstance.objects.filter(instance__host=host).exclude(
        deployment__state=DeploymentState.UNDEPLOYED
    )
    placed = live.filter(refs).exists() or _running_tunings(host).filter(version_id=version_id).exists()
    version = ModelVersion.objects.filter(pk=version_id).first()
    if not placed and version is not None:
        # A companion: a step version a live ensemble calls, loaded beside its deployment's own here.
        placed = any(
            ensembles.companion_of(p.deployment, p.instance_id) == version_id
            for p in live.filter(deployment__model_id=version.model_id).select_related("deployment")
        )
    return version if placed else None


NOT_PLACED = "No such version placed on this host."


@require_GET
@host_only
def version_manifest(request, version_id: int):
    version = _placed_version(request.host, version_id)
    files = version_manifest_cached(version) if version else None
    if files is None:
        return error(404, "not_found", NOT_PLACED)
    return JsonResponse({"version": version_id, "files": files})


@require_GET
@host_only
def version_file(request, version_id: int, path: str):
    version = _placed_version(request.host, version_id)
    if version is None:
        return error(404, "not_found", NOT_PLACED)
    servable = version.servable_dir().resolve()
    # Only what the manifest lists: the path comes from the URL and must name one of those files.
    listed = {entry["path"] for entry in version_manifest_cached(version) or []}
    target = (servable / path).resolve()
    if path not in listed or not target.is_relative_to(servable) or not Path(target).is_file():
        return error(404, "not_found", "No such file in this version.")
    return FileResponse(target.open("rb"), as_attachment=True, filename=target.name)
