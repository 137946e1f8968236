"""The version page's tuning panel: start a tuning job on a pool (maintainers), follow it (state, progress,
reason, log), see its curve - throughput against p99 for every measured point, one line per candidate as its
concurrency rose, the current and the recommended config marked, the objective drawn - and create a version
with the recommended config, which then rolls out like any version."""

from __future__ import annotations

import math
from collections.abc import Callable

from django import forms
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.shortcuts import redirect

from apps.deployments import scheduler, tuning_jobs
from apps.deployments.tuning_models import TuningJob
from apps.fleet.models import Pool
from apps.monitoring import retune
from apps.registry.models import ModelVersion
from frontend.ensembles import error_lines

JOBS_SHOWN = 5
WIDTH, HEIGHT, PAD = 640, 320, 48


class TuningForm(forms.Form):
    prefix = "tuning"

    pool = forms.ChoiceField(required=False, help_text="Any: the first usable pool with room.")
    budget_s = forms.IntegerField(
        min_value=tuning_jobs.BUDGET_RANGE_S[0],
        max_value=tuning_jobs.BUDGET_RANGE_S[1],
        initial=tuning_jobs.DEFAULT_BUDGET_S,
        label="Time budget (s)",
    )
    max_candidates = forms.IntegerField(
        min_value=tuning_jobs.MAX_CANDIDATES_RANGE[0],
        max_value=tuning_jobs.MAX_CANDIDATES_RANGE[1],
        initial=tuning_jobs.DEFAULT_MAX_CANDIDATES,
        label="Configs to measure",
    )
    max_instances = forms.IntegerField(min_value=1, initial=1, label="Most instances per config")

    def __init__(self, *args, team=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        names = list(Pool.objects.usable_by_team(team).order_by("name").values_list("name", flat=True))
        self.fields["pool"].choices = [("", "Any"), *((n, n) for n in names)]
        self.fields["max_instances"] = forms.IntegerField(
            min_value=1, max_value=team.model_instance_limit(), initial=1, label="Most instances per config"
        )


def _scale(
    values: list[float], size: int, *, log: bool = False
) -> tuple[Callable[[float], float], float, float]:
    low, high = min(values), max(values)
    if log:
        low, high = math.log10(max(low, 1e-3)), math.log10(max(high, 1e-3))
    if high - low < 1e-9:
        low, high = low - 1, high + 1
    span = high - low

    def at(value: float) -> float:
        v = math.log10(max(value, 1e-3)) if log else value
        return PAD + (v - low) / span * (size - 2 * PAD)

    return at, (10**low if log else low), (10**high if log else high)


def curve(job: TuningJob) -> dict | None:
    """The SVG geometry of a job's curve: x is p99 (ms, log scale), y throughput (requests/s)."""
    points = [p for p in job.points if p.get("errors", 0) == 0]
    if not points:
        return None
    objective = job.objective.get("p99_ms")
    xs = [p["p99_ms"] for p in points] + ([objective] if objective else [])
    ys = [p["throughput_rps"] for p in points] + [0.0]
    x_at, x_low, x_high = _scale(xs, WIDTH, log=True)
    y_at_raw, y_low, y_high = _scale(ys, HEIGHT)

    def y_at(value: float) -> float:
        return HEIGHT - y_at_raw(value)

    result = job.result or {}
    default, best = result.get("default"), result.get("recommended")
    series: dict[str, dict] = {}
    for p in points:
        key = repr(sorted(p["candidate"].items()))
        entry = series.setdefault(
            key,
            {
                "candidate": p["candidate"],
                "current": p["candidate"] == default,
                "recommended": p["candidate"] == best,
                "dots": [],
            },
        )
        entry["dots"].append(
            {
                "x": round(x_at(p["p99_ms"]), 1),
                "y": round(y_at(p["throughput_rps"]), 1),
                "title": f"concurrency {p['concurrency']}: {p['throughput_rps']:.0f} requests/s, "
                f"p99 {p['p99_ms']:.2f} ms",
            }
        )
    labels = {label["label"]: label for label in result.get("candidates", [])}
    for entry in series.values():
        entry["line"] = " ".join(f"{d['x']},{d['y']}" for d in entry["dots"])
        entry["label"] = next(
            (name for name, c in labels.items() if c["candidate"] == entry["candidate"]),
            str(entry["candidate"]),
        )
    return {
        "width": WIDTH,
        "height": HEIGHT,
        "pad": PAD,
        "series": sorted(series.values(), key=lambda s: (s["recommended"], s["current"])),
        "objective_x": round(x_at(objective), 1) if objective else None,
        "objective_ms": objective,
        "x_low": x_low,
        "x_high": x_high,
        "y_high": y_high,
        "right": WIDTH - PAD,
        "bottom": HEIGHT - PAD,
    }


def tuning_context(version: ModelVersion, team, *, form: TuningForm | None = None) -> dict:
    jobs = list(
        TuningJob.objects.filter(version=version).select_related("pool", "instance__host")[:JOBS_SHOWN]
    )
    latest = jobs[0] if jobs else None
    return {
        "tuning_form": form or TuningForm(team=team),
        "tunings": jobs,
        "tuning": latest,
        "tuning_curve": curve(latest) if latest else None,
        "tuning_objective": version.model.latency_objective(),
        "tuning_advice": retune.advice(version),
    }


def handle(view, request, version: ModelVersion, operation: str):
    """The page's tuning operations (the caller checked the role): a response, or None when the operation
    is not one of them."""
    here = redirect("version-detail", team_slug=view.team.slug, model_slug=version.model.slug,
                    number=version.number)  # fmt: skip
    if operation == "tune":
        form = TuningForm(request.POST, team=view.team)
        if not form.is_valid():
            return view.render_to_response(view.get_context_data(tuning_form=form), status=400)
        data = form.cleaned_data
        try:
            job = tuning_jobs.start_tuning(
                actor=request.user,
                version=version,
                pool=scheduler.usable_pool(view.team, data["pool"]),
                budget_s=data["budget_s"],
                max_candidates=data["max_candidates"],
                max_instances=data["max_instances"],
            )
        except ValidationError as error:
            for message in error_lines(error):
                form.add_error(None, message)
            return view.render_to_response(view.get_context_data(tuning_form=form), status=400)
        messages.success(request, f"Tuning {job.pk} started: {job.reason}.")
        return here
    if operation not in ("tune_cancel", "tune_apply", "tune_reconvert"):
        return None
    raw = request.POST.get("tuning", "")
    job = (
        TuningJob.objects.filter(version=version, pk=int(raw)).first()
        if raw.isdigit() and len(raw) < 10
        else None
    )
    if job is None:
        messages.error(request, "No such tuning job of this version.")
        return here
    try:
        if operation == "tune_cancel":
            tuning_jobs.cancel(actor=request.user, job=job)
            messages.success(request, f"Tuning {job.pk}: cancel requested.")
            return here
        if operation == "tune_reconvert":
            conversion = tuning_jobs.reconvert_with_gears(actor=request.user, job=job)
            messages.success(
                request,
                f"{conversion.version} converts with batch gears {conversion.options['batch_gears']}; "
                "roll it out once it is READY.",
            )
            return redirect("conversion-job", team_slug=view.team.slug, pk=conversion.pk)
        derived = tuning_jobs.create_recommended_version(actor=request.user, job=job)
    except ValidationError as error:
        messages.error(request, " ".join(error_lines(error)))
        return here
    messages.success(
        request,
        f"{derived} serves the same files with the recommended settings; roll it out from its deployment.",
    )
    return redirect("version-detail", team_slug=view.team.slug, model_slug=derived.model.slug,
                    number=derived.number)  # fmt: skip
