"""Pages of the model registry: models list, new model, model detail with versions, upload page.

The upload itself runs in the browser (static/frontend/upload.js) against the REST upload API, so the page
and API clients share one protocol: chunks over XHR for a real progress bar, resume from the server offset.
"""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.db.models import Count, Prefetch, Q
from django.http import HttpResponseBadRequest
from django.shortcuts import get_object_or_404, redirect
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from apps.deployments.models import (
    Deployment,
    DeploymentInstance,
    DeploymentState,
    GatewayView,
    PlacementState,
)
from apps.registry import objectives, services, versions
from apps.registry.formats import EXTENSIONS
from apps.registry.models import ModelKind, ModelVersion, RegisteredModel, TaskType
from apps.registry.options import INPUT_FORMATS, PRECISION_MODES, SERVING_DEFAULTS
from apps.teams.models import Action
from backend_ge import tuning
from backend_ge.served_config import MAX_BATCH_SIZE, MAX_INSTANCE_COUNT
from frontend.pages import TeamPageView
from frontend.views import add_service_errors


class ModelForm(forms.Form):
    name = forms.CharField(max_length=100)
    slug = forms.CharField(
        max_length=50,
        required=False,
        help_text="Lowercase letters, digits and hyphens; part of the Triton model name. Derived from the name when empty.",
    )
    task_type = forms.ChoiceField(choices=TaskType.choices, initial=TaskType.OTHER, label="Task")
    kind = forms.ChoiceField(
        choices=ModelKind.choices,
        initial=ModelKind.MODEL,
        required=False,
        help_text="An ensemble is a pipeline of the team's own models: compose it here or upload a Triton ensemble "
        "directory. Until it has a version, the model takes its kind from its first upload.",
    )
    description = forms.CharField(widget=forms.Textarea(attrs={"rows": 3}), required=False)


class ObjectiveForm(forms.Form):
    """The model's latency objective; an empty p99 clears it, an empty rate means "the most throughput"."""

    objective_p99_ms = forms.FloatField(
        required=False,
        label="p99 within (ms)",
        help_text=f"{tuning.P99_MS_RANGE[0]:g} to {tuning.P99_MS_RANGE[1]:g} ms; empty: no objective.",
    )
    objective_rate_rps = forms.FloatField(
        required=False,
        label="at requests/s",
        help_text="Empty: the most throughput with p99 within the objective.",
    )


def in_use_message(team_slug: str, error: services.ModelInUse | versions.VersionInUse):
    """A refusal to archive or delete (a version or a model) with each deployment it names linked."""
    links = format_html_join(
        " · ",
        '<a href="{}">{}</a>',
        (
            (reverse("deployment-detail", args=[team_slug, use.target_id]), use.message)
            for use in error.uses
            if use.target_type == "deployment"
        ),
    )
    return format_html("{} {}", str(error), links) if links else str(error)


def serving_by_model(user, team) -> dict[int, Deployment]:
    """The live deployment of each of a team's models, with its placements (which version serves where)."""
    placements = DeploymentInstance.objects.exclude(state=PlacementState.UNLOADED).select_related(
        "instance__host", "served_version"
    )
    deployments = (
        Deployment.objects.for_user(user)
        .filter(team=team)
        .exclude(state=DeploymentState.UNDEPLOYED)
        .select_related("active_version", "target_version")
        .prefetch_related(Prefetch("placements", queryset=placements))
    )
    deployments = list(deployments)
    GatewayView.annotate(deployments)
    return {deployment.model_id: deployment for deployment in deployments}


class ModelListView(TeamPageView):
    template_name = "frontend/registry/models.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        query = self.request.GET.get("q", "").strip()
        models = (
            RegisteredModel.objects.for_user(self.request.user)
            .filter(team=self.team)
            .annotate(version_count=Count("versions"))
            .order_by("name", "pk")
        )
        if query:
            models = models.filter(
                Q(name__icontains=query) | Q(slug__icontains=query) | Q(description__icontains=query)
            )
        models = list(models)
        latest = ModelVersion.objects.latest_ready_by_model(m.pk for m in models)
        serving = serving_by_model(self.request.user, self.team)
        for model in models:
            model.latest = latest.get(model.pk)
            model.deployment = serving.get(model.pk)
        context.update(models=models, query=query)
        return context

    def get_template_names(self):
        if self.request.headers.get("HX-Request"):
            return ["frontend/registry/partials/model_table.html"]
        return [self.template_name]


class ModelCreateView(TeamPageView):
    template_name = "frontend/registry/model_new.html"
    required_action = Action.CHANGE

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context.setdefault("form", ModelForm())
        return context

    def post(self, request, *args, **kwargs):
        form = ModelForm(request.POST)
        if form.is_valid():
            try:
                model = services.create_model(
                    actor=request.user,
                    team=self.team,
                    name=form.cleaned_data["name"],
                    slug=form.cleaned_data["slug"] or None,
                    task_type=form.cleaned_data["task_type"],
                    description=form.cleaned_data["description"],
                    kind=form.cleaned_data["kind"] or ModelKind.MODEL,
                )
            except ValidationError as error:
                add_service_errors(form, error)
            else:
                if model.is_ensemble():
                    messages.success(request, f"Ensemble {model.name} created. Compose its first version.")
                    return redirect("ensemble-compose", team_slug=self.team.slug, model_slug=model.slug)
                messages.success(request, f"Model {model.name} created. Upload its first version.")
                return redirect("model-upload", team_slug=self.team.slug, model_slug=model.slug)
        return self.render_to_response(self.get_context_data(form=form), status=400)


class ModelPageView(TeamPageView):
    """A page about one model of the team; another team's model is a 404 like everything else."""

    def dispatch(self, request, *args, **kwargs):
        self.model_slug = kwargs["model_slug"]
        return super().dispatch(request, *args, **kwargs)

    def get_model(self) -> RegisteredModel:
        return get_object_or_404(
            RegisteredModel.objects.for_user(self.request.user).filter(team=self.team), slug=self.model_slug
        )

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context["model"] = self.get_model()
        return context


class ModelDetailView(ModelPageView):
    template_name = "frontend/registry/model_detail.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        versions = list(
            context["model"]
            .versions.select_related("created_by")
            .prefetch_related("conversion_jobs")
            .order_by("-number")
        )
        for version in versions:
            jobs = sorted(version.conversion_jobs.all(), key=lambda j: (j.created_at, j.pk), reverse=True)
            version.latest_job = jobs[0] if jobs else None
        context["versions"] = versions
        model = context["model"]
        context.setdefault(
            "objective_form",
            ObjectiveForm(
                initial={
                    "objective_p99_ms": model.objective_p99_ms,
                    "objective_rate_rps": model.objective_rate_rps,
                }
            ),
        )
        context.setdefault(
            "form",
            ModelForm(
                initial={
                    "name": context["model"].name,
                    "slug": context["model"].slug,
                    "task_type": context["model"].task_type,
                    "description": context["model"].description,
                }
            ),
        )
        return context

    def post(self, request, *args, **kwargs):
        self.require(Action.CHANGE)
        model = self.get_model()
        operation = request.POST.get("op", "")
        if operation == "delete":
            try:
                services.delete_model(actor=request.user, model=model)
            except services.ModelInUse as error:
                messages.error(request, in_use_message(self.team.slug, error))
                return redirect("model-detail", team_slug=self.team.slug, model_slug=model.slug)
            messages.success(request, f"Model {model.name} and its versions deleted.")
            return redirect("models", team_slug=self.team.slug)
        if operation == "objective":
            form = ObjectiveForm(request.POST)
            if form.is_valid():
                try:
                    objectives.set_latency_objective(
                        actor=request.user,
                        model=model,
                        p99_ms=form.cleaned_data["objective_p99_ms"],
                        rate_rps=form.cleaned_data["objective_rate_rps"],
                    )
                except ValidationError as error:
                    add_service_errors(form, error)
                else:
                    objective = model.latency_objective()
                    messages.success(
                        request,
                        f"Latency objective: {objective.describe()}."
                        if objective
                        else "Latency objective cleared.",
                    )
                    return redirect("model-detail", team_slug=self.team.slug, model_slug=model.slug)
            return self.render_to_response(self.get_context_data(objective_form=form), status=400)
        if operation == "edit":
            form = ModelForm(request.POST)
            if form.is_valid():
                try:
                    services.update_model(
                        actor=request.user,
                        model=model,
                        name=form.cleaned_data["name"],
                        task_type=form.cleaned_data["task_type"],
                        description=form.cleaned_data["description"],
                    )
                except ValidationError as error:
                    add_service_errors(form, error)
                else:
                    messages.success(request, "Model updated.")
                    return redirect("model-detail", team_slug=self.team.slug, model_slug=model.slug)
            return self.render_to_response(self.get_context_data(form=form), status=400)
        return HttpResponseBadRequest(f"Unknown operation '{operation}'.")


class ModelUploadView(ModelPageView):
    template_name = "frontend/registry/upload.html"
    required_action = Action.CHANGE

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context.update(
            serving=SERVING_DEFAULTS,
            max_instances=MAX_INSTANCE_COUNT,
            max_batch_size=MAX_BATCH_SIZE,
            precision_modes=PRECISION_MODES,
            input_formats=INPUT_FORMATS,
            extensions=", ".join(EXTENSIONS),
            max_bytes=services.upload_max_bytes(),
        )
        return context
