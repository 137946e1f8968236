"""Scrape HAProxy's Prometheus exporter into :class:`GatewayMetrics` rows (called by the monitoring beat cycle).

Per backend ``d<deployment id>``: requests, responses by class and the average total time; per frontend
(``inference`` and ``grpc``): the same for everything that reached the gateway, refusals included.
"""

from __future__ import annotations

import re
import urllib.request
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.deployments.models import Deployment
from apps.gateway.models import GatewayMetrics, GatewayScrapeState

_LINE = re.compile(r'^haproxy_(frontend|backend)_(\w+)\{proxy="([^"]+)"(?:,code="(\w+)")?\} ([0-9.e+-]+)$')
_FRONTENDS = ("inference", "grpc")
_BACKEND = re.compile(r"^d(\d+)$")


def parse_exporter(text: str) -> dict[str, dict[str, float]]:
    """``{"d12": {"requests": n, "2xx": n, "4xx": n, "5xx": n, "time_s": avg}, "*": {...}}``."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        match = _LINE.match(line)
        if match is None:
            continue
        kind, metric, proxy, code, value = match.groups()
        if kind == "frontend" and proxy in _FRONTENDS:
            key = "*"
        elif kind == "backend" and _BACKEND.match(proxy):
            key = proxy
        else:
            continue
        entry = out.setdefault(key, {})
        if metric == "http_requests_total":
            entry["requests"] = entry.get("requests", 0) + float(value)
        elif metric == "http_responses_total" and code in ("2xx", "4xx", "5xx"):
            entry[code] = entry.get(code, 0) + float(value)
        elif metric == "total_time_average_seconds":
            entry["time_s"] = float(value)
    return out


def _delta(now: float, before: float | None) -> float:
    # A reload starts new workers with fresh counters: a counter that went down restarted at zero.
    if before is None or now < before:
        return now
    return now - before


def scrape_gateway(now: datetime | None = None, timeout: float | None = None) -> int:
    """One scrape; returns the rows written. A gateway that does not answer is recorded, not raised."""
    now = now or timezone.now()
    state, _ = GatewayScrapeState.objects.get_or_create(pk=1)
    try:
        url = settings.GATEWAY_METRICS_URL + "?scope=frontend&scope=backend"
        with urllib.request.urlopen(url, timeout=timeout or settings.METRICS_SCRAPE_TIMEOUT) as response:
            current = parse_exporter(response.read().decode("utf-8", errors="replace"))
    except (OSError, ValueError) as exc:
        GatewayScrapeState.objects.filter(pk=1).update(last_error=f"{type(exc).__name__}: {exc}"[:500])
        return 0
    baseline = state.counters if state.fetched_at is not None else None
    bucket = now.replace(second=0, microsecond=0)
    live = set(Deployment.objects.filter(pk__in=_deployment_ids(current)).values_list("pk", flat=True))
    rows = 0
    with transaction.atomic():
        for key, values in current.items():
            if baseline is None:
                break  # the first scrape only sets the baseline
            deployment_id = None if key == "*" else int(key[1:])
            if deployment_id is not None and deployment_id not in live:
                continue
            before = baseline.get(key, {})
            delta = {
                name: _delta(values.get(name, 0), before.get(name))
                for name in ("requests", "2xx", "4xx", "5xx")
            }
            if not any(delta.values()):
                continue
            row, _ = GatewayMetrics.objects.select_for_update().get_or_create(
                bucket=bucket, deployment_id=deployment_id
            )
            row.requests += int(delta["requests"])
            row.responses_2xx += int(delta["2xx"])
            row.responses_4xx += int(delta["4xx"])
            row.responses_5xx += int(delta["5xx"])
            row.time_ms_sum += values.get("time_s", 0) * 1000 * delta["requests"]
            row.save()
            rows += 1
        GatewayScrapeState.objects.filter(pk=1).update(counters=current, fetched_at=now, last_error="")
    return rows


def _deployment_ids(current: dict) -> list[int]:
    return [int(key[1:]) for key in current if key != "*"]


def deployment_summary(deployment: Deployment, since: datetime) -> dict:
    """Totals for the deployment page: requests, responses by class, average gateway time."""
    return _summary(GatewayMetrics.objects.filter(deployment=deployment, bucket__gte=since))


def model_summary(model, since: datetime) -> dict:
    """The same over every deployment of a model (the model's metrics page)."""
    return _summary(GatewayMetrics.objects.filter(deployment__model=model, bucket__gte=since))


def _summary(rows) -> dict:
    from django.db.models import Sum

    totals = rows.aggregate(
        requests=Sum("requests"),
        ok=Sum("responses_2xx"),
        client_errors=Sum("responses_4xx"),
        server_errors=Sum("responses_5xx"),
        time_ms=Sum("time_ms_sum"),
    )
    requests = totals["requests"] or 0
    return {
        "requests": requests,
        "responses_2xx": totals["ok"] or 0,
        "responses_4xx": totals["client_errors"] or 0,
        "responses_5xx": totals["server_errors"] or 0,
        "avg_ms": (totals["time_ms"] or 0) / requests if requests else None,
    }
