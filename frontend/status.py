"""The dashboard's answer to "is everything serving?" for one team: deployments by state, firing alerts,
failed conversions and placements, hosts offline and instances down, and the last hour's traffic.

A handful of aggregate queries, each scoped through ``for_user`` like every page."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from django.db.models import Count, Q, Sum
from django.utils import timezone

from apps.alerts.models import Alert, AlertState
from apps.conversions.models import ConversionJob, JobState
from apps.core.periods import MINUTE
from apps.deployments.models import Deployment, DeploymentInstance, DeploymentState, PlacementState
from apps.fleet.models import OFFLINE_AFTER, DesiredInstanceState, Host, InstanceState, TritonInstance
from apps.monitoring.models import ModelMetrics
from apps.registry.models import VersionState

FAILED_CONVERSIONS_SINCE = timedelta(hours=24)
TRAFFIC_SPAN = timedelta(hours=1)
SHOWN = 8


@dataclass
class TeamStatus:
    deployments_by_state: list[tuple[str, str, int]] = field(default_factory=list)
    live_deployments: int = 0
    firing_alerts: list[Alert] = field(default_factory=list)
    firing_count: int = 0
    failed_conversions: list[ConversionJob] = field(default_factory=list)
    failed_placements: list[DeploymentInstance] = field(default_factory=list)
    offline_hosts: list[Host] = field(default_factory=list)
    down_instances: list[TritonInstance] = field(default_factory=list)
    requests: int = 0
    failures: int = 0
    traffic_by_model: list[dict] = field(default_factory=list)

    @property
    def error_rate(self) -> float | None:
        return 100.0 * self.failures / self.requests if self.requests else None

    @property
    def requests_per_second(self) -> float:
        return self.requests / TRAFFIC_SPAN.total_seconds()

    @property
    def all_serving(self) -> bool:
        return not (
            self.firing_count
            or self.failed_placements
            or self.offline_hosts
            or self.down_instances
            or any(state == DeploymentState.FAILED for state, _, _ in self.deployments_by_state)
        )


def team_status(user, team) -> TeamStatus:
    now = timezone.now()
    status = TeamStatus()
    deployments = Deployment.objects.for_user(user).filter(team=team)
    labels = dict(DeploymentState.choices)
    counts = dict(deployments.values_list("state").annotate(n=Count("id")).values_list("state", "n"))
    order = [s for s in DeploymentState.values if s != DeploymentState.UNDEPLOYED]
    status.deployments_by_state = [(s, labels[s], counts[s]) for s in order if counts.get(s)]
    status.live_deployments = sum(n for s, _, n in status.deployments_by_state)

    firing = Alert.objects.for_user(user).filter(team=team, state=AlertState.FIRING).select_related("rule")
    status.firing_count = firing.count()
    status.firing_alerts = list(firing.order_by("-fired_at", "-id")[:SHOWN])

    status.failed_conversions = list(
        ConversionJob.objects.for_user(user)
        .filter(
            version__model__team=team,
            state=JobState.FAILED,
            finished_at__gte=now - FAILED_CONVERSIONS_SINCE,
            version__state=VersionState.FAILED,
        )
        .select_related("version__model")[:SHOWN]
    )
    live = deployments.exclude(state__in=(DeploymentState.UNDEPLOYED, DeploymentState.UNDEPLOYING))
    status.failed_placements = list(
        DeploymentInstance.objects.filter(deployment__in=live, state=PlacementState.FAILED).select_related(
            "deployment__model", "instance__host"
        )[:SHOWN]
    )
    # The hosts this team may deploy on (shared and its own): the fleet the team depends on.
    hosts = Host.objects.for_user(user).usable_by_team(team)
    status.offline_hosts = list(
        hosts.filter(Q(last_heartbeat_at__isnull=True) | Q(last_heartbeat_at__lt=now - OFFLINE_AFTER))[:SHOWN]
    )
    status.down_instances = list(
        TritonInstance.objects.for_user(user)
        .filter(host__in=hosts)
        .filter(
            Q(state__in=(InstanceState.FAILED, InstanceState.QUARANTINED))
            | Q(state=InstanceState.STOPPED, desired_state=DesiredInstanceState.RUNNING)
        )
        .select_related("host")[:SHOWN]
    )

    rows = ModelMetrics.objects.for_user(user).filter(
        team=team, period_seconds=MINUTE, bucket__gte=now - TRAFFIC_SPAN
    )
    per_model = list(
        rows.values("model__slug", "model__name")
        .annotate(success=Sum("success"), failure=Sum("failure"))
        .order_by("model__name")
    )
    for row in per_model:
        row["requests"] = row["success"] + row["failure"]
        row["error_rate"] = 100.0 * row["failure"] / row["requests"] if row["requests"] else None
    status.traffic_by_model = sorted(per_model, key=lambda r: -r["requests"])[:SHOWN]
    status.requests = sum(r["requests"] for r in per_model)
    status.failures = sum(r["failure"] for r in per_model)
    return status
