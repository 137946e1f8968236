"""The evaluator: every enabled rule against the rollups and rows, once a minute (celery beat).

Queries are grouped by rule kind, not by rule: the traffic kinds read ``ModelMetrics`` once per distinct
window, the fleet kinds read the team footprints (which instances and hosts serve which team) once, so the
cost grows with the number of kinds and windows, not rules (``benchmarks/alerts.py``: 1,000 rules).
Each check returns ``{rule_id: {subject: Finding}}``: the subjects whose condition holds now.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db.models import F, Max, Q, Sum

from apps.alerts.models import AlertKind, AlertRule
from apps.conversions.models import ConversionJob, JobState
from apps.core.periods import MINUTE
from apps.deployments.models import Deployment, DeploymentInstance, DeploymentState, PlacementState
from apps.fleet.models import (
    OFFLINE_AFTER,
    DesiredInstanceState,
    GatewayReachability,
    Host,
    InstanceState,
    TritonInstance,
)
from apps.monitoring.models import DeviceMetrics, ModelMetrics
from apps.registry.models import VersionState

# Deployments whose traffic and placements are watched (not going away, not gone).
WATCHED_STATES = (
    DeploymentState.DEPLOYING,
    DeploymentState.SERVING,
    DeploymentState.SWITCHING,
    DeploymentState.FAILED,
)
# A deployment "had traffic" if its model served something within this span (the minute rows' retention).
NO_TRAFFIC_LOOKBACK = timedelta(days=7)


@dataclass
class Finding:
    subject: str
    value: float | None
    summary: str
    labels: dict[str, str] = field(default_factory=dict)
    deployment_id: int | None = None


Findings = dict[int, dict[str, Finding]]


def _deployment_labels(deployment: Deployment) -> dict[str, str]:
    return {"deployment": str(deployment.pk), "model": deployment.model.slug}


class Context:
    """What several checks share within one evaluation, loaded once on first use."""

    def __init__(self, rules: list[AlertRule], now: datetime):
        self.now = now
        self.team_ids = sorted({rule.team_id for rule in rules})
        self._deployments: dict[int, list[Deployment]] | None = None
        self._footprint: tuple[dict, dict] | None = None
        self._traffic: dict[int, dict[int, dict]] = {}

    def deployments_by_team(self) -> dict[int, list[Deployment]]:
        if self._deployments is None:
            self._deployments = defaultdict(list)
            for deployment in Deployment.objects.filter(
                team_id__in=self.team_ids, state__in=WATCHED_STATES
            ).select_related("model"):
                self._deployments[deployment.team_id].append(deployment)
        return self._deployments

    def deployments_for(self, rule: AlertRule) -> list[Deployment]:
        deployments = self.deployments_by_team().get(rule.team_id, [])
        if rule.deployment_id is not None:
            return [d for d in deployments if d.pk == rule.deployment_id]
        return deployments

    def footprint(self) -> tuple[dict[int, set[int]], dict[int, set[int]]]:
        """(team -> instance ids, team -> host ids): what serves the team's watched deployments, and the
        hosts dedicated to the team with their instances."""
        if self._footprint is None:
            instances: dict[int, set[int]] = defaultdict(set)
            hosts: dict[int, set[int]] = defaultdict(set)
            placed = (
                DeploymentInstance.objects.filter(
                    deployment__team_id__in=self.team_ids, deployment__state__in=WATCHED_STATES
                )
                .exclude(state=PlacementState.UNLOADED)
                .values_list("deployment__team_id", "instance_id", "instance__host_id")
            )
            for team_id, instance_id, host_id in placed:
                instances[team_id].add(instance_id)
                hosts[team_id].add(host_id)
            dedicated = TritonInstance.objects.filter(host__team_id__in=self.team_ids).values_list(
                "host__team_id", "pk", "host_id"
            )
            for team_id, instance_id, host_id in dedicated:
                instances[team_id].add(instance_id)
                hosts[team_id].add(host_id)
            for host_id, team_id in Host.objects.filter(team_id__in=self.team_ids).values_list(
                "pk", "team_id"
            ):
                hosts[team_id].add(host_id)
            self._footprint = (instances, hosts)
        return self._footprint


def _by_window(rules: list[AlertRule]) -> dict[int, list[AlertRule]]:
    grouped: dict[int, list[AlertRule]] = defaultdict(list)
    for rule in rules:
        grouped[max(1, rule.window_minutes)].append(rule)
    return grouped


def _traffic(context: Context, window_minutes: int) -> dict[int, dict]:
    """Per model: sums of the minute rows of the last ``window_minutes`` (one query per window, shared by
    the error-rate and latency checks)."""
    if window_minutes in context._traffic:
        return context._traffic[window_minutes]
    since = context.now - timedelta(minutes=window_minutes)
    rows = (
        ModelMetrics.objects.filter(
            period_seconds=MINUTE, bucket__gte=since, bucket__lte=context.now, team_id__in=context.team_ids
        )
        .values("model_id")
        .annotate(
            success_sum=Sum("success"),
            failure_sum=Sum("failure"),
            client_errors_sum=Sum("client_errors"),
            request_us_sum=Sum("request_us"),
            quantile_requests_sum=Sum("quantile_requests"),
            p99_weighted=Sum(F("p99_us") * F("quantile_requests"), filter=Q(p99_us__isnull=False)),
        )
    )
    context._traffic[window_minutes] = {row["model_id"]: row for row in rows}
    return context._traffic[window_minutes]


def check_error_rate(rules: list[AlertRule], context: Context) -> Findings:
    """Server failures of the requests the model took. Bad requests (the caller's error, a 400) are named in
    the summary but never raise the rate: a client sending malformed requests is not an outage."""
    findings: Findings = defaultdict(dict)
    for window, window_rules in _by_window(rules).items():
        traffic = _traffic(context, window)
        for rule in window_rules:
            for deployment in context.deployments_for(rule):
                row = traffic.get(deployment.model_id)
                total = (row["success_sum"] + row["failure_sum"]) if row else 0
                if not total:
                    continue
                rate = 100.0 * row["failure_sum"] / total
                if rate > rule.threshold:
                    findings[rule.pk][f"deployment:{deployment.pk}"] = Finding(
                        subject=f"deployment:{deployment.pk}",
                        value=round(rate, 3),
                        summary=(
                            f"{deployment.model.name}: {rate:.1f}% of {total} requests failed (server errors) in "
                            f"the last {window} min (threshold {rule.threshold:g}%)"
                            + _client_errors_note(row)
                        ),
                        labels=_deployment_labels(deployment),
                        deployment_id=deployment.pk,
                    )
    return findings


def _client_errors_note(row: dict) -> str:
    count = row.get("client_errors_sum") or 0
    return f"; besides, {count} bad requests (400) not counted" if count else ""


def check_p99_latency(rules: list[AlertRule], context: Context) -> Findings:
    """p99 from Triton's latency summaries, weighted by their request counts. Where the instances run
    without summaries, the mean latency stands in: it is a lower bound of p99, so an alert on it is real."""
    findings: Findings = defaultdict(dict)
    for window, window_rules in _by_window(rules).items():
        traffic = _traffic(context, window)
        for rule in window_rules:
            for deployment in context.deployments_for(rule):
                row = traffic.get(deployment.model_id)
                if not row:
                    continue
                if row["quantile_requests_sum"] and row["p99_weighted"] is not None:
                    value_ms, measure = row["p99_weighted"] / row["quantile_requests_sum"] / 1000, "p99"
                else:
                    total = row["success_sum"] + row["failure_sum"]
                    if not total:
                        continue
                    value_ms, measure = row["request_us_sum"] / total / 1000, "mean (p99 at least)"
                if value_ms > rule.threshold:
                    findings[rule.pk][f"deployment:{deployment.pk}"] = Finding(
                        subject=f"deployment:{deployment.pk}",
                        value=round(value_ms, 3),
                        summary=(
                            f"{deployment.model.name}: latency {measure} {value_ms:.1f} ms over the last "
                            f"{window} min (threshold {rule.threshold:g} ms)"
                        ),
                        labels=_deployment_labels(deployment),
                        deployment_id=deployment.pk,
                    )
    return findings


def check_no_traffic(rules: list[AlertRule], context: Context) -> Findings:
    findings: Findings = defaultdict(dict)
    last_busy = dict(
        ModelMetrics.objects.filter(
            team_id__in=context.team_ids, bucket__gte=context.now - NO_TRAFFIC_LOOKBACK
        )
        .filter(Q(success__gt=0) | Q(failure__gt=0) | Q(client_errors__gt=0))
        .values("model_id")
        .annotate(last=Max("bucket"))
        .values_list("model_id", "last")
    )
    for rule in rules:
        for deployment in context.deployments_for(rule):
            if deployment.state not in (DeploymentState.SERVING, DeploymentState.SWITCHING):
                continue
            last = last_busy.get(deployment.model_id)
            # Only traffic of this deployment counts (its minute may have started just before it).
            if last is None or last < deployment.created_at - timedelta(seconds=MINUTE):
                continue
            quiet_since = last + timedelta(seconds=MINUTE)
            quiet_minutes = (context.now - quiet_since).total_seconds() / 60
            if quiet_minutes >= rule.window_minutes:
                findings[rule.pk][f"deployment:{deployment.pk}"] = Finding(
                    subject=f"deployment:{deployment.pk}",
                    value=round(quiet_minutes, 1),
                    summary=f"{deployment.model.name}: no requests for {quiet_minutes:.0f} min",
                    labels=_deployment_labels(deployment),
                    deployment_id=deployment.pk,
                )
    return findings


def check_placement_failed(rules: list[AlertRule], context: Context) -> Findings:
    by_team: dict[int, list[DeploymentInstance]] = defaultdict(list)
    for placement in DeploymentInstance.objects.filter(
        deployment__team_id__in=context.team_ids,
        deployment__state__in=WATCHED_STATES,
        state=PlacementState.FAILED,
    ).select_related("deployment__model", "instance__host"):
        by_team[placement.deployment.team_id].append(placement)
    findings: Findings = defaultdict(dict)
    for rule in rules:
        for placement in by_team.get(rule.team_id, []):
            if rule.deployment_id not in (None, placement.deployment_id):
                continue
            error = placement.last_error.splitlines()[0][:200] if placement.last_error else "no reason given"
            findings[rule.pk][f"placement:{placement.pk}"] = Finding(
                subject=f"placement:{placement.pk}",
                value=None,
                summary=f"{placement.deployment.model.name} failed on {placement.instance}: {error}",
                labels={
                    **_deployment_labels(placement.deployment),
                    "instance": str(placement.instance),
                    "host": placement.instance.host.name,
                },
                deployment_id=placement.deployment_id,
            )
    return findings


def check_instance_down(rules: list[AlertRule], context: Context) -> Findings:
    instances_by_team, _ = context.footprint()
    wanted = set().union(*instances_by_team.values()) if instances_by_team else set()
    down = {
        instance.pk: instance
        for instance in TritonInstance.objects.filter(pk__in=wanted)
        .filter(
            Q(state__in=(InstanceState.FAILED, InstanceState.QUARANTINED))
            | Q(state=InstanceState.STOPPED, desired_state=DesiredInstanceState.RUNNING)
        )
        .select_related("host")
    }
    findings: Findings = defaultdict(dict)
    for rule in rules:
        for instance_id in instances_by_team.get(rule.team_id, ()):
            instance = down.get(instance_id)
            if instance is None:
                continue
            reason = f": {instance.last_error.splitlines()[0][:200]}" if instance.last_error else ""
            findings[rule.pk][f"instance:{instance.pk}"] = Finding(
                subject=f"instance:{instance.pk}",
                value=None,
                summary=f"Instance {instance} is {instance.state}{reason}",
                labels={"instance": str(instance), "host": instance.host.name, "state": instance.state},
            )
    return findings


def check_host_offline(rules: list[AlertRule], context: Context) -> Findings:
    _, hosts_by_team = context.footprint()
    wanted = set().union(*hosts_by_team.values()) if hosts_by_team else set()
    cutoff = context.now - OFFLINE_AFTER
    offline = {
        host.pk: host
        for host in Host.objects.filter(pk__in=wanted).filter(
            Q(last_heartbeat_at__isnull=True) | Q(last_heartbeat_at__lt=cutoff)
        )
    }
    findings: Findings = defaultdict(dict)
    for rule in rules:
        for host_id in hosts_by_team.get(rule.team_id, ()):
            host = offline.get(host_id)
            if host is None:
                continue
            age = (context.now - host.last_heartbeat_at).total_seconds() if host.last_heartbeat_at else None
            seen = f"last heartbeat {age:.0f} s ago" if age is not None else "never sent a heartbeat"
            findings[rule.pk][f"host:{host.pk}"] = Finding(
                subject=f"host:{host.pk}",
                value=age,
                summary=f"Host {host.name} is offline ({seen})",
                labels={"host": host.name},
            )
    # A host the platform hears but a gateway cannot reach is offline for the clients: the same alert, with
    # its own subject (it clears when the gateway reaches the host again, whatever the heartbeat does).
    cut = (
        GatewayReachability.current()
        .filter(instance__host__in=wanted)
        .exclude(instance__host__in=list(offline))
        .select_related("instance__host")
    )
    cut_hosts: dict[int, GatewayReachability] = {}
    for row in cut:
        cut_hosts.setdefault(row.instance.host_id, row)
    for rule in rules:
        for host_id in hosts_by_team.get(rule.team_id, ()):
            row = cut_hosts.get(host_id)
            if row is None:
                continue
            host = row.instance.host
            findings[rule.pk][f"host-gateway:{host.pk}"] = Finding(
                subject=f"host-gateway:{host.pk}",
                value=(context.now - row.since).total_seconds(),
                summary=f"Host {host.name} is unreachable from gateway {row.gateway} ({row.reason})",
                labels={"host": host.name, "gateway": row.gateway},
            )
    return findings


def check_conversion_failed(rules: list[AlertRule], context: Context) -> Findings:
    longest = max(rule.window_minutes for rule in rules)
    by_team: dict[int, list[ConversionJob]] = defaultdict(list)
    for job in ConversionJob.objects.filter(
        state=JobState.FAILED,
        finished_at__gte=context.now - timedelta(minutes=longest),
        version__model__team_id__in=context.team_ids,
        version__state=VersionState.FAILED,  # a re-run that succeeded, or is running, clears it
    ).select_related("version__model"):
        by_team[job.version.model.team_id].append(job)
    findings: Findings = defaultdict(dict)
    for rule in rules:
        since = context.now - timedelta(minutes=rule.window_minutes)
        for job in by_team.get(rule.team_id, []):
            if job.finished_at < since:
                continue
            error = job.error.splitlines()[0][:200] if job.error else "no reason given"
            findings[rule.pk][f"conversion:{job.pk}"] = Finding(
                subject=f"conversion:{job.pk}",
                value=None,
                summary=f"Conversion #{job.pk} of {job.version} failed: {error}",
                labels={
                    "model": job.version.model.slug,
                    "version": str(job.version.number),
                    "conversion": str(job.pk),
                },
            )
    return findings


def check_npu_hbm(rules: list[AlertRule], context: Context) -> Findings:
    _, hosts_by_team = context.footprint()
    wanted = set().union(*hosts_by_team.values()) if hosts_by_team else set()
    findings: Findings = defaultdict(dict)
    for window, window_rules in _by_window(rules).items():
        rows = (
            DeviceMetrics.objects.filter(
                period_seconds=MINUTE,
                bucket__gte=context.now - timedelta(minutes=window),
                bucket__lte=context.now,
                device__host_id__in=wanted,
                hbm_samples__gt=0,
            )
            .values("device_id", "device__host_id", "device__host__name", "device__npu_id", "device__chip_id")
            .annotate(used=Sum("hbm_used_mb_sum"), samples=Sum("hbm_samples"), total=Max("hbm_total_mb"))
        )
        by_host: dict[int, list[dict]] = defaultdict(list)
        for row in rows:
            if row["total"]:
                row["percent"] = 100.0 * row["used"] / row["samples"] / row["total"]
                by_host[row["device__host_id"]].append(row)
        for rule in window_rules:
            for host_id in hosts_by_team.get(rule.team_id, ()):
                for row in by_host.get(host_id, []):
                    if row["percent"] <= rule.threshold:
                        continue
                    device = (
                        f"{row['device__host__name']}/npu{row['device__npu_id']}.{row['device__chip_id']}"
                    )
                    findings[rule.pk][f"device:{row['device_id']}"] = Finding(
                        subject=f"device:{row['device_id']}",
                        value=round(row["percent"], 2),
                        summary=(
                            f"NPU {device}: HBM {row['percent']:.1f}% used over the last {window} min "
                            f"(threshold {rule.threshold:g}%)"
                        ),
                        labels={"host": row["device__host__name"], "device": device},
                    )
    return findings


CHECKS: dict[str, Callable[[list[AlertRule], Context], Findings]] = {
    AlertKind.ERROR_RATE: check_error_rate,
    AlertKind.P99_LATENCY: check_p99_latency,
    AlertKind.NO_TRAFFIC: check_no_traffic,
    AlertKind.PLACEMENT_FAILED: check_placement_failed,
    AlertKind.INSTANCE_DOWN: check_instance_down,
    AlertKind.HOST_OFFLINE: check_host_offline,
    AlertKind.CONVERSION_FAILED: check_conversion_failed,
    AlertKind.NPU_HBM: check_npu_hbm,
}


def find_conditions(rules: list[AlertRule], now: datetime) -> Findings:
    """Run every kind's check once over its rules."""
    context = Context(rules, now)
    by_kind: dict[str, list[AlertRule]] = defaultdict(list)
    for rule in rules:
        by_kind[rule.kind].append(rule)
    findings: Findings = {}
    for kind, kind_rules in by_kind.items():
        findings.update(CHECKS[kind](kind_rules, context))
    return findings
