"""Pages of conversion jobs (live log and progress, re-run) and the config editor of a version."""

from __future__ import annotations

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.shortcuts import get_object_or_404, redirect
from django.urls import reverse

from apps.conversions import services
from apps.conversions.models import ConversionJob
from apps.deployments.models import Deployment, DeploymentState
from apps.registry.models import ModelVersion, VersionState
from apps.teams.models import Action
from frontend.pages import FOLLOWS_STATE, TeamPageView


class ConversionJobView(TeamPageView):
    """A job's state, progress bar and log. The progress partial polls itself every 2 s until the job has
    finished; then it is returned without its trigger, which ends the polling (NetBox script results)."""

    template_name = "frontend/conversions/job.html"

    def get_job(self) -> ConversionJob:
        jobs = ConversionJob.objects.for_user(self.request.user, Action.VIEW).filter(
            version__model__team=self.team
        )
        return get_object_or_404(jobs.select_related("version__model", "created_by"), pk=self.kwargs["pk"])

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        job = self.get_job()
        version = job.version
        context.update(
            job=job,
            version=version,
            # The next step once the version is READY: deploy it, or switch the model's live deployment to it.
            deployment=Deployment.objects.for_user(self.request.user)
            .filter(team=self.team, model=version.model)
            .exclude(state=DeploymentState.UNDEPLOYED)
            .first(),
            state_settled=job.is_finished(),
            can_rerun=self.can(Action.CHANGE) and job.is_finished() and version.state == VersionState.FAILED,
            other_jobs=version.conversion_jobs.exclude(pk=job.pk).order_by("-created_at")[:10],
        )
        return context

    def post(self, request, *args, **kwargs):
        self.require(Action.CHANGE)
        job = self.get_job()
        try:
            new_job = services.rerun_conversion(actor=request.user, version=job.version)
        except ValidationError as error:
            messages.error(request, " ".join(error.messages))
            return redirect("conversion-job", team_slug=self.team.slug, pk=job.pk)
        messages.success(request, f"Conversion of {job.version} queued again.", extra_tags=FOLLOWS_STATE)
        return redirect("conversion-job", team_slug=self.team.slug, pk=new_job.pk)


class ConversionJobProgressView(ConversionJobView):
    template_name = "frontend/conversions/progress.html"

    def get_context_data(self, **kwargs):
        # A polled partial: once the job has finished it also removes the flash that said it was queued.
        return {**super().get_context_data(**kwargs), "partial": True}


class VersionConfigView(TeamPageView):
    """Edit a READY version's config.pbtxt; server-side validation shows each error with its field path."""

    template_name = "frontend/conversions/config.html"

    def get_version(self) -> ModelVersion:
        versions = ModelVersion.objects.for_user(self.request.user, Action.VIEW).filter(model__team=self.team)
        return get_object_or_404(
            versions.select_related("model"),
            model__slug=self.kwargs["model_slug"],
            number=self.kwargs["number"],
        )

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        version = self.get_version()
        context.setdefault("config_text", version.config_text)
        context.setdefault("field_errors", {})
        context.update(
            version=version,
            editable=self.can(Action.CHANGE) and version.state == VersionState.READY,
            last_job=version.conversion_jobs.order_by("-created_at", "-id").first(),
        )
        return context

    def post(self, request, *args, **kwargs):
        self.require(Action.CHANGE)
        version = self.get_version()
        text = request.POST.get("config_text", "")
        try:
            services.update_config(actor=request.user, version=version, text=text)
        except ValidationError as error:
            errors = error.message_dict if hasattr(error, "error_dict") else {"config": error.messages}
            return self.render_to_response(
                self.get_context_data(config_text=text, field_errors=errors), status=400
            )
        messages.success(request, "Config saved and written to the model directory.")
        return redirect(
            reverse(
                "version-config-edit",
                kwargs={
                    "team_slug": self.team.slug,
                    "model_slug": version.model.slug,
                    "number": version.number,
                },
            )
        )
