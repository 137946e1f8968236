"""The chart payloads behind the metrics pages and their REST endpoints."""

from __future__ import annotations

from datetime import datetime

from django.db import transaction
from django.db.models import Count, Sum
from django.utils import timezone

from apps.deployments.models import (
    Deployment,
    DeploymentEvent,
    DeploymentInstance,
    PlacementState,
    ReplicaSample,
)
from apps.fleet.models import Device, InstanceState, TritonInstance, is_platform_staff
from apps.gateway.metrics import gateway_series
from apps.gateway.models import GatewayMetrics
from apps.monitoring import final_counts, rollups, scraper
from apps.monitoring.models import ModelMetrics, ScrapeState
from apps.registry.models import RegisteredModel
from apps.teams.models import Action, team_ids_for


def check_range(key: str | None) -> rollups.Range:
    """The named chart range; ValueError names the choices."""
    key = key or "1h"
    if key not in rollups.RANGES:
        raise ValueError(f"range must be one of {', '.join(rollups.RANGES)}, not {key!r}")
    return rollups.RANGES[key]


def _frame(window: rollups.Window) -> dict:
    return {
        "range": window.range.key,
        "step_seconds": window.range.step,
        "start": window.start,
        "end": window.end,
        "timestamps": window.timestamps(),
    }


def visible_rows(user):
    """Model rows a user may read: their teams' rows; platform staff see every team's."""
    rows = ModelMetrics.objects.all()
    return rows if is_platform_staff(user) else rows.filter(team_id__in=team_ids_for(user, Action.VIEW))


# Deployment events drawn as vertical lines on the model and deployment charts, with their label.
MARKER_KINDS = {
    "deploy_requested": "deploy",
    "deployed": "deployed",
    "deploy_failed": "deploy failed",
    "switch_requested": "switch",
    "switched": "switched",
    "switch_failed": "rollback",
    "undeployed": "undeployed",
}
AVERAGE_LABEL = "mean (enable latency summaries for percentiles)"


def markers(deployments, window: rollups.Window) -> list[dict]:
    """Deploys, switches and rollbacks of ``deployments`` within the window, oldest first."""
    events = (
        DeploymentEvent.objects.filter(
            deployment__in=deployments,
            kind__in=MARKER_KINDS,
            created_at__gte=window.start,
            created_at__lt=window.end,
        )
        .select_related("version")
        .order_by("created_at", "id")
    )
    return [
        {
            "time": int(event.created_at.timestamp()),
            "kind": event.kind,
            "label": MARKER_KINDS[event.kind] + (f" v{event.version.number}" if event.version else ""),
            "message": event.message,
            "deployment": event.deployment_id,
            "version": event.version.number if event.version else None,
        }
        for event in events[:200]
    ]


# The autoscaler's decisions, drawn on the replica chart of an autoscaled deployment.
SCALING_MARKER_KINDS = {
    "autoscaled": "scaled",
    "woken": "woken",
    "evicted": "evicted",
    "autoscale_capped": "capped",
    "autoscaling": "settings",
}


def scaling_markers(deployment: Deployment, window: rollups.Window) -> list[dict]:
    """The autoscaler's decisions within the window, oldest first, labelled with their replica change."""
    events = DeploymentEvent.objects.filter(
        deployment=deployment,
        kind__in=SCALING_MARKER_KINDS,
        created_at__gte=window.start,
        created_at__lt=window.end,
    ).order_by("created_at", "id")
    out = []
    for event in events[:200]:
        details = event.details if isinstance(event.details, dict) else {}
        label = SCALING_MARKER_KINDS[event.kind]
        if "to" in details:
            label = f"{details['from']}→{details['to']}" if "from" in details else f"→{details['to']}"
        out.append(
            {
                "time": int(event.created_at.timestamp()),
                "kind": event.kind,
                "label": label,
                "message": event.message,
                "deployment": deployment.pk,
                "version": None,
            }
        )
    return out


def replica_series(deployment: Deployment, window: rollups.Window) -> dict | None:
    """An autoscaled deployment's replicas over the window: per point the highest ``desired`` and ``ready``
    of its step (a burst that scaled up and back within one step still shows), from the autoscaler's samples
    (written when they change, so the value before the window is carried in); its decisions as markers.
    None for a deployment with a fixed replica count."""
    if not deployment.autoscaled():
        return None
    step = window.range.step
    samples = list(
        ReplicaSample.objects.filter(deployment=deployment, at__gte=window.start, at__lt=window.end).order_by(
            "at", "id"
        )
    )
    current = (
        ReplicaSample.objects.filter(deployment=deployment, at__lt=window.start)
        .order_by("-at", "-id")
        .first()
    )
    desired: list[int | None] = []
    ready: list[int | None] = []
    index = 0
    now = timezone.now().timestamp()
    for stamp in window.timestamps():
        if stamp > now:
            desired.append(None)
            ready.append(None)
            continue
        peak = [current.desired, current.ready] if current is not None else None
        while index < len(samples) and samples[index].at.timestamp() < stamp + step:
            current = samples[index]
            index += 1
            peak = (
                [max(peak[0], current.desired), max(peak[1], current.ready)]
                if peak
                else [
                    current.desired,
                    current.ready,
                ]
            )
        desired.append(peak[0] if peak else None)
        ready.append(peak[1] if peak else None)
    placements = deployment.placements.filter(retiring_reason="", state=PlacementState.READY)
    return {
        "desired": desired,
        "ready": ready,
        "desired_now": deployment.replicas,
        "ready_now": placements.count(),
        "min_replicas": deployment.min_replicas,
        "max_replicas": deployment.max_replicas,
        "markers": scaling_markers(deployment, window),
    }


def model_metrics(
    model: RegisteredModel,
    range_key: str | None = None,
    now: datetime | None = None,
    version: int | None = None,
    deployment: Deployment | None = None,
) -> dict:
    """One line per version: requests/s, error rate, latency (quantiles where the instances report them,
    else the average), queue and compute time, average batch size; the deploy/switch markers.

    ``version`` keeps one version's line; ``deployment`` (of this model) keeps the traffic of its instances
    and its own events.
    """
    window = rollups.Window.ending(check_range(range_key), now)
    rows = ModelMetrics.objects.filter(model=model)
    if version is not None:
        rows = rows.filter(version__number=version)
    if deployment is not None:
        rows = rows.filter(instance__in=deployment.instances.all())
    series = rollups.traffic_series(rows, window, "version__number")
    versions = [{"version": number, **lines} for number, lines in series.items()]
    has_quantiles = any(v is not None for line in versions for v in line["p99_ms"])
    for line in versions:
        line["latency"] = "quantiles" if any(v is not None for v in line["p99_ms"]) else "average"
    totals = {"requests": 0, "success": 0, "failure": 0, "client_errors": 0}
    for line in versions:
        for key in totals:
            totals[key] += line["totals"][key]
    return {
        "team": model.team.slug,
        "model": model.slug,
        "triton_name": model.triton_model_name(),
        **_frame(window),
        "latency": "quantiles" if has_quantiles else "average",
        "latency_label": "p50 / p95 / p99" if has_quantiles else AVERAGE_LABEL,
        "focus_version": version,
        "deployment": deployment.pk if deployment is not None else None,
        "versions": versions,
        "markers": markers([deployment] if deployment is not None else model.deployments.all(), window),
        # An autoscaled deployment's replicas (desired, ready) with the autoscaler's decisions.
        "replicas": replica_series(deployment, window) if deployment is not None else None,
        "totals": {**totals, "error_rate": rollups.ratio(totals["failure"], totals["requests"])},
        "failure_reasons": rollups.failure_reasons(rows, window),
        # The same span at the gateway: forwarded requests, refusals naming this model, 5xx, gateway time.
        "gateway": gateway_series(
            GatewayMetrics.objects.filter(deployment=deployment)
            if deployment is not None
            else GatewayMetrics.objects.filter(deployment__model=model),
            window,
        ),
    }


def instance_devices(instance: TritonInstance) -> list[Device]:
    """The NPUs an instance uses: its ``device_ids`` on its host (all of the host's for an instance without)."""
    devices = Device.objects.filter(host_id=instance.host_id)
    if instance.device_ids:
        devices = devices.filter(logical_id__in=instance.device_ids)
    return list(devices)


def instance_metrics(instance: TritonInstance, user, range_key: str | None = None, now=None) -> dict:
    window = rollups.Window.ending(check_range(range_key), now)
    traffic = rollups.traffic_series(visible_rows(user).filter(instance=instance), window, None).get("all")
    devices = instance_devices(instance)
    device_lines = rollups.device_series([d.pk for d in devices], window)
    return {
        "host": instance.host.name,
        "instance": instance.name,
        "state": instance.state,
        "latency_summaries": instance.latency_summaries,
        **_frame(window),
        "requests_per_second": traffic["requests_per_second"] if traffic else [0.0] * window.points,
        "error_rate": traffic["error_rate"] if traffic else [None] * window.points,
        **rollups.instance_series(instance.pk, window),
        "devices": [
            {
                "id": d.pk,
                "name": str(d),
                "hbm_total_mb": device_lines.get(d.pk, {}).get("hbm_total_mb"),
                "aicore_percent": device_lines.get(d.pk, {}).get("aicore_percent", [None] * window.points),
                "hbm_used_mb": device_lines.get(d.pk, {}).get("hbm_used_mb", [None] * window.points),
            }
            for d in devices
        ],
    }


def fleet_metrics(user, range_key: str | None = None, now=None, busiest: int = 10) -> dict:
    """Totals over the instances a user can see, and the busiest of the models they may read."""
    window = rollups.Window.ending(check_range(range_key), now)
    instances = TritonInstance.objects.for_user(user, Action.VIEW)
    rows = visible_rows(user).filter(instance__in=instances)
    traffic = rollups.traffic_series(rows, window, None).get("all")
    in_window = rows.filter(bucket__gte=window.start, bucket__lt=window.end)
    top = (
        in_window.values("model_id", "model__slug", "team__slug")
        .annotate(requests=Sum("success") + Sum("failure"), failures=Sum("failure"))
        .order_by("-requests", "model__slug")[:busiest]
    )
    states = dict(instances.values_list("state").annotate(n=Count("pk")).order_by())
    totals = in_window.aggregate(
        success=Sum("success"), failure=Sum("failure"), client_errors=Sum("client_errors")
    )
    requests = (totals["success"] or 0) + (totals["failure"] or 0)
    return {
        **_frame(window),
        "requests_per_second": traffic["requests_per_second"] if traffic else [0.0] * window.points,
        "error_rate": traffic["error_rate"] if traffic else [None] * window.points,
        "totals": {
            "requests": requests,
            "failure": totals["failure"] or 0,
            "client_errors": totals["client_errors"] or 0,
            "error_rate": rollups.ratio(totals["failure"] or 0, requests),
            "instances": sum(states.values()),
            "instances_ready": states.get(InstanceState.READY, 0),
            "hosts": instances.values("host_id").distinct().count(),
        },
        "instances_by_state": {state: states.get(state, 0) for state in InstanceState.values},
        # Everything that reached the gateway is every team's traffic: platform staff only.
        "gateway": gateway_series(GatewayMetrics.objects.filter(deployment=None), window)
        if is_platform_staff(user)
        else None,
        "busiest_models": [
            {
                "team": item["team__slug"],
                "model": item["model__slug"],
                "requests": item["requests"] or 0,
                "requests_per_second": round((item["requests"] or 0) / window.range.seconds, 4),
                "error_rate": rollups.ratio(item["failures"] or 0, item["requests"] or 0),
            }
            for item in top
        ],
    }


def record_final_counts(instance_id: int, report, now: datetime | None = None) -> int:
    """Fold a host's report of a version's last counters, read just before it unloaded the version, into the
    minute rows of its instance exactly once (``apps.monitoring.final_counts``); returns the rows written.

    ValueError says what is wrong with the report (the agent API answers it as a 400)."""
    now = now or timezone.now()
    model, versions, server_id, read_at, reading = final_counts.check_report(report)
    if read_at < now - final_counts.KEEP:
        raise ValueError(f"final counts read at {read_at.isoformat()} are too old (kept {final_counts.KEEP})")
    instance = TritonInstance.objects.filter(pk=instance_id).first()
    if instance is None:
        raise ValueError(f"no instance {instance_id}")
    names = scraper.ModelNames.load(model)
    series = {
        key: values
        for key, values in reading.counters.items()
        if key[0] == model and (versions is None or key[1] in versions) and names.resolve(*key)
    }
    if not series:
        return 0
    model_id = names.resolve(*next(iter(series)))[1]
    if not DeploymentInstance.objects.filter(instance=instance, deployment__model_id=model_id).exists():
        raise ValueError(f"model {model} is not placed on instance {instance_id}")
    ScrapeState.objects.get_or_create(instance=instance)
    with transaction.atomic():
        state = ScrapeState.objects.select_for_update().get(instance=instance)
        deltas = final_counts.fold(state, series, server_id, read_at.isoformat(), now)
        rows = scraper.write_model_rows(instance, scraper.minute_of(now), deltas, reading.quantiles, names)
        state.save(update_fields=["counters", "retired", "finals", "owed"])
    return rows
