"""Deployment pages: list, deploy form, and the deployment page with its live status (htmx polling while a
deploy, switch or undeploy is in flight), switch/undeploy actions, "How to call it" and the playground."""

from __future__ import annotations

from datetime import timedelta

from django import forms
from django.conf import settings
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator
from django.db import transaction
from django.db.models import Exists, OuterRef
from django.http import HttpResponse, HttpResponseBadRequest
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone

from apps.core.body_limits import PLAYGROUND_HINT, limit_body
from apps.deployments import autoscaling, calling, services
from apps.deployments.models import Deployment, DeploymentState, GatewayView, Spread
from apps.fleet.models import Pool, TritonInstance
from apps.gateway.metrics import deployment_summary
from apps.registry.models import ModelVersion, RegisteredModel
from apps.teams.models import Action
from backend_ge.config import ModelSignature
from frontend.monitoring import chart_context
from frontend.pages import FOLLOWS_STATE, TeamPageView
from frontend.views import add_service_errors

# States in which the agents are still working: the status partial keeps polling.
IN_FLIGHT = (
    DeploymentState.PENDING,
    DeploymentState.DEPLOYING,
    DeploymentState.SWITCHING,
    DeploymentState.UNDEPLOYING,
)
EVENTS_SHOWN = 30


class DeployForm(forms.Form):
    """Replicas the scheduler places in a pool (``placement=pool``), or instances picked by hand (pinned; a
    form posted without ``placement`` pins, as the form did before pools)."""

    model = forms.ChoiceField(label="Model")
    version = forms.TypedChoiceField(coerce=int, label="Version (READY)")
    placement = forms.ChoiceField(
        choices=[("pool", "Replicas in a pool"), ("instances", "Instances I pick")], required=False
    )
    replicas = forms.IntegerField(min_value=1, required=False, initial=1, label="Replicas")
    pool = forms.ChoiceField(required=False, label="Pool")
    spread = forms.ChoiceField(choices=Spread.choices, required=False, initial=Spread.HOST, label="Spread")
    instances = forms.TypedMultipleChoiceField(
        coerce=int, widget=forms.CheckboxSelectMultiple, label="Instances", required=False
    )
    # Autoscaling (replicas in a pool only): the bounds are apps.deployments.autoscaling.check_settings's,
    # applied with the deploy in one commit (a message names the field).
    autoscale = forms.BooleanField(required=False, label="Follow the traffic (autoscaling)")
    min_replicas = forms.IntegerField(required=False, label="Min replicas")
    max_replicas = forms.IntegerField(required=False, label="Max replicas")
    target_in_flight = forms.FloatField(required=False, label="Target in flight per replica")
    scale_down_window_s = forms.IntegerField(required=False, label="Scale-down window (s)")
    idle_period_s = forms.IntegerField(required=False, label="Idle period before sleeping (s)")

    def __init__(self, *args, team, model_slug: str | None, instances, pools=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.pool_rows = list(pools)
        self.fields["pool"].choices = [("", "Any pool my team may use")] + [
            (p.name, f"{p.name} ({p.get_executor_display()}{', dedicated' if p.team_id else ''})")
            for p in self.pool_rows
        ]
        self.fields["replicas"].widget.attrs["max"] = settings.SCHEDULER_MAX_REPLICAS
        self.fields["replicas"].validators.append(MaxValueValidator(settings.SCHEDULER_MAX_REPLICAS))
        self.default_placement = "pool" if self.pool_rows else "instances"
        ready = ModelVersion.objects.ready().filter(model=OuterRef("pk"))
        self.models = list(
            RegisteredModel.objects.filter(team=team).filter(Exists(ready)).order_by("name", "pk")
        )
        self.fields["model"].choices = [(m.slug, f"{m.name} ({m.slug})") for m in self.models]
        chosen = next(
            (m for m in self.models if m.slug == model_slug), self.models[0] if self.models else None
        )
        self.chosen_model = chosen
        versions = chosen.versions.ready().order_by("-number") if chosen else []
        self.fields["version"].choices = [(v.number, f"v{v.number}") for v in versions]
        self.instance_rows = list(instances)
        self.fields["instances"].choices = [(i.pk, str(i)) for i in self.instance_rows]

    def clean(self):
        data = super().clean()
        data["placement"] = data.get("placement") or "instances"
        if data["placement"] == "instances" and not data.get("instances") and "instances" not in self.errors:
            self.add_error("instances", "Pick at least one instance to deploy on.")
        if data["placement"] == "pool":
            data["replicas"] = data.get("replicas") or 1
            data["spread"] = data.get("spread") or Spread.HOST
            name = data.get("pool")
            data["pool"] = next((p for p in self.pool_rows if p.name == name), None) if name else None
        return data

    AUTOSCALING_PLACEHOLDERS = {"min_replicas": "1 (0: sleeps when idle)", "max_replicas": "the replicas",
                                "target_in_flight": "4", "scale_down_window_s": "300", "idle_period_s": "900"}  # fmt: skip

    def autoscaling_fields(self) -> list:
        return [(self[name], self.AUTOSCALING_PLACEHOLDERS[name]) for name in autoscaling.FIELDS]

    def autoscaling(self) -> dict | None:
        """The autoscaling settings given (the others keep their defaults), or None: not autoscaled."""
        data = self.cleaned_data
        if data.get("placement") == "instances" or not data.get("autoscale"):
            return None
        values = {name: data[name] for name in autoscaling.FIELDS if data.get(name) is not None}
        values.setdefault("min_replicas", 1)
        return values

    def intent(self) -> dict:
        """The keyword arguments of ``services.deploy_version`` for where it goes."""
        data = self.cleaned_data
        if data["placement"] == "instances":
            rows = {i.pk: i for i in self.instance_rows}
            return {"instances": [rows[pk] for pk in data["instances"]]}
        return {"replicas": data["replicas"], "pool": data["pool"], "spread": data["spread"]}


class DeploymentListView(TeamPageView):
    template_name = "frontend/deployments/list.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        deployments = list(
            Deployment.objects.for_user(self.request.user)
            .filter(team=self.team)
            .select_related("model__team", "active_version", "target_version")
            .prefetch_related("placements__instance__host")
        )
        GatewayView.annotate(deployments)
        context["deployments"] = deployments
        return context


class DeploymentCreateView(TeamPageView):
    """Model, one of its READY versions, and the instances to serve on. Changing the model refreshes the
    version choices through htmx (``hx-select`` picks the field out of this same page)."""

    template_name = "frontend/deployments/new.html"
    required_action = Action.CHANGE

    def instances(self):
        return (
            TritonInstance.objects.usable_by_team(self.team)
            .select_related("host__team")
            .order_by("host__name", "name")
        )

    def make_form(self, data=None) -> DeployForm:
        source = data if data is not None else self.request.GET
        initial = {"version": source.get("version")} if data is None else None
        return DeployForm(
            data,
            team=self.team,
            model_slug=source.get("model"),
            instances=self.instances(),
            pools=Pool.objects.usable_by_team(self.team).order_by("name"),
            initial=initial,
        )

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        form = context.setdefault("form", self.make_form())
        if not form.is_bound and len(form.instance_rows) == 1:
            form.initial["instances"] = [form.instance_rows[0].pk]  # the embedded default: nothing to pick
        return context

    def post(self, request, *args, **kwargs):
        form = self.make_form(request.POST)
        existing = None
        if form.is_valid():
            model = form.chosen_model
            version = model.versions.get(number=form.cleaned_data["version"])
            try:
                # One commit: a deployment whose autoscaling settings are refused is not left behind.
                with transaction.atomic():
                    deployment = services.deploy_version(
                        actor=request.user, model=model, version=version, **form.intent()
                    )
                    if (values := form.autoscaling()) is not None:
                        autoscaling.configure(actor=request.user, deployment=deployment, values=values)
            except ValidationError as error:
                add_service_errors(form, error)
                # "already deployed" names a deployment: link it.
                existing = (
                    Deployment.objects.for_user(request.user)
                    .filter(team=self.team, model=model)
                    .exclude(state=DeploymentState.UNDEPLOYED)
                    .first()
                )
            else:
                messages.success(
                    request,
                    f"Deploying {version}; this page follows it until it serves.",
                    extra_tags=FOLLOWS_STATE,
                )
                return redirect("deployment-detail", team_slug=self.team.slug, pk=deployment.pk)
        return self.render_to_response(
            self.get_context_data(form=form, existing_deployment=existing), status=400
        )


class DeploymentPageView(TeamPageView):
    def get_deployment(self) -> Deployment:
        deployments = (
            Deployment.objects.for_user(self.request.user)
            .filter(team=self.team)
            .select_related("model__team", "active_version", "target_version", "created_by")
        )
        return get_object_or_404(deployments, pk=self.kwargs["pk"])

    def status_context(self, deployment: Deployment) -> dict:
        return {
            "deployment": deployment,
            # Followed until callable: SERVING in the placements but not yet routed by the gateway polls on.
            "in_flight": deployment.reported_state() in IN_FLIGHT,
            "placements": deployment.placements.select_related("instance__host", "served_version"),
            "events": deployment.events.select_related("instance__host", "version")[:EVENTS_SHOWN],
        }


class DeploymentDetailView(DeploymentPageView):
    template_name = "frontend/deployments/detail.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        deployment = self.get_deployment()
        context.update(self.status_context(deployment))
        context["state_settled"] = not context["in_flight"]
        context["gateway"] = deployment_summary(deployment, timezone.now() - timedelta(hours=1))
        context.update(chart_context(self.request))
        context["api_url"] = reverse("team-model-metrics", args=[self.team.slug, deployment.model.slug])
        try:
            context["snippets"] = calling.snippets(deployment)
        except ValidationError:
            context["snippets"] = None
        version = calling.shown_version(deployment)
        if version is not None and version.signature:
            signature = ModelSignature.from_dict(version.signature)
            context["playground_inputs"] = [
                {
                    "index": index,
                    "tensor": tensor,
                    "shape": [-1, *tensor.dims] if signature.batched else list(tensor.dims),
                    "image": calling.is_image_shaped(tensor),
                }
                for index, tensor in enumerate(signature.inputs)
            ]
        context["switch_versions"] = (
            deployment.model.versions.ready().exclude(pk=deployment.active_version_id).order_by("-number")
        )
        context["can_switch"] = deployment.state in (DeploymentState.SERVING, DeploymentState.FAILED)
        return context

    def post(self, request, *args, **kwargs):
        self.require(Action.CHANGE)
        deployment = self.get_deployment()
        operation = request.POST.get("op", "")
        try:
            if operation == "switch":
                number = request.POST.get("version", "")
                version = deployment.model.versions.filter(
                    number=int(number) if number.isdigit() else 0
                ).first()
                if version is None:
                    raise ValidationError({"version": [f"{deployment.model} has no version '{number}'."]})
                services.switch_version(actor=request.user, deployment=deployment, version=version)
                messages.success(
                    request,
                    f"Switching to {version}; the old version serves until it is ready.",
                    extra_tags=FOLLOWS_STATE,
                )
            elif operation == "undeploy":
                services.undeploy(actor=request.user, deployment=deployment)
                messages.success(request, f"Undeploying {deployment.model}.", extra_tags=FOLLOWS_STATE)
            else:
                return HttpResponseBadRequest(f"Unknown operation '{operation}'.")
        except ValidationError as error:
            messages.error(request, " ".join(error.messages))
        return redirect("deployment-detail", team_slug=self.team.slug, pk=deployment.pk)


class DeploymentStatusView(DeploymentPageView):
    """The polled partial: state, versions, placements and events. Returned without its trigger once the
    deployment has settled, which ends the polling."""

    template_name = "frontend/deployments/partials/status.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context.update(self.status_context(self.get_deployment()), partial=True)
        return context


@limit_body("PLAYGROUND_MAX_BYTES", PLAYGROUND_HINT)
class PlaygroundView(DeploymentPageView):
    """Runs one inference (POST from the htmx form) and returns the result partial. Members of every role
    may use it, as in the API: inference on the endpoint is open anyway. Bodies over PLAYGROUND_MAX_BYTES
    are refused before they are read (apps.core.body_limits)."""

    template_name = "frontend/deployments/partials/playground_result.html"
    http_method_names = ["post"]

    @classmethod
    def body_too_large(cls, request, message: str) -> HttpResponse:
        # htmx swaps only successful responses; the partial shows the error itself.
        status = 200 if request.headers.get("HX-Request") else 413
        return render(request, cls.template_name, {"errors": [message]}, status=status)

    def post(self, request, *args, **kwargs):
        deployment = self.get_deployment()
        version = calling.shown_version(deployment)
        inputs = ModelSignature.from_dict(version.signature).inputs if version and version.signature else ()
        specs = {}
        for index, tensor in enumerate(inputs):
            mode = request.POST.get(f"mode_{index}", "random")
            specs[tensor.name] = calling.InputSpec(
                mode=mode,
                data=request.POST.get(f"data_{index}", ""),
                upload=request.FILES.get(f"file_{index}"),
            )
        context = {"team": self.team}
        status = 200
        try:
            context["result"] = calling.run_playground(deployment, specs).as_dict()
        except ValidationError as error:
            context["errors"], status = error.messages, 400
        except calling.PlaygroundUnavailable as exc:
            context["errors"], status = [str(exc)], 409
        if request.headers.get("HX-Request"):
            status = 200  # htmx swaps only successful responses; the partial shows the error itself
        return self.render_to_response(context, status=status)
