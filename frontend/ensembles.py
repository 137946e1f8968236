"""Ensemble pages: the composer (steps picked from the team's own models, tensors wired in a small editor that
offers only what fits), and what a version page shows of an ensemble - its pipeline and each step's figures.

The composer posts the same spec as the compose API (``apps.registry.ensembles.compose_ensemble``); the
editor (static/frontend/ensemble.js) only builds it. Every check is the service's: a mistake comes back as
the service's messages, each naming the step and the tensor.
"""

from __future__ import annotations

import json
from datetime import timedelta

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.db.models import Sum
from django.shortcuts import redirect
from django.utils import timezone

from apps.deployments.models import Deployment, DeploymentState
from apps.monitoring.models import ModelMetrics
from apps.registry import ensembles
from apps.registry.models import ModelKind, ModelVersion, RegisteredModel, SourceFormat
from apps.teams.models import Action
from backend_ge import config as gc
from backend_ge.served_config import MAX_BATCH_SIZE
from frontend.registry import ModelPageView

FIGURES_WINDOW = timedelta(hours=24)
MAX_SPEC_BYTES = 64 * 1024


def _max_batch_size(version: ModelVersion) -> int:
    try:
        return gc.parse_config(version.config_text).max_batch_size
    except gc.ConfigError:
        return 0


def _serving_versions(team) -> dict[int, int]:
    """{model id: the version number its live deployment serves}."""
    rows = (
        Deployment.objects.filter(team=team, active_version__isnull=False)
        .exclude(state__in=(DeploymentState.UNDEPLOYING, DeploymentState.UNDEPLOYED))
        .values_list("model_id", "active_version__number")
    )
    return dict(rows)


def step_choices(user, team) -> list[dict]:
    """The team's models a step may call (not ensembles), each READY version with its signature and batch
    size, and which version "the version serving" means today: what the editor offers."""
    models = (
        RegisteredModel.objects.for_user(user)
        .filter(team=team)
        .exclude(kind=ModelKind.ENSEMBLE)
        .order_by("slug", "pk")
    )
    serving = _serving_versions(team)
    versions: dict[int, list[ModelVersion]] = {}
    for version in ModelVersion.objects.ready().filter(model__in=models).order_by("model_id", "-number"):
        versions.setdefault(version.model_id, []).append(version)
    out = []
    for model in models:
        ready = versions.get(model.pk)
        if not ready:
            continue
        numbers = [v.number for v in ready]
        out.append(
            {
                "slug": model.slug,
                "name": model.name,
                "serving": serving.get(model.pk) if serving.get(model.pk) in numbers else numbers[0],
                "versions": [
                    {"number": v.number, "signature": v.signature, "max_batch_size": _max_batch_size(v)}
                    for v in ready
                ],
            }
        )
    return out


class EnsembleComposeView(ModelPageView):
    """Compose a new version of an ensemble in the browser; posts the compose API's spec as JSON."""

    template_name = "frontend/registry/compose.html"
    required_action = Action.CHANGE

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context.update(
            choices=step_choices(self.request.user, self.team),
            max_batch_size_limit=MAX_BATCH_SIZE,
        )
        context.setdefault("spec", None)
        context.setdefault("errors", [])
        return context

    def post(self, request, *args, **kwargs):
        model = self.get_model()
        raw = request.POST.get("spec", "")
        errors: list[str] = []
        spec = None
        if len(raw.encode()) > MAX_SPEC_BYTES:
            errors.append(f"spec: the pipeline is larger than {MAX_SPEC_BYTES // 1024} KiB.")
        else:
            try:
                spec = json.loads(raw)
            except json.JSONDecodeError as exc:
                errors.append(f"spec: not valid JSON ({exc.msg}).")
        if spec is not None and not isinstance(spec, dict):
            errors.append("spec: an object with steps, inputs and outputs.")
            spec = None
        if spec is not None:
            try:
                version = ensembles.compose_ensemble(
                    actor=request.user, model=model, spec=spec, note=str(spec.get("note") or "")[:2000]
                )
            except ValidationError as error:
                errors = error_lines(error)
            else:
                messages.success(request, f"{version} composed: READY to deploy.")
                return redirect("version-detail", team_slug=self.team.slug, model_slug=model.slug,
                                number=version.number)  # fmt: skip
        return self.render_to_response(self.get_context_data(spec=spec, errors=errors), status=400)


def error_lines(error: ValidationError) -> list[str]:
    """The service's messages, each with the field path it names (``ensemble_scheduling.step[1]...``)."""
    if not hasattr(error, "error_dict"):
        return list(error.messages)
    return [f"{field}: {message}" for field, items in error.message_dict.items() for message in items]


# --- the version page --------------------------------------------------------------------------------


def _tensor(signature: dict, kind: str, name: str) -> dict:
    found = next((t for t in signature.get(kind, []) if t.get("name") == name), None) or {}
    return {"dtype": found.get("dtype", "?"), "dims": found.get("dims", [])}


def pipeline_of(version: ModelVersion) -> dict:
    """The pipeline as the version page draws it: the ensemble's inputs, each step with its wiring (step
    tensor, ensemble tensor, dtype and shape), the ensemble's outputs."""
    steps = []
    pinned = {
        s.position: s.step_version for s in version.ensemble_steps.select_related("step_version__model")
    }
    for step in ensembles.pipeline(version):
        called = pinned.get(step["position"])
        signature = called.signature if called else {}
        steps.append(
            {
                **step,
                "step_version": called,
                "inputs": [
                    {"step": k, "tensor": v, **_tensor(signature, "inputs", k)}
                    for k, v in step["input_map"].items()
                ],
                "outputs": [
                    {"step": k, "tensor": v, **_tensor(signature, "outputs", k)}
                    for k, v in step["output_map"].items()
                ],
            }
        )
    signature = version.signature or {}
    return {"inputs": signature.get("inputs", []), "outputs": signature.get("outputs", []), "steps": steps}


def step_figures(steps: list[dict], since) -> None:
    """Each step's figures over the window, from what the platform scrapes per model version: Triton counts
    every composing model's requests, queue and compute time. The slowest step (mean queue + compute per
    request) is marked."""
    for step in steps:
        called = step["step_version"]
        if called is None:
            step["figures"] = None
            continue
        sums = ModelMetrics.objects.filter(version=called, bucket__gte=since).aggregate(
            success=Sum("success"),
            failure=Sum("failure"),
            queue_us=Sum("queue_us"),
            compute_input_us=Sum("compute_input_us"),
            compute_infer_us=Sum("compute_infer_us"),
            compute_output_us=Sum("compute_output_us"),
        )
        requests = (sums["success"] or 0) + (sums["failure"] or 0)
        compute = sum(sums[k] or 0 for k in ("compute_input_us", "compute_infer_us", "compute_output_us"))
        step["figures"] = {
            "requests": requests,
            "failures": sums["failure"] or 0,
            "queue_ms": (sums["queue_us"] or 0) / requests / 1000 if requests else None,
            "compute_ms": compute / requests / 1000 if requests else None,
        }
    timed = [s for s in steps if s["figures"] and s["figures"]["requests"]]
    if len(timed) > 1:
        slowest = max(timed, key=lambda s: s["figures"]["queue_ms"] + s["figures"]["compute_ms"])
        slowest["figures"]["slowest"] = True


def ensemble_context(version: ModelVersion) -> dict:
    """What the version page adds for an ensemble version (nothing for a model's)."""
    if version.source_format != SourceFormat.ENSEMBLE:
        return {}
    pipeline = pipeline_of(version)
    step_figures(pipeline["steps"], timezone.now() - FIGURES_WINDOW)
    # "Update step X to version N": every other READY version of each step's model.
    updates = []
    for step in pipeline["steps"]:
        called = step["step_version"]
        if called is None:
            continue
        for other in called.model.versions.ready().exclude(pk=called.pk).order_by("-number"):
            updates.append(
                {
                    "value": f"{step['position']}:{other.number}",
                    "label": f"step[{step['position']}] {called.model.slug}: v{called.number} -> v{other.number}",
                }
            )
    return {"pipeline": pipeline, "step_updates": updates}
