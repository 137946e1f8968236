"""Progressive rollouts: a canary version beside the stable one, its share of traffic raised step by step while
its figures pass the gates, rolled back automatically when they do not.

Lifecycle (the state machine is ``Rollout``'s): ``start_rollout`` records the rollout at weight 0 and a new
decision on every placement, so each agent loads the canary beside the stable version (smoke-tested first)
and reports it (``reports.placement_canary_loaded``). The beat task ``check_rollouts`` then, every tick:

- raises the weight to the first step once every READY placement serves the canary, and takes the counters
  the first window is measured from;
- runs each due check (claimed with a conditional UPDATE of ``next_check_at``, so two beats never check
  twice): figures per version since the last judged check (``apps.deployments.analysis``), gates, an
  analysis row; a pass advances to the next step (or promotes at the last), ``max_failed_checks`` failures in
  a row roll back;
- unloads the canary of an ended rollout once the gateway has stopped sending it traffic.

Everything is in the database, so a restarted platform carries on where it was. Locks are taken deployment
first, then rollout, as the placement reports do.

The only writer of ``Rollout`` and ``RolloutAnalysis`` rows. What a rollout does to its deployment (a new
decision on the placements, the promotion's switch, a step in the deployment's history) it asks of the
deployments' owner, ``apps.deployments.services``; what ends a rollout there (an undeploy, or a canary that
fails to load: ``apps.deployments.reports``) comes back as a signal that ``apps.deployments.receivers``
hands to ``end_rollout``.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from apps.audit.services import record
from apps.deployments import analysis, checks, services
from apps.deployments.ensembles import check_no_ensemble_depends, check_steps_served
from apps.deployments.models import (
    Deployment,
    DeploymentState,
    PlacementState,
    Rollout,
    RolloutAnalysis,
    RolloutState,
    default_rollout_steps,
)
from apps.registry.models import ModelVersion

MAX_STEPS = 20


def check_steps(steps) -> list[int]:
    if not isinstance(steps, list) or not 1 <= len(steps) <= MAX_STEPS:
        raise ValidationError(
            {"steps": [f"Give 1-{MAX_STEPS} canary weights in percent, e.g. [10, 25, 50, 100]."]}
        )
    if not all(isinstance(step, int) and not isinstance(step, bool) and 1 <= step <= 100 for step in steps):
        raise ValidationError({"steps": ["Each step is a whole percentage from 1 to 100."]})
    if any(later <= earlier for earlier, later in zip(steps, steps[1:], strict=False)):
        raise ValidationError({"steps": ["Steps must increase, e.g. [10, 25, 50, 100]."]})
    if steps[-1] != 100:
        raise ValidationError({"steps": ["The last step must be 100 (the canary then takes every request)."]})
    return steps


def _bounded(errors: dict, name: str, value, low, high, what: str) -> None:
    if value is not None and not low <= value <= high:
        errors[name] = [f"{what} must be between {low} and {high}; got {value}."]


def check_gates(options: dict) -> None:
    """Bounds of the interval and the gates; raises one ValidationError listing every field out of bounds."""
    errors: dict[str, list[str]] = {}
    interval = options["step_interval_s"]
    _bounded(
        errors,
        "step_interval_s",
        interval,
        settings.ROLLOUT_MIN_INTERVAL_S,
        settings.ROLLOUT_MAX_INTERVAL_S,
        "The step interval (s)",
    )
    _bounded(errors, "min_success_rate", options["min_success_rate"], 0.0, 1.0, "The success rate gate")
    _bounded(errors, "max_p99_ms", options["max_p99_ms"], 0.1, 600_000, "The p99 gate (ms)")
    _bounded(errors, "max_p99_ratio", options["max_p99_ratio"], 1.0, 100.0, "The p99 ratio gate")
    _bounded(errors, "min_requests", options["min_requests"], 1, 1_000_000, "The minimum canary requests")
    _bounded(
        errors, "max_failed_checks", options["max_failed_checks"], 1, 100, "The failed checks before rollback"
    )
    _bounded(
        errors,
        "traffic_deadline_s",
        options["traffic_deadline_s"],
        interval,
        86_400,
        "The traffic deadline (s)",
    )
    if errors:
        raise ValidationError(errors)


def _latency_gate_needs_summaries(deployment: Deployment, options: dict) -> None:
    if options["max_p99_ms"] is None and options["max_p99_ratio"] is None:
        return
    blind = [
        str(p.instance)
        for p in deployment.placements.exclude(state=PlacementState.UNLOADED).select_related("instance__host")
        if not p.instance.latency_summaries
    ]
    if blind:
        raise ValidationError(
            {
                "max_p99_ms": [
                    f"A p99 gate needs real percentiles: instance {', '.join(blind)} runs without latency "
                    "summaries (turn on its latency_summaries, or start without a p99 gate)."
                ]
            }
        )


def start_rollout(
    *,
    actor,
    deployment: Deployment,
    canary: ModelVersion,
    steps: list[int] | None = None,
    step_interval_s: int = 60,
    min_success_rate: float = 0.99,
    max_p99_ms: float | None = None,
    max_p99_ratio: float | None = None,
    min_requests: int = 50,
    max_failed_checks: int = 3,
    traffic_deadline_s: int = 600,
) -> Rollout:
    """Start rolling ``canary`` out on a SERVING deployment: loaded beside the stable version everywhere at
    weight 0, then ``steps`` percent of the unversioned requests while the gates pass."""
    options = {
        "step_interval_s": step_interval_s,
        "min_success_rate": min_success_rate,
        "max_p99_ms": max_p99_ms,
        "max_p99_ratio": max_p99_ratio,
        "min_requests": min_requests,
        "max_failed_checks": max_failed_checks,
        "traffic_deadline_s": traffic_deadline_s,
    }
    steps = check_steps(default_rollout_steps() if steps is None else steps)
    check_gates(options)
    if canary.model_id != deployment.model_id:
        raise ValidationError({"version": [f"{canary} is not a version of {deployment.model}."]})
    checks.check_version_servable(canary)
    with transaction.atomic():
        checks.lock_servable(canary)
        deployment = (
            Deployment.objects.select_for_update(of=("self",)).select_related("team").get(pk=deployment.pk)
        )
        if deployment.state != DeploymentState.SERVING or deployment.active_version is None:
            raise ValidationError(
                {
                    "non_field_errors": [
                        f"The deployment is {deployment.state}; a rollout starts from SERVING."
                    ]
                }
            )
        staged = services.stage_steps(
            check_steps_served(canary, [p.instance for p in deployment.placements.select_related("instance")])
        )
        check_no_ensemble_depends(deployment, "rolled out", keep=canary)
        if canary.pk == deployment.active_version_id:
            raise ValidationError({"version": [f"{canary} is already the served version; pick another one."]})
        checks.check_no_live_rollout(deployment)
        _latency_gate_needs_summaries(deployment, options)
        rollout = Rollout.objects.create(
            deployment=deployment,
            stable_version=deployment.active_version,
            canary_version=canary,
            steps=steps,
            created_by=actor if getattr(actor, "is_authenticated", False) else None,
            **options,
        )
        # A new decision, states unchanged: the stable version keeps serving while the canary loads.
        placements = services.redecide(deployment)
        services.record_event(
            deployment,
            "rollout_started",
            f"rollout of {canary} beside {deployment.active_version}: steps {steps} %, "
            f"a check every {step_interval_s} s",
            version=canary,
            details={"rollout": rollout.pk, "weight": 0},
        )
        record(
            actor=actor,
            team=deployment.team,
            action="rollout.started",
            target=deployment,
            details={"rollout": rollout.pk, "canary": canary.number, "stable": rollout.stable_version.number,
                     "steps": steps, **options},
        )  # fmt: skip
        transaction.on_commit(lambda: services._enqueue([*placements, *staged]))
    return rollout


def _locked(rollout: Rollout) -> tuple[Deployment, Rollout]:
    deployment = (
        Deployment.objects.select_for_update(of=("self",))
        .select_related("team")
        .get(pk=rollout.deployment_id)
    )
    rollout = (
        Rollout.objects.select_for_update(of=("self",))
        .select_related("deployment__team", "stable_version", "canary_version")
        .get(pk=rollout.pk)
    )
    return deployment, rollout


def _not_live(rollout: Rollout) -> ValidationError:
    return ValidationError(
        {"non_field_errors": [f"The rollout is {rollout.state}; only a live rollout can change."]}
    )


def pause(*, actor, rollout: Rollout) -> Rollout:
    """Hold the rollout at its weight: no checks, no steps, until resumed."""
    with transaction.atomic():
        deployment, rollout = _locked(rollout)
        if rollout.state != RolloutState.RUNNING:
            raise ValidationError(
                {"non_field_errors": [f"The rollout is {rollout.state}; only RUNNING pauses."]}
            )
        rollout.state, rollout.next_check_at = RolloutState.PAUSED, None
        rollout.save(update_fields=["state", "next_check_at", "updated_at"])
        _event(rollout, "rollout_paused", f"paused at {rollout.current_weight} %")
        record(actor=actor, team=deployment.team, action="rollout.paused", target=deployment,
               details={"rollout": rollout.pk, "weight": rollout.current_weight})  # fmt: skip
    return rollout


def resume(*, actor, rollout: Rollout) -> Rollout:
    """Carry on from the step it was paused at; the next check is one interval away."""
    with transaction.atomic():
        deployment, rollout = _locked(rollout)
        if rollout.state != RolloutState.PAUSED:
            raise ValidationError(
                {"non_field_errors": [f"The rollout is {rollout.state}; only PAUSED resumes."]}
            )
        rollout.state = RolloutState.RUNNING
        if rollout.step_started_at is not None:
            rollout.next_check_at = timezone.now() + timedelta(seconds=rollout.step_interval_s)
        rollout.save(update_fields=["state", "next_check_at", "updated_at"])
        _event(rollout, "rollout_resumed", f"resumed at {rollout.current_weight} %")
        record(actor=actor, team=deployment.team, action="rollout.resumed", target=deployment,
               details={"rollout": rollout.pk, "weight": rollout.current_weight})  # fmt: skip
    return rollout


def promote_now(*, actor, rollout: Rollout) -> Rollout:
    """Skip the remaining steps: the canary becomes the served version (a zero-downtime switch)."""
    with transaction.atomic():
        deployment, rollout = _locked(rollout)
        if not rollout.is_live():
            raise _not_live(rollout)
        _promote(deployment, rollout, actor=actor, reason=f"promoted by {getattr(actor, 'username', actor)}")
    return rollout


def abort(*, actor, rollout: Rollout) -> Rollout:
    """Roll back now: weight 0, the canary unloaded, the stable version serving throughout."""
    with transaction.atomic():
        deployment, rollout = _locked(rollout)
        if not rollout.is_live():
            raise _not_live(rollout)
        reason = f"aborted by {getattr(actor, 'username', None) or 'the platform'}"
        end_rollout(rollout, RolloutState.ABORTED, reason=reason, actor=actor)
    return rollout


def _event(rollout: Rollout, kind: str, message: str, **details) -> None:
    services.record_event(
        rollout.deployment,
        kind,
        f"rollout of {rollout.canary_version}: {message}",
        version=rollout.canary_version,
        details={"rollout": rollout.pk, "weight": rollout.current_weight, **details},
    )


def end_rollout(
    rollout: Rollout, state: RolloutState, *, reason: str, actor=None, figures: dict | None = None
) -> None:
    """End a live rollout without promoting it: weight 0 at once (the gateway stops sending the canary
    traffic), the canary unloaded ``ROLLOUT_UNLOAD_DELAY_S`` later (by the beat task, ``unload_canary``), the
    stable version serving throughout. The caller holds the rollout's row lock inside a transaction."""
    now = timezone.now()
    rollout.state, rollout.reason, rollout.current_weight = state, reason, 0
    rollout.finished_at, rollout.next_check_at = now, None
    rollout.canary_unload_at = now + timedelta(seconds=settings.ROLLOUT_UNLOAD_DELAY_S)
    rollout.save(
        update_fields=[
            "state",
            "reason",
            "current_weight",
            "finished_at",
            "next_check_at",
            "canary_unload_at",
            "updated_at",
        ]
    )
    rolled_back = state == RolloutState.ROLLED_BACK
    deployment = rollout.deployment
    services.record_event(
        deployment,
        "rollout_rolled_back" if rolled_back else "rollout_aborted",
        f"{rollout.canary_version} {'rolled back' if rolled_back else 'aborted'}: {reason}; "
        f"{rollout.stable_version} keeps serving",
        version=rollout.canary_version,
        details={"weight": 0, "rollout": rollout.pk, "figures": figures or {}},
    )
    record(
        actor=actor,
        team=deployment.team,
        action="rollout.rolled_back" if rolled_back else "rollout.aborted",
        target=deployment,
        details={
            "rollout": rollout.pk,
            "canary": rollout.canary_version.number,
            "stable": rollout.stable_version.number,
            "reason": reason,
            "figures": figures or {},
        },
    )


def end_with_deployment(deployment: Deployment, *, actor) -> None:
    """The deployment is being undeployed (its row locked): its live rollout is aborted."""
    for rollout in Rollout.objects.live().select_for_update().filter(deployment=deployment):
        end_rollout(rollout, RolloutState.ABORTED, reason="the deployment was undeployed", actor=actor)


def roll_back_failed_canary(deployment: Deployment, canary: ModelVersion, error: str) -> None:
    """The canary failed to load on one of the deployment's instances (its row locked): a canary that does
    not load everywhere gets no traffic."""
    live = Rollout.objects.live().select_for_update().filter(deployment=deployment, canary_version=canary)
    for rollout in live:
        end_rollout(rollout, RolloutState.ROLLED_BACK, reason=f"the canary failed to load: {error}")


def unload_canary(rollout_id: int) -> int:
    """Once the gateway sends an ended rollout's canary nothing: a new decision on the placements, so their
    agents serve the stable version alone. Returns the placements decided (0: another beat did it)."""
    with transaction.atomic():
        claimed = Rollout.objects.filter(pk=rollout_id, canary_unload_at__isnull=False).update(
            canary_unload_at=None
        )
        if claimed != 1:
            return 0
        deployment_id = Rollout.objects.filter(pk=rollout_id).values_list("deployment_id", flat=True)[0]
        return services.serve_stable_alone(deployment_id)


def _promote(deployment: Deployment, rollout: Rollout, *, actor, reason: str) -> None:
    """The caller holds both locks. Reuses the switch: the canary, already loaded and tested beside the stable
    version, becomes the only one; clients keep calling the same name."""
    if deployment.state != DeploymentState.SERVING:
        raise ValidationError(
            {"non_field_errors": [f"The deployment is {deployment.state}; promote when it is SERVING."]}
        )
    now = timezone.now()
    rollout.state, rollout.current_weight, rollout.reason = RolloutState.PROMOTED, 100, reason
    rollout.finished_at, rollout.next_check_at = now, None
    rollout.save(
        update_fields=["state", "current_weight", "reason", "finished_at", "next_check_at", "updated_at"]
    )
    placements = services.promote(deployment, rollout.canary_version)
    _event(rollout, "rollout_promoted", f"promoted ({reason}); {rollout.stable_version} is unloaded")
    record(actor=actor, team=deployment.team, action="rollout.promoted", target=deployment,
           details={"rollout": rollout.pk, "canary": rollout.canary_version.number,
                    "stable": rollout.stable_version.number, "reason": reason})  # fmt: skip
    transaction.on_commit(lambda: services._enqueue(placements))


# --- The beat task's work ------------------------------------------------------------------------------


def check_rollouts(now=None) -> dict[str, int]:
    """One tick: unload ended canaries, begin rollouts whose canary loaded everywhere, run the due checks.
    Three indexed queries when nothing is live."""
    now = now or timezone.now()
    done = {"unloaded": 0, "begun": 0, "checked": 0}
    for pk in Rollout.objects.filter(canary_unload_at__lte=now).values_list("pk", flat=True):
        done["unloaded"] += bool(unload_canary(pk))
    waiting = Rollout.objects.filter(state=RolloutState.RUNNING, step_started_at__isnull=True)
    for rollout in waiting.select_related("deployment__model__team", "stable_version", "canary_version"):
        done["begun"] += begin_if_loaded(rollout, now)
    due = Rollout.objects.filter(state=RolloutState.RUNNING, next_check_at__lte=now)
    for pk, interval, due_at in due.values_list("pk", "step_interval_s", "next_check_at"):
        # Claim: only the beat whose UPDATE moves next_check_at from the value it read runs this check.
        # The next one is an interval after this one was due (no drift of a tick per check), never in the past.
        following = max(due_at + timedelta(seconds=interval), now + timedelta(seconds=interval / 2))
        claimed = Rollout.objects.filter(pk=pk, state=RolloutState.RUNNING, next_check_at=due_at).update(
            next_check_at=following
        )
        if claimed == 1:
            run_check(pk)
            done["checked"] += 1
    # Steps follow their ensembles (also right after an ensemble settles; this catches what a crash missed).
    done["steps"] = services.follow_ensemble_steps()
    return done


def _serving_both(rollout: Rollout) -> tuple[list, bool]:
    """The READY placements, and whether each serves the stable version with the canary beside it."""
    placements = [
        p
        for p in rollout.deployment.placements.select_related("instance__host")
        if p.state == PlacementState.READY
    ]
    loaded = bool(placements) and all(
        p.served_version_id == rollout.stable_version_id
        and p.canary_version_id == rollout.canary_version_id
        and p.is_applied()
        for p in placements
    )
    return placements, loaded


def begin_if_loaded(rollout: Rollout, now=None) -> bool:
    """Weight 0 -> the first step once every READY placement serves the canary beside the stable version. A
    canary still not loaded everywhere after ``traffic_deadline_s`` (an agent offline, a load that hangs) is
    rolled back: it never got traffic."""
    placements, loaded = _serving_both(rollout)
    if not loaded:
        now = now or timezone.now()
        if (now - rollout.created_at).total_seconds() >= rollout.traffic_deadline_s:
            with transaction.atomic():
                _, rollout = _locked(rollout)
                if rollout.state == RolloutState.RUNNING and rollout.step_started_at is None:
                    waiting = [
                        str(p.instance)
                        for p in placements
                        if p.canary_version_id != rollout.canary_version_id
                    ]
                    end_rollout(
                        rollout,
                        RolloutState.ROLLED_BACK,
                        reason=f"the canary was not loaded on every instance within {rollout.traffic_deadline_s} s"
                        + (f" (not on {', '.join(waiting)})" if waiting else " (no instance is READY)"),
                    )
        return False
    readings = analysis.read_instances([p.instance for p in placements])
    name = rollout.deployment.triton_model_name()
    with transaction.atomic():
        deployment, rollout = _locked(rollout)
        if rollout.state != RolloutState.RUNNING or rollout.step_started_at is not None:
            return False
        now = timezone.now()
        rollout.current_step, rollout.current_weight = 0, rollout.steps[0]
        rollout.step_started_at = rollout.window_started_at = now
        rollout.next_check_at = now + timedelta(seconds=rollout.step_interval_s)
        rollout.baseline = analysis.baseline_of(readings, name)
        rollout.save()
        _event(
            rollout, "rollout_step", f"the canary serves on every instance; weight {rollout.current_weight} %"
        )
    return True


def run_check(rollout_id: int) -> RolloutAnalysis | None:
    """One check of a claimed rollout: read, judge, record, act."""
    rollout = (
        Rollout.objects.select_related("deployment__model__team", "stable_version", "canary_version")
        .filter(pk=rollout_id)
        .first()
    )
    if rollout is None or rollout.state != RolloutState.RUNNING:
        return None
    placements, _ = _serving_both(rollout)
    serving = [p.instance for p in placements if p.canary_version_id == rollout.canary_version_id]
    readings = analysis.read_instances(serving)
    name = rollout.deployment.triton_model_name()
    seen_step = rollout.current_step
    with transaction.atomic():
        deployment, rollout = _locked(rollout)
        if rollout.state != RolloutState.RUNNING or rollout.current_step != seen_step:
            return None  # paused, ended or moved on while the instances were read
        now = timezone.now()
        window_start = rollout.window_started_at or rollout.step_started_at or now
        figures = analysis.window_figures(
            readings,
            rollout.baseline,
            name,
            {"stable": rollout.stable_version.number, "canary": rollout.canary_version.number},
            (now - window_start).total_seconds(),
        )
        unread = {str(r.instance_id): r.error for r in readings if r.error}
        if unread:
            figures["unread_instances"] = unread
        canary = figures["canary"]
        waited = (now - window_start).total_seconds()
        failed: list[dict] = []
        if canary["requests"] < rollout.min_requests:
            if waited < rollout.traffic_deadline_s:
                return RolloutAnalysis.objects.create(
                    rollout=rollout, checked_at=now, window_start=window_start, weight=rollout.current_weight,
                    passed=False, waiting=True, figures=figures,
                )  # fmt: skip
            failed.append(
                {"gate": "min_requests", "value": canary["requests"], "limit": rollout.min_requests,
                 "waited_s": round(waited)}
            )  # fmt: skip
        else:
            failed = analysis.failed_gates(rollout, canary, figures["stable"])
        check = RolloutAnalysis.objects.create(
            rollout=rollout, checked_at=now, window_start=window_start, weight=rollout.current_weight,
            passed=not failed, figures=figures, failed_gates=failed,
        )  # fmt: skip
        rollout.baseline = analysis.baseline_of(readings, name)
        rollout.window_started_at = now
        if failed:
            rollout.consecutive_failures += 1
            if rollout.consecutive_failures >= rollout.max_failed_checks:
                rollout.save()
                reason = (
                    f"{rollout.consecutive_failures} failed checks in a row at {rollout.current_weight} %: "
                    + "; ".join(describe_gate(gate) for gate in failed)
                )
                end_rollout(
                    rollout,
                    RolloutState.ROLLED_BACK,
                    reason=reason,
                    figures={"analysis": check.pk, "failed_gates": failed, **figures},
                )
                return check
            rollout.save()
            return check
        rollout.consecutive_failures = 0
        if rollout.current_step >= len(rollout.steps) - 1:
            rollout.save()
            # A deployment busy (e.g. reloading after a restart) is promoted by the next check.
            with contextlib.suppress(ValidationError):
                _promote(deployment, rollout, actor=None, reason="every check passed at 100 %")
            return check
        rollout.current_step += 1
        rollout.current_weight = rollout.steps[rollout.current_step]
        rollout.step_started_at = now
        rollout.save()
        _event(
            rollout, "rollout_step", f"checks passed; weight {rollout.current_weight} %", analysis=check.pk
        )
        return check


def describe_gate(gate: dict) -> str:
    """A failed gate in words, with the figure and the limit."""
    name, value, limit = gate["gate"], gate.get("value"), gate.get("limit")
    if name == "success_rate":
        return f"success rate {value:.2%} < {limit:.2%}"
    if name == "p99_ms":
        return f"p99 {value} ms > {limit} ms" if value is not None else "no p99 measured"
    if name == "p99_ratio":
        return f"p99 {gate['canary_p99_ms']} ms is {value}x the stable version's {gate['stable_p99_ms']} ms (> {limit}x)"
    if name == "min_requests":
        return f"{value} canary requests in {gate.get('waited_s')} s < {limit}"
    return f"{name} {value} (limit {limit})"
