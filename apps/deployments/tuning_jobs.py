"""Tuning jobs (``apps.deployments.tuning_models.TuningJob``): start, place, report, cancel, time out, and
turn the recommendation into a version.

A job measures one READY version against its model's latency objective on a real instance of a pool. It is
placed like a replica but holds memory of its own: ``reserved_mb`` (the version's footprint times the most
instances a candidate may run) counts in its instance's ``TritonInstance.reserved_mb`` while it runs
(``apps.deployments.reserved``), so replicas are never placed into the room it uses, and a job never goes
where serving replicas would not fit beside it. At most one job runs per instance (a second would measure
the first's load). A job that finds no room stays QUEUED with the reason and times out after
``TUNING_QUEUE_TIMEOUT_S``; a running one that has not finished ``TUNING_REPORT_GRACE_S`` past its budget
times out and releases its memory (its agent, no longer seeing it in the desired state, cleans up).

The agent reports the points it measured (``hostagent.tuning_protocol``); the recommendation is read from
those points here (``backend_ge.tuning.recommend``): an agent sends figures, never the verdict.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from apps.audit.services import record
from apps.conversions.models import ConversionJob, JobState, Toolchain
from apps.conversions.services import derive_version, reconvert_version
from apps.deployments import reserved, scheduler
from apps.deployments.tuning_models import ACTIVE_TUNING_STATES, MAX_POINTS, TuningJob, TuningState
from apps.fleet.models import Pool, TritonInstance
from apps.fleet.services import notify_hosts
from apps.registry.models import ModelVersion, VersionState
from backend_ge import config as gc
from backend_ge.errors import public_error
from backend_ge.tuning import Candidate, Limits, Objective, Point, Result, TuningError, recommend
from hostagent.tuning_protocol import TuningEvent, check_tuning_report

log = logging.getLogger(__name__)

BUDGET_RANGE_S = (30, 3600)
DEFAULT_BUDGET_S = 300
MAX_CANDIDATES_RANGE = (1, 30)
DEFAULT_MAX_CANDIDATES = 12
MAX_LOG_CHARS = 100_000


def _field(name: str, message: str) -> ValidationError:
    return ValidationError({name: [message]})


def compiled_gears(version: ModelVersion) -> list[int]:
    """An NPU version's batch gears, as its ATC conversion compiled them (``--dynamic_batch_size``)."""
    job = (
        version.conversion_jobs.filter(toolchain=Toolchain.ATC, state=JobState.SUCCEEDED)
        .order_by("-pk")
        .first()
    )
    for arg in (job.command or []) if job else []:
        if isinstance(arg, str) and arg.startswith("--dynamic_batch_size="):
            return sorted({int(g) for g in arg.partition("=")[2].split(",") if g.strip().isdigit()})
    return []


def _bounded(value, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _field(name, f"Give a whole number from {low} to {high} (got {value!r}).")
    return value


def check_start(version: ModelVersion, *, budget_s, max_candidates, max_instances) -> tuple[int, int, int]:
    """What a job asks is possible: a 400 naming the field otherwise."""
    if version.state != VersionState.READY:
        raise _field(
            "version", f"Version {version.number} is {version.state}; only a READY version is tuned."
        )
    if version.model.is_ensemble():
        raise _field("version", "An ensemble's serving settings are its steps': tune a step's version.")
    if version.model.objective_p99_ms is None:
        raise _field(
            "objective_p99_ms",
            f"Set {version.model}'s latency objective first (PATCH the model with objective_p99_ms).",
        )
    try:
        cfg = gc.parse_config(version.config_text)
    except gc.ConfigError as exc:
        raise _field("version", f"Version {version.number}'s config does not parse: {exc}") from None
    high_budget = min(BUDGET_RANGE_S[1], settings.TUNING_MAX_BUDGET_S)
    budget_s = _bounded(budget_s, "budget_s", BUDGET_RANGE_S[0], high_budget)
    max_candidates = _bounded(max_candidates, "max_candidates", *MAX_CANDIDATES_RANGE)
    limit = version.model.team.model_instance_limit()
    max_instances = _bounded(max_instances, "max_instances", 1, limit)
    try:
        Limits(cfg.max_batch_size, gears=tuple(compiled_gears(version)), max_instances=max_instances)
    except TuningError as exc:
        raise _field("version", f"Version {version.number} cannot be tuned: {exc}") from None
    return budget_s, max_candidates, max_instances


def start_tuning(
    *,
    actor,
    version: ModelVersion,
    pool: Pool | None = None,
    budget_s: int = DEFAULT_BUDGET_S,
    max_candidates: int = DEFAULT_MAX_CANDIDATES,
    max_instances: int = 1,
) -> TuningJob:
    """Queue a job for ``version`` in ``pool`` (None: any pool the team may use) and try to place it now."""
    team = version.model.team
    if pool is not None and pool.team_id not in (None, team.pk):
        raise _field("pool", f"Team {team.slug} may not use pool '{pool.name}'.")
    budget_s, max_candidates, max_instances = check_start(
        version, budget_s=budget_s, max_candidates=max_candidates, max_instances=max_instances
    )
    if not _pools(team, pool):
        raise _field("pool", f"Team {team.slug} may use no pool: ask an operator for one.")
    busy = TuningJob.objects.filter(version=version, state__in=ACTIVE_TUNING_STATES)
    running = busy.first()
    if running is not None:
        raise _field("version", f"Version {version.number} is being tuned already (tuning {running.pk}).")
    try:
        with transaction.atomic():
            job = _create(actor, version, pool, budget_s, max_candidates, max_instances)
    except IntegrityError:  # another request started one meanwhile (one_active_tuning_per_version)
        raise _field("version", f"Version {version.number} is being tuned already.") from None
    place_queued([job.pk])
    job.refresh_from_db()
    return job


def _create(actor, version: ModelVersion, pool, budget_s: int, max_candidates: int, max_instances: int):
    team, model = version.model.team, version.model
    job = TuningJob.objects.create(
        team=team,
        version=version,
        pool=pool,
        objective={"p99_ms": model.objective_p99_ms, "rate_rps": model.objective_rate_rps},
        budget_s=budget_s,
        max_candidates=max_candidates,
        max_instances=max_instances,
        gears=compiled_gears(version),
        reserved_mb=version.footprint_estimate_mb() * max_instances,
        reason="waiting for a place",
        created_by=actor if getattr(actor, "is_authenticated", False) else None,
    )
    record(
        actor=actor,
        team=team,
        action="tuning.started",
        target=version,
        details={"tuning": job.pk, "pool": pool.name if pool else None, "budget_s": budget_s},
    )
    return job


def _pools(team, pool: Pool | None) -> list[Pool]:
    if pool is not None:
        return [pool]
    return list(Pool.objects.usable_by_team(team).order_by(F("team").asc(nulls_last=True), "name"))


def place_queued(job_ids: list[int] | None = None) -> int:
    """Place queued jobs where their scratch replica fits (oldest first); returns how many were placed."""
    queued = TuningJob.objects.filter(state=TuningState.QUEUED).order_by("pk")
    if job_ids is not None:
        queued = queued.filter(pk__in=job_ids)
    placed = 0
    for job_id in queued.values_list("pk", flat=True):
        with transaction.atomic():
            job = (
                TuningJob.objects.select_for_update(of=("self",))  # the pool's side of the join is nullable
                .select_related("version__model__team", "pool")
                .filter(pk=job_id, state=TuningState.QUEUED)
                .first()
            )
            if job is not None and _place(job):
                placed += 1
    return placed


def _place(job: TuningJob) -> bool:
    """Put the job on the instance of its pools with the most free memory that runs no other job. Holds
    each pool's lock (``scheduler.candidates_in``): no replica decision reads the figure meanwhile."""
    need = job.reserved_mb or 1
    reasons = []
    for pool in _pools(job.team, job.pool):
        candidates = scheduler.candidates_in(pool, lock=True)
        busy = set(
            TuningJob.objects.filter(state=TuningState.RUNNING, instance__host__pool=pool).values_list(
                "instance_id", flat=True
            )
        )
        free = sorted(
            (c for c in candidates if c.instance_id not in busy), key=lambda c: (-c.free_mb, c.instance_id)
        )
        if not candidates:
            reasons.append(f"pool {pool.name} has no schedulable instance")
            continue
        if not free:
            reasons.append(f"every instance of pool {pool.name} runs a tuning job")
            continue
        best = free[0]
        if best.free_mb < need:
            reasons.append(f"no instance of pool {pool.name} has {need} MiB free (most: {best.free_mb} MiB)")
            continue
        job.instance_id = best.instance_id
        job.state = TuningState.RUNNING
        job.started_at = timezone.now()
        job.reason = f"placed on {best.label}; waiting for its agent"
        job.save(update_fields=["instance", "state", "started_at", "reason"])
        reserved.refresh_reserved([best.instance_id])
        notify_hosts([best.host_id])
        return True
    reason = "waiting for room: " + "; ".join(reasons)
    if job.reason != reason:
        job.reason = reason
        job.save(update_fields=["reason"])
    return False


def _end(job: TuningJob, state: str, reason: str) -> None:
    """End a locked job; its memory and its place on the host's desired state go with it."""
    job.state, job.reason, job.finished_at = state, reason[:4000], timezone.now()
    job.save(update_fields=["state", "reason", "finished_at", "result", "points", "log"])
    if job.instance_id is not None:
        reserved.refresh_reserved([job.instance_id])
        host_id = TritonInstance.objects.filter(pk=job.instance_id).values_list("host_id", flat=True).first()
        notify_hosts([host_id] if host_id else [])


def cancel(*, actor, job: TuningJob) -> TuningJob:
    """A queued job, or one its agent has not started, ends at once; a measuring one is asked to stop (its
    agent unloads the scratch replica and reports; the timeout ends it otherwise)."""
    with transaction.atomic():
        job = TuningJob.objects.select_for_update().get(pk=job.pk)
        if not job.is_active():
            raise _field("state", f"Tuning {job.pk} is {job.state}: it has ended.")
        if job.state == TuningState.QUEUED or job.reported_at is None:
            _end(job, TuningState.CANCELLED, "cancelled before it started")
        elif not job.cancel_requested:
            job.cancel_requested = True
            job.reason = "cancel requested: the agent stops after the point it measures"
            job.save(update_fields=["cancel_requested", "reason"])
            notify_hosts(TritonInstance.objects.filter(pk=job.instance_id).values_list("host_id", flat=True))
        record(
            actor=actor,
            team=job.team,
            action="tuning.cancelled",
            target=job.version,
            details={"tuning": job.pk},
        )
    return job


def expire(now=None) -> int:
    """The tick's sweep: queued jobs past ``TUNING_QUEUE_TIMEOUT_S``, running ones past their budget plus
    ``TUNING_REPORT_GRACE_S``, time out. Returns how many."""
    now = now or timezone.now()
    queued = TuningJob.objects.filter(
        state=TuningState.QUEUED, created_at__lt=now - timedelta(seconds=settings.TUNING_QUEUE_TIMEOUT_S)
    )
    running = TuningJob.objects.filter(state=TuningState.RUNNING)
    grace = timedelta(seconds=settings.TUNING_REPORT_GRACE_S)
    overdue = [
        pk
        for pk, started, budget, cancel, heard in running.values_list(
            "pk", "started_at", "budget_s", "cancel_requested", "reported_at"
        )
        if started is None
        or started + timedelta(seconds=budget) + grace < now
        or (cancel and (heard or started) + grace < now)  # asked to stop, and its agent went quiet
    ]
    count = 0
    for job_id in [*queued.values_list("pk", flat=True), *overdue]:
        with transaction.atomic():
            job = TuningJob.objects.select_for_update().filter(pk=job_id).first()
            if job is None or not job.is_active():
                continue
            if job.state == TuningState.QUEUED:
                reason = f"timed out after {settings.TUNING_QUEUE_TIMEOUT_S} s without room ({job.reason})"
            elif job.cancel_requested:
                _read(job, "cancelled")
                _end(job, TuningState.CANCELLED, "cancelled; its agent did not confirm the stop")
                count += 1
                continue
            else:
                reason = f"timed out: no result within its budget of {job.budget_s} s and the grace"
                _read(job)
            _end(job, TuningState.TIMED_OUT, reason)
            count += 1
    return count


def tick() -> dict[str, int]:
    return {"tunings_timed_out": expire(), "tunings_placed": place_queued()}


# --- the agent's reports ------------------------------------------------------------------------------


def objective_of(job: TuningJob) -> Objective:
    return Objective(p99_ms=job.objective["p99_ms"], rate_rps=job.objective.get("rate_rps"))


def _read(job: TuningJob, stopped: str = "budget", wall_s: float | None = None) -> None:
    """``job.result`` from its points: the recommendation is the platform's reading of the figures."""
    base = Candidate.from_config(gc.parse_config(job.version.config_text))
    points = [Point.from_dict({k: v for k, v in p.items() if k != "at_s"}) for p in job.points]
    result = Result(objective=objective_of(job), default=base, points=points, stopped=stopped)
    result.wall_s = wall_s if wall_s is not None else max((p.get("at_s", 0) for p in job.points), default=0)
    recommend(result, job.gears)
    job.result = result.as_dict()


def report(job_id: int, host, body) -> tuple[int, dict]:
    """An agent's report on a job of its host: (HTTP status, answer). A job that ended (cancelled, timed
    out) answers 409 so the agent stops; another host's job is 404."""
    message = check_tuning_report(body)
    with transaction.atomic():
        job = (
            TuningJob.objects.select_for_update(of=("self",))
            .select_related("version__model")
            .filter(pk=job_id, instance__host=host)
            .first()
        )
        if job is None:
            return 404, {"error": "not_found", "detail": "No such tuning job on this host."}
        if job.state != TuningState.RUNNING:
            return 409, {"error": "ended", "detail": f"Tuning {job.pk} is {job.state}.", "accepted": False}
        job.reported_at = timezone.now()
        room = MAX_POINTS - len(job.points)
        job.points = job.points + message.points[: max(room, 0)]
        if message.log:
            job.log = (job.log + message.log + "\n")[-MAX_LOG_CHARS:]
        fields = ["reported_at", "points", "log"]
        if message.event == TuningEvent.STARTED:
            job.reason = "measuring"
            fields.append("reason")
        if message.event in (TuningEvent.STARTED, TuningEvent.POINTS):
            job.save(update_fields=fields)
            return 200, {"accepted": True, "cancel": job.cancel_requested}
        if message.event == TuningEvent.FAILED:
            _read(job)
            _end(job, TuningState.FAILED, public_error(message.error) or "the agent reported a failure")
        else:
            stopped = message.stopped.value
            _read(job, stopped, message.wall_s)
            state = TuningState.CANCELLED if stopped == "cancelled" else TuningState.SUCCEEDED
            _end(job, state, job.result["message"])
        record(
            actor=None,
            team=job.team,
            action=f"tuning.{job.state.lower()}",
            target=job.version,
            details={"tuning": job.pk, "points": len(job.points)},
        )
    return 200, {"accepted": True, "cancel": False}


# --- the recommendation as a version -------------------------------------------------------------------


def recommended_candidate(job: TuningJob) -> Candidate:
    raw = (job.result or {}).get("recommended")
    if raw is None:
        raise _field("tuning", f"Tuning {job.pk} recommends no config ({job.reason or job.state}).")
    return Candidate.from_dict(raw)


def create_recommended_version(*, actor, job: TuningJob, note: str = "") -> ModelVersion:
    """A new version of the tuned model serving the same files with the recommended settings; it rolls
    out like any version."""
    candidate = recommended_candidate(job)
    version = job.version
    if candidate == Candidate.from_config(gc.parse_config(version.config_text)):
        raise _field("tuning", f"Tuning {job.pk} found {version}'s own config the best: nothing to create.")
    text = gc.render_config(candidate.apply(gc.parse_config(version.config_text)))
    note = note or f"Tuning {job.pk}'s recommendation: {candidate.label()}."
    with transaction.atomic():
        derived = derive_version(actor=actor, version=version, text=text, note=note)
        TuningJob.objects.filter(pk=job.pk).update(derived_version=derived)
    return derived


def reconvert_with_gears(*, actor, job: TuningJob) -> ConversionJob:
    """The re-conversion a tuning of an NPU version suggested: the next version compiled by ATC with the gears
    that serve the measured batches without padding (``result["regear"]``)."""
    gears = (job.result or {}).get("regear") or []
    if not gears:
        raise _field("tuning", f"Tuning {job.pk} suggests no other gears.")
    return reconvert_version(
        actor=actor,
        version=job.version,
        options={"batch_gears": ",".join(str(g) for g in gears)},
        note=f"Converted again with batch gears {','.join(map(str, gears))} (tuning {job.pk}).",
    )
