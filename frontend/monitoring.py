"""Metrics pages: per model (team-scoped), per instance and the fleet dashboard (scoped like hosts). The
charts fetch the REST API's metrics endpoints; the pages only lay them out."""

from __future__ import annotations

from datetime import timedelta

from django.contrib.auth.mixins import LoginRequiredMixin
from django.shortcuts import get_object_or_404
from django.urls import reverse
from django.utils import timezone
from django.views.generic import TemplateView

from apps.fleet.models import TritonInstance
from apps.gateway.metrics import model_summary
from apps.monitoring import rollups, services
from apps.registry.models import RegisteredModel
from apps.teams.models import Action
from frontend.pages import TeamPageView


def _range_key(request) -> str:
    key = request.GET.get("range", "1h")
    return key if key in rollups.RANGES else "1h"


def chart_context(request) -> dict:
    """The range picker's context (the range from ``?range=``, default 1 h), for any page with charts."""
    return {"range": _range_key(request), "ranges": list(rollups.RANGES)}


def _focus_version(request) -> int | None:
    value = request.GET.get("version", "")
    return int(value) if value.isdigit() and 0 < int(value) < 2**31 else None


class RangeMixin:
    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context.update(chart_context(self.request))
        return context


class ModelMetricsView(RangeMixin, TeamPageView):
    template_name = "frontend/monitoring/model_metrics.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        model = get_object_or_404(
            RegisteredModel.objects.filter(team=self.team), slug=self.kwargs["model_slug"]
        )
        context["model"] = model
        context["api_url"] = reverse("team-model-metrics", args=[self.team.slug, model.slug])
        context["focus_version"] = _focus_version(self.request)
        context["gateway"] = model_summary(model, timezone.now() - timedelta(hours=1))
        return context


class InstanceMetricsView(RangeMixin, LoginRequiredMixin, TemplateView):
    template_name = "frontend/monitoring/instance_metrics.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        instance = get_object_or_404(
            TritonInstance.objects.for_user(self.request.user, Action.VIEW).select_related("host"),
            host__name=self.kwargs["host_name"],
            name=self.kwargs["instance_name"],
        )
        context["instance"] = instance
        context["devices"] = services.instance_devices(instance)
        context["api_url"] = reverse("instance-metrics", args=[instance.pk])
        return context


class FleetMetricsView(RangeMixin, LoginRequiredMixin, TemplateView):
    template_name = "frontend/monitoring/fleet_metrics.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context["fleet"] = services.fleet_metrics(self.request.user, _range_key(self.request))
        context["instances"] = TritonInstance.objects.for_user(self.request.user, Action.VIEW).select_related(
            "host"
        )
        context["api_url"] = reverse("fleet-metrics")
        return context
