"""Fleet pages: hosts (status, heartbeat age, NPU inventory) and Triton instances (state, log tail,
start/stop/restart). Hosts are platform infrastructure, not team rows, so these pages are not under a team:
they show the hosts ``Host.objects.for_user`` allows (shared ones, those dedicated to the user's teams; staff
see all), and another team's dedicated host is a 404 here as in the API."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.mixins import LoginRequiredMixin
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import HttpResponseBadRequest
from django.shortcuts import get_object_or_404, redirect
from django.views.generic import TemplateView

from apps.deployments.models import DeploymentInstance, DeploymentState
from apps.fleet import services
from apps.fleet.models import Host, TritonInstance, is_platform_staff
from apps.teams.models import Action, team_ids_for

INSTANCE_ACTIONS = ("start", "stop", "restart")


class HostListView(LoginRequiredMixin, TemplateView):
    """Hosts; platform staff also add one here and see its one-time join token (once, on the answer page)."""

    template_name = "frontend/fleet/hosts.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context["hosts"] = (
            Host.objects.for_user(self.request.user)
            .select_related("team")
            .prefetch_related("devices", "instances")
            .order_by("name")
        )
        context["is_staff"] = is_platform_staff(self.request.user)
        context["platform_url"] = self.request.build_absolute_uri("/").rstrip("/")
        return context

    def post(self, request, *args, **kwargs):
        if not is_platform_staff(request.user):
            raise PermissionDenied("Only platform staff may add hosts.")
        name, address = request.POST.get("name", "").strip(), request.POST.get("address", "").strip()
        try:
            if Host.objects.filter(name=name).exists():
                raise ValidationError({"name": [f"A host named '{name}' already exists."]})
            host, token = services.create_host(actor=request.user, name=name, address=address)
        except ValidationError as exc:
            context = self.get_context_data(form_error="; ".join(exc.messages), form=request.POST)
            return self.render_to_response(context, status=400)
        return self.render_to_response(self.get_context_data(new_host=host, join_token=token))


class HostDetailView(LoginRequiredMixin, TemplateView):
    template_name = "frontend/fleet/host_detail.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        host = get_object_or_404(
            Host.objects.for_user(self.request.user).select_related("team"), name=self.kwargs["host_name"]
        )
        context.update(
            host=host,
            devices=host.devices.all(),
            instances=host.instances.all(),
            can_operate=host.can_be_operated_by(self.request.user),
            is_staff=is_platform_staff(self.request.user),
            platform_url=self.request.build_absolute_uri("/").rstrip("/"),
        )
        return context

    def post(self, request, *args, **kwargs):
        """Staff: a new one-time join token for the host's agent, or revoke the host's credential."""
        host = get_object_or_404(Host.objects.for_user(request.user), name=self.kwargs["host_name"])
        if not is_platform_staff(request.user):
            raise PermissionDenied("Only platform staff may issue join tokens or revoke hosts.")
        operation = request.POST.get("op", "")
        if operation == "join-token":
            token = services.issue_join_token(actor=request.user, host=host)
            return self.render_to_response(self.get_context_data(join_token=token))
        if operation == "revoke":
            services.revoke_host(actor=request.user, host=host)
            messages.success(request, f"{host.name} is revoked: its agent's calls are refused from now on.")
            return redirect("host-detail", host_name=host.name)
        return HttpResponseBadRequest(f"Unknown operation '{operation}'; use join-token or revoke.")


class InstanceDetailView(LoginRequiredMixin, TemplateView):
    """An instance's state, last error, the caller's placements on it (with their errors) and, for
    platform staff, the log tail. Start/stop/restart post through htmx and get the state
    partial back; it polls itself while the agent moves the instance, and stops once it has arrived."""

    template_name = "frontend/fleet/instance_detail.html"

    def get_instance(self) -> TritonInstance:
        instances = TritonInstance.objects.for_user(self.request.user).select_related("host__team")
        return get_object_or_404(
            instances, host__name=self.kwargs["host_name"], name=self.kwargs["instance_name"]
        )

    def get_template_names(self):
        if self.request.headers.get("HX-Request"):
            return ["frontend/fleet/partials/instance_state.html"]
        return [self.template_name]

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        instance = kwargs.get("instance") or self.get_instance()
        placements = (
            DeploymentInstance.objects.filter(
                instance=instance, deployment__team__in=team_ids_for(self.request.user, Action.VIEW)
            )
            .exclude(deployment__state=DeploymentState.UNDEPLOYED)
            .select_related("deployment__model__team", "deployment__team", "served_version")
        )
        context.update(
            instance=instance,
            host=instance.host,
            can_operate=instance.host.can_be_operated_by(self.request.user),
            # A shared instance's log names every team's models, their load errors and host paths.
            show_log_tail=is_platform_staff(self.request.user),
            placements=placements,
        )
        return context

    def post(self, request, *args, **kwargs):
        instance = self.get_instance()
        if not instance.host.can_be_operated_by(request.user):
            raise PermissionDenied(
                f"You may not start, stop or restart the instances of {instance.host.name}."
            )
        operation = request.POST.get("op", "")
        if operation not in INSTANCE_ACTIONS:
            return HttpResponseBadRequest(f"Unknown operation '{operation}'.")
        instance = services.request_instance_state(actor=request.user, instance=instance, action=operation)
        if request.headers.get("HX-Request"):
            return self.render_to_response(self.get_context_data(instance=instance))
        messages.success(request, f"{operation.title()} requested for {instance}.")
        return redirect("instance-detail", host_name=instance.host.name, instance_name=instance.name)
