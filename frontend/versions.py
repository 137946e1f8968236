"""The page of one model version: what it is (signature, served config, sizes, sha256, format), how it was
made (its conversion jobs, the ATC command, the duration), where it serves, its figures, and what a
maintainer does with it (note and tags, archive or restore, delete; refused while it is in use)."""

from __future__ import annotations

from datetime import timedelta

from django import forms
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.db.models import Q, Sum
from django.http import HttpResponseBadRequest
from django.shortcuts import get_object_or_404, redirect
from django.urls import reverse
from django.utils import timezone

from apps.conversions import services as conversions
from apps.deployments.models import Deployment, DeploymentInstance, DeploymentState, PlacementState
from apps.monitoring.models import ModelMetrics
from apps.registry import ensembles, versions
from apps.registry.models import MAX_NOTE_LENGTH, ModelVersion
from apps.teams.models import Action
from backend_ge import config as gc
from backend_ge import tuning
from backend_ge.served_config import MAX_BATCH_SIZE, MAX_INSTANCE_COUNT, MAX_QUEUE_DELAY_US
from frontend import tuning as tuning_panel
from frontend.ensembles import ensemble_context, error_lines
from frontend.registry import ModelPageView, in_use_message

FIGURES_WINDOW = timedelta(hours=24)


class VersionNotesForm(forms.Form):
    note = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 3}), required=False, max_length=MAX_NOTE_LENGTH
    )
    tags = forms.CharField(
        required=False,
        max_length=400,
        help_text="Comma-separated, e.g. prod, int8 (lowercase letters, digits, . _ -).",
    )


class ServingSettingsForm(forms.Form):
    """The settings tuning changes; a new version serves the same files with them. Its fields are prefixed
    (``serving-note``): the page's notes form has a ``note`` of its own."""

    prefix = "serving"

    dynamic_batching = forms.BooleanField(required=False)
    max_batch_size = forms.IntegerField(min_value=0, max_value=MAX_BATCH_SIZE)
    max_queue_delay_us = forms.IntegerField(
        min_value=0, max_value=MAX_QUEUE_DELAY_US, required=False, label="Max queue delay (us)"
    )
    preferred = forms.CharField(
        required=False,
        max_length=200,
        label="Preferred batch sizes",
        help_text="Comma-separated, e.g. 8, 16.",
    )
    instance_count = forms.IntegerField(min_value=1, max_value=MAX_INSTANCE_COUNT)
    note = forms.CharField(required=False, max_length=MAX_NOTE_LENGTH)

    def clean_preferred(self) -> tuple[int, ...]:
        parts = [p.strip() for p in self.cleaned_data["preferred"].split(",") if p.strip()]
        if not all(p.isdigit() and 1 <= int(p) <= MAX_BATCH_SIZE for p in parts) or len(parts) > 16:
            raise ValidationError(
                f"Give up to 16 batch sizes from 1 to {MAX_BATCH_SIZE}, separated by commas."
            )
        return tuple(sorted({int(p) for p in parts}))

    def candidate(self) -> tuning.Candidate:
        data = self.cleaned_data
        return tuning.Candidate(
            dynamic_batching=data["dynamic_batching"],
            max_batch_size=data["max_batch_size"],
            max_queue_delay_us=data["max_queue_delay_us"] or 0,
            preferred=data["preferred"],
            instance_count=data["instance_count"],
        )


def serving_candidate(version: ModelVersion) -> tuning.Candidate | None:
    """The serving settings of a READY model version's config (None for an ensemble or an unreadable one)."""
    if version.model.is_ensemble() or not version.config_text:
        return None
    try:
        return tuning.Candidate.from_config(gc.parse_config(version.config_text))
    except gc.ConfigError:
        return None


def directory_size(path) -> int | None:
    """Bytes of the files below ``path`` (the servable model directory), None when it is not there."""
    if not path.is_dir():
        return None
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


class VersionDetailView(ModelPageView):
    template_name = "frontend/registry/version_detail.html"

    def get_version(self) -> ModelVersion:
        return get_object_or_404(
            ModelVersion.objects.for_user(self.request.user, Action.VIEW)
            .filter(model__team=self.team, model__slug=self.model_slug)
            .select_related("model__team", "created_by"),
            number=self.kwargs["number"],
        )

    def figures(self, version: ModelVersion) -> dict:
        rows = ModelMetrics.objects.filter(version=version, bucket__gte=timezone.now() - FIGURES_WINDOW)
        sums = rows.aggregate(
            success=Sum("success"),
            failure=Sum("failure"),
            inferences=Sum("inferences"),
            request_us=Sum("request_us"),
        )
        requests = (sums["success"] or 0) + (sums["failure"] or 0)
        return {
            "requests": requests,
            "failures": sums["failure"] or 0,
            "inferences": sums["inferences"] or 0,
            "avg_ms": (sums["request_us"] or 0) / requests / 1000 if requests else None,
        }

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        version = self.get_version()
        jobs = list(version.conversion_jobs.select_related("created_by").order_by("-created_at", "-id"))
        live = (
            Deployment.objects.for_user(self.request.user)
            .filter(team=self.team, model=version.model)
            .exclude(state=DeploymentState.UNDEPLOYED)
            .filter(
                Q(active_version=version) | Q(target_version=version) | Q(placements__served_version=version)
            )
            .distinct()
        )
        placements = (
            DeploymentInstance.objects.filter(deployment__in=live, served_version=version)
            .exclude(state=PlacementState.UNLOADED)
            .select_related("instance__host", "deployment")
        )
        current = serving_candidate(version)
        if current is not None:
            context.setdefault(
                "serving_form",
                ServingSettingsForm(
                    initial={**current.as_dict(), "preferred": ", ".join(map(str, current.preferred))},
                    prefix=ServingSettingsForm.prefix,
                ),
            )
        context.update(serving_settings=current)
        if current is not None:
            context.update(
                tuning_panel.tuning_context(version, self.team, form=context.get("tuning_form")),
            )
        context.setdefault(
            "notes_form", VersionNotesForm(initial={"note": version.note, "tags": ", ".join(version.tags)})
        )
        context.update(
            version=version,
            jobs=jobs,
            latest_job=jobs[0] if jobs else None,
            deployments=list(live),
            placements=list(placements),
            model_bytes=directory_size(version.servable_dir()),
            figures=self.figures(version),
            figures_hours=int(FIGURES_WINDOW.total_seconds() // 3600),
            **ensemble_context(version),
        )
        return context

    def post(self, request, *args, **kwargs):
        self.require(Action.CHANGE)
        version = self.get_version()
        operation = request.POST.get("op", "")
        here = reverse("version-detail", args=[self.team.slug, version.model.slug, version.number])
        if operation.startswith("tune"):
            response = tuning_panel.handle(self, request, version, operation)
            if response is not None:
                return response
        try:
            if operation == "notes":
                form = VersionNotesForm(request.POST)
                if not form.is_valid():
                    return self.render_to_response(self.get_context_data(notes_form=form), status=400)
                tags = [t for t in (part.strip() for part in form.cleaned_data["tags"].split(",")) if t]
                try:
                    versions.update_version(
                        actor=request.user, version=version, note=form.cleaned_data["note"], tags=tags
                    )
                except ValidationError as error:
                    for message in error.messages:
                        form.add_error("tags" if "tag" in message else "note", message)
                    return self.render_to_response(self.get_context_data(notes_form=form), status=400)
                messages.success(request, "Note and tags saved.")
            elif operation == "derive":
                form = ServingSettingsForm(request.POST, prefix=ServingSettingsForm.prefix)
                current = serving_candidate(version)
                if current is None:
                    return HttpResponseBadRequest("This version has no serving settings of its own.")
                if not form.is_valid():
                    return self.render_to_response(self.get_context_data(serving_form=form), status=400)
                text = gc.render_config(form.candidate().apply(gc.parse_config(version.config_text)))
                try:
                    derived = conversions.derive_version(
                        actor=request.user, version=version, text=text, note=form.cleaned_data["note"]
                    )
                except ValidationError as error:
                    for message in error_lines(error):
                        form.add_error(None, message)
                    return self.render_to_response(self.get_context_data(serving_form=form), status=400)
                messages.success(
                    request,
                    f"{derived} serves the same files with the new settings; roll it out from its deployment.",
                )
                return redirect("version-detail", team_slug=self.team.slug, model_slug=derived.model.slug,
                                number=derived.number)  # fmt: skip
            elif operation == "update_step":
                position, _, number = request.POST.get("step_update", "").partition(":")
                if not (position.isdigit() and number.isdigit()):
                    return HttpResponseBadRequest("Pick a step and a version.")
                try:
                    new = ensembles.update_step(
                        actor=request.user, version=version, step=int(position), step_version=int(number)
                    )
                except ValidationError as error:
                    messages.error(request, " ".join(error_lines(error)))
                    return redirect(here)
                messages.success(
                    request, f"{new} calls the new step version; roll it out from the ensemble's deployment."
                )
                return redirect("version-detail", team_slug=self.team.slug, model_slug=new.model.slug,
                                number=new.number)  # fmt: skip
            elif operation == "archive":
                versions.archive_version(actor=request.user, version=version)
                messages.success(request, f"{version} archived: it is no longer offered to deploy.")
            elif operation == "unarchive":
                versions.unarchive_version(actor=request.user, version=version)
                messages.success(request, f"{version} restored.")
            elif operation == "delete":
                versions.delete_version(actor=request.user, version=version)
                messages.success(request, f"{version} and its files deleted.")
                return redirect("model-detail", team_slug=self.team.slug, model_slug=version.model.slug)
            else:
                return HttpResponseBadRequest(f"Unknown operation '{operation}'.")
        except versions.VersionInUse as error:
            messages.error(request, in_use_message(self.team.slug, error))
        return redirect(here)
