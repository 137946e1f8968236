"""Fleet pages: hosts (status, heartbeat age, NPU inventory) and Triton instances (state, log tail,
start/stop/restart). Hosts are platform infrastructure, not team rows, so these pages are not under a team:
they show the hosts ``Host.objects.for_user`` allows (shared ones, those dedicated to the user's teams; staff
see all), and another team's dedicated host is a 404 here as in the API."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.mixins import LoginRequiredMixin
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import Q
from django.http import HttpResponseBadRequest
from django.shortcuts import get_object_or_404, redirect
from django.views.generic import TemplateView

from apps.deployments import healing, scheduler
from apps.deployments.models import DeploymentInstance, DeploymentState, PlacementState
from apps.fleet import pools, services
from apps.fleet.models import Host, PlacementPolicy, Pool, TritonInstance, is_platform_staff
from apps.teams.models import Action, team_ids_for

INSTANCE_ACTIONS = ("start", "stop", "restart")
CORDON_OPS = {"cordon": (True, False), "drain": (True, True), "uncordon": (False, False)}


def with_capacity(user, instances: list[TritonInstance]) -> list[TritonInstance]:
    """Each instance with ``usage`` (capacity, used, free: what the scheduler reads) and ``replicas``: the
    live placements on it the user may see, plus ``other_replicas``, how many belong to other teams (a
    shared instance must not name another team's models)."""
    usage = scheduler.instance_usage(instances)
    visible = set(team_ids_for(user, Action.VIEW))
    staff = is_platform_staff(user)
    rows = (
        DeploymentInstance.objects.filter(instance__in=instances)
        .exclude(state=PlacementState.UNLOADED)
        .exclude(deployment__state=DeploymentState.UNDEPLOYED)
        .select_related("deployment__model", "deployment__team")
        .order_by("deployment__team__slug", "deployment__model__slug")
    )
    by_instance: dict[int, list] = {i.pk: [] for i in instances}
    for placement in rows:
        by_instance[placement.instance_id].append(placement)
    for instance in instances:
        instance.usage = usage[instance.pk]
        placements = by_instance[instance.pk]
        instance.replicas = [p for p in placements if staff or p.deployment.team_id in visible]
        instance.other_replicas = len(placements) - len(instance.replicas)
    return instances


def drain_progress(user, host: Host) -> dict | None:
    """A draining host, or one with template instances its pool no longer wants: replicas still on it, the
    ones moving now (replaced, waiting to unload), and the pinned ones that hold the drain (the user sees the
    deployments of their teams by name, the others counted)."""
    unwanted = [i for i in host.instances.all() if i.unwanted_since is not None]
    if host.draining_at is None and not unwanted:
        return None
    where = Q(instance__host=host) if host.draining_at is not None else Q(instance__in=unwanted)
    left = healing.live_on(where)
    pinned = list(
        healing.pinned_on(where).select_related("deployment__model", "deployment__team", "instance")
    )
    visible = set(team_ids_for(user, Action.VIEW))
    shown = [p for p in pinned if is_platform_staff(user) or p.deployment.team_id in visible]
    return {
        "left": left.count(),
        "moving": left.exclude(retiring_reason="").count(),
        "pinned": shown,
        "other_pinned": len(pinned) - len(shown),
        "unwanted": unwanted,
    }


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
        instances = list(host.instances.all())
        context.update(
            host=host,
            devices=host.devices.all(),
            instances=with_capacity(self.request.user, instances),
            pool=host.pool,
            drain=drain_progress(self.request.user, host),
            gateway_unreachable=host.unreachable_from_gateways(),
            can_operate=host.can_be_operated_by(self.request.user),
            is_staff=is_platform_staff(self.request.user),
            platform_url=self.request.build_absolute_uri("/").rstrip("/"),
        )
        return context

    def post(self, request, *args, **kwargs):
        """Staff: a new one-time join token for the host's agent, revoke its credential, cordon, drain,
        uncordon, or change its labels."""
        host = get_object_or_404(Host.objects.for_user(request.user), name=self.kwargs["host_name"])
        if not is_platform_staff(request.user):
            raise PermissionDenied(
                "Only platform staff may issue join tokens, revoke, cordon or drain hosts."
            )
        operation = request.POST.get("op", "")
        if operation in CORDON_OPS:
            cordoned, drain = CORDON_OPS[operation]
            pools.set_cordon(actor=request.user, host=host, cordoned=cordoned, drain=drain)
            messages.success(request, f"{host.name}: {operation} requested.")
            return redirect("host-detail", host_name=host.name)
        if operation == "join-token":
            token = services.issue_join_token(actor=request.user, host=host)
            return self.render_to_response(self.get_context_data(join_token=token))
        if operation == "labels":
            return self._set_labels(request, host)
        if operation == "revoke":
            services.revoke_host(actor=request.user, host=host)
            messages.success(request, f"{host.name} is revoked: its agent's calls are refused from now on.")
            return redirect("host-detail", host_name=host.name)
        return HttpResponseBadRequest(
            f"Unknown operation '{operation}'; use join-token, revoke, labels, cordon, drain or uncordon."
        )

    def _set_labels(self, request, host: Host):
        text = request.POST.get("labels", "")
        try:
            labels = parse_labels(text)
            host = pools.set_labels(actor=request.user, host=host, labels=labels)
        except ValidationError as exc:
            context = self.get_context_data(labels_error="; ".join(exc.messages), labels_text=text)
            return self.render_to_response(context, status=400)
        messages.success(request, f"{host.name}: labels saved; pool: {host.pool or 'none'}.")
        return redirect("host-detail", host_name=host.name)


def parse_labels(text: str) -> dict[str, str]:
    """``key=value`` lines (blank ones skipped) as the labels object the API takes; checked by the service."""
    labels: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        key, sep, value = line.strip().partition("=")
        if not sep:
            raise ValidationError({"labels": [f"'{line.strip()[:70]}' is not key=value."]})
        labels[key.strip()] = value.strip()
    return labels


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


class PoolDetailView(LoginRequiredMixin, TemplateView):
    """A pool: its hosts with their state (online, cordoned, draining) and capacity, free and used, summed
    over their instances. Pools the user's teams may use (shared and their dedicated ones); staff see all."""

    template_name = "frontend/fleet/pool_detail.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        pools_seen = Pool.objects.all()
        if not is_platform_staff(self.request.user):
            pools_seen = pools_seen.filter(
                Q(team__isnull=True) | Q(team__in=team_ids_for(self.request.user, Action.VIEW))
            )
        pool = get_object_or_404(pools_seen.select_related("team"), name=self.kwargs["pool_name"])
        hosts = list(Host.objects.filter(pool=pool).prefetch_related("instances").order_by("name"))
        usage = scheduler.instance_usage([i for h in hosts for i in h.instances.all()])
        for host in hosts:
            figures = [usage[i.pk] for i in host.instances.all()]
            host.capacity_mb = sum(f["capacity_mb"] or 0 for f in figures)
            host.used_mb = sum(f["used_mb"] for f in figures)
            host.free_mb = sum(max(0, f["free_mb"] or 0) for f in figures)
            host.largest_free_mb = max((f["free_mb"] or 0 for f in figures), default=0)
            host.schedulable = host.is_schedulable(scheduler.grace())
        context.update(
            pool=pool,
            hosts=hosts,
            free_mb=sum(h.free_mb for h in hosts if h.schedulable),
            capacity_mb=sum(h.capacity_mb for h in hosts),
            policies=PlacementPolicy.choices,
            is_staff=is_platform_staff(self.request.user),
        )
        return context

    def post(self, request, *args, **kwargs):
        """Staff: the pool's placement policy."""
        pool = get_object_or_404(Pool, name=self.kwargs["pool_name"])
        if not is_platform_staff(request.user):
            raise PermissionDenied("Only platform staff may change a pool.")
        policy = request.POST.get("placement_policy", "")
        if policy not in PlacementPolicy.values:
            return HttpResponseBadRequest(
                f"placement_policy: '{policy}' is not a policy; use {' or '.join(PlacementPolicy.values)}."
            )
        pools.update_pool(actor=request.user, pool=pool, placement_policy=policy)
        messages.success(request, f"{pool.name}: placement policy {policy}.")
        return redirect("pool-detail", pool_name=pool.name)
