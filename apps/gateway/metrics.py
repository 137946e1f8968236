"""Scrape the gateway into :class:`GatewayMetrics` rows (called by the monitoring beat cycle), and the figures
the pages and the chart API show from them.

Two sources, read in the same scrape:

* HAProxy's Prometheus exporter: per backend (``d<deployment id>``, or a pooled slot ``s<n>`` that
  ``slots.map`` gives to one) the requests forwarded to the deployment's instances, their responses by class
  and the average total time; per frontend (``inference`` and ``grpc``) the same for everything that reached
  the gateway.
* The ``gateway_counts`` stick table over the admin socket (``show table``): HAProxy 2.6 counts responses
  only by class, so the gateway counts the stages each request passed (see ``apps.gateway.haproxy``) and a
  refusal is the difference between two stages - 401, 429 and the gateway's own 404s, exactly - and the
  instances' 404s and 400s (bad requests, gRPC's NOT_FOUND and INVALID_ARGUMENT too) have counters of their own.

Client errors and server errors are kept apart: ``responses_5xx`` are server errors only (the gateway turns
Triton's request-parse failures from 500 into 400 before HAProxy counts them, ``apps.gateway.rules``);
``responses_400`` are requests the model could not take as sent (fix the request, do not retry), shown beside.

Counters restart at zero when HAProxy reloads (a new worker): a new worker pid, or a counter that went down,
starts a new baseline from zero. The very first scrape is only the baseline, unless its worker is one the
gateway command reported starting (``record_worker_started``): then it counts from zero too.
"""

from __future__ import annotations

import logging
import re
import urllib.request
from datetime import datetime

from django.conf import settings
from django.db import DatabaseError, transaction
from django.db.models import F, QuerySet, Sum
from django.db.models.functions import TruncHour
from django.utils import timezone

from apps.core.periods import HOUR, MINUTE
from apps.deployments.models import Deployment
from apps.gateway.haproxy import COUNT_STAGES, COUNTS_TABLE, AdminSocket
from apps.gateway.models import GatewayMetrics, GatewayScrapeState
from apps.gateway.rules import BATCH_STAGE
from apps.gateway.state import options

log = logging.getLogger(__name__)

_LINE = re.compile(r'^haproxy_(frontend|backend)_(\w+)\{proxy="([^"]+)"(?:,code="(\w+)")?\} ([0-9.e+-]+)$')
_FRONTENDS = ("inference", "grpc")
_DEPLOYMENT = re.compile(r"^d(\d+)c?$")  # a deployment's backend (``c``: its rollout's canary)
# or a pooled slot, owned by one in ``slots.map``, or its gRPC twin ``gs<n>`` (counted with the slot)
_BACKEND = re.compile(r"^(?:d\d+c?|g?s\d+)$")
_TABLE_ROW = re.compile(r"^0x[0-9a-f]+: key=(\S+) .*?((?: gpc\d+=\d+)+)\s*$")
GATEWAY_WIDE = "*"
STAGES = tuple(f"g{i}" for i in range(COUNT_STAGES))
# Summed over minutes into hours, and over rows for a span.
SUMMED = (
    "requests",
    "responses_2xx",
    "responses_4xx",
    "responses_5xx",
    "responses_401",
    "responses_404",
    "responses_429",
    "responses_400",
    "requests_interactive",
    "requests_batch",
    "time_ms_sum",
)


def parse_exporter(text: str) -> dict[str, dict[str, float]]:
    """``{"d12": {"requests": n, "2xx": n, "4xx": n, "5xx": n, "time_s": avg}, "*": {...}}``."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        match = _LINE.match(line)
        if match is None:
            continue
        kind, metric, proxy, code, value = match.groups()
        if kind == "frontend" and proxy in _FRONTENDS:
            key = GATEWAY_WIDE
        elif kind == "backend" and _BACKEND.match(proxy):
            key = proxy.removeprefix("g")
        else:
            continue
        entry = out.setdefault(key, {})
        if metric == "http_requests_total":
            entry["requests"] = entry.get("requests", 0) + float(value)
        elif metric == "http_responses_total" and code in ("2xx", "4xx", "5xx"):
            entry[code] = entry.get(code, 0) + float(value)
        elif metric == "total_time_average_seconds":
            # Two proxies share a key (the HTTP and gRPC frontends, a slot and its twin): the slower average.
            entry["time_s"] = max(entry.get("time_s", 0.0), float(value))
    return out


def parse_counts_table(text: str) -> dict[str, dict[str, int]]:
    """``show table gateway_counts`` -> ``{"d12": {"g0": n, ...}, "*": {...}}`` (key ``all`` is ``*``)."""
    out: dict[str, dict[str, int]] = {}
    for line in text.splitlines():
        match = _TABLE_ROW.match(line.strip())
        if match is None:
            continue
        key, counters = match.groups()
        if key == "all":
            key = GATEWAY_WIDE
        elif not _DEPLOYMENT.match(key):
            continue
        values = dict(item.split("=") for item in counters.split())
        out[key] = {name: int(values.get(name.replace("g", "gpc"), 0)) for name in STAGES}
    return out


def read_exporter(timeout: float) -> dict[str, dict[str, float]]:
    url = settings.GATEWAY_METRICS_URL + "?scope=frontend&scope=backend"
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return parse_exporter(response.read().decode("utf-8", errors="replace"))


def read_slot_owners() -> dict[str, str] | None:
    """``{"s3": "d12", "s4": "d12c"}`` from ``slots.map`` (empty when backends are named by deployment; None
    when the gateway's directory cannot be read)."""
    path = options().map_file("slots")
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {} if path.parent.is_dir() else None
    except OSError:
        return None
    pairs = (line.split() for line in text.splitlines())
    return {p[0]: p[1] for p in pairs if len(p) == 2 and _DEPLOYMENT.match(p[1])}


def _owner(key: str, slots: dict[str, str]) -> int | None | bool:
    """The deployment id a key counts for; None for gateway-wide; False for nothing (a free slot)."""
    if key == GATEWAY_WIDE:
        return None
    match = _DEPLOYMENT.match(slots.get(key, key))
    return int(match.group(1)) if match else False


def read_counts(timeout: float) -> tuple[dict[str, dict[str, int]], int | None]:
    """The stage counts per key over the admin socket, and the worker's pid (whose counters they are)."""
    admin = AdminSocket(options().admin_socket, timeout=timeout)
    answers = admin.run(["show info", f"show table {COUNTS_TABLE}"])
    pid = re.search(r"^Pid: (\d+)$", answers[0], re.M)
    return parse_counts_table("\n".join(answers[1:])), int(pid.group(1)) if pid else None


# Worker pids the gateway command started, kept for the scraper (newest last).
KEEP_STARTED_WORKERS = 20


def record_worker_started(pid: int) -> None:
    """The gateway command started (or reloaded) HAProxy and ``pid`` is the new worker: everything it counts
    is new traffic. Best effort: without the record its first scrape is only a baseline, as before."""
    try:
        with transaction.atomic():
            GatewayScrapeState.objects.get_or_create(pk=1)
            state = GatewayScrapeState.objects.select_for_update().get(pk=1)
            workers = [w for w in state.started_workers if w.get("pid") != pid]
            workers.append({"pid": pid, "at": timezone.now().isoformat()})
            state.started_workers = workers[-KEEP_STARTED_WORKERS:]
            state.save(update_fields=["started_workers"])
    except DatabaseError:
        log.warning("could not record the start of HAProxy worker %s", pid, exc_info=True)


def _started_by_gateway(pid: int | None) -> bool:
    if pid is None:
        return False
    workers = GatewayScrapeState.objects.filter(pk=1).values_list("started_workers", flat=True).first()
    return any(w.get("pid") == pid for w in workers or [])


COUNTERS = ("requests", "2xx", "4xx", "5xx", *STAGES)
# Counted from the stage counters (exact per code): the gateway's refusals, and the bad requests (400).
REFUSALS = ("responses_401", "responses_404", "responses_429", "responses_400")


def _deltas(now: dict[str, float], before: dict[str, float] | None) -> tuple[dict[str, float], bool]:
    """The counters' increase since ``before``, and whether the key restarted (then: since zero)."""
    # A counter that went down belongs to a new worker: everything of this key restarted at zero.
    restarted = before is None or any(now.get(name, 0) < before[name] for name in COUNTERS if name in before)
    before = {} if restarted else before
    return {name: max(0.0, now[name] - before.get(name, 0)) for name in COUNTERS if name in now}, restarted


def _counted_refusals(
    values: dict, before: dict | None, restarted: bool, gateway_wide: bool
) -> dict[str, int]:
    """Refusals to add now. The stage counters of one request are not incremented atomically with respect to
    a scrape on another thread (``GATEWAY_THREADS`` > 1), so a difference of two stages can be one too high
    for a moment; what was counted is kept (``counted_*``) and only the excess over it is added, so the sum
    over time stays exact. Writes the new ``counted_*`` into ``values``."""
    cumulative = _refusals(values, gateway_wide)
    counted = {} if restarted or before is None else before
    added = {name: max(0, cumulative[name] - counted.get(f"counted_{name}", 0)) for name in REFUSALS}
    for name in REFUSALS:
        values[f"counted_{name}"] = counted.get(f"counted_{name}", 0) + added[name]
    return added


def _refusals(stages: dict[str, float], gateway_wide: bool) -> dict[str, int]:
    """401, 404, 429 and 400 from the stage counts (see ``apps.gateway.rules``)."""
    g = [stages.get(name, 0) for name in STAGES]
    not_found = g[5]  # answered by an instance
    if gateway_wide:
        not_found += max(0, g[0] - g[1]) + max(0, g[3] - g[4])  # off the allow-list; unknown or other team's
    return {
        "responses_401": int(max(0, g[1] - g[2])),
        "responses_404": int(not_found),
        "responses_429": int(max(0, g[2] - g[3])),
        "responses_400": int(g[6]),  # answered by an instance (or rewritten from Triton's 500)
    }


BY_CLASS = ("requests_interactive", "requests_batch")


def _by_class(delta: dict[str, float]) -> dict[str, int]:
    """Admitted requests (stage 4: past the token, the rate and the team's own model) by priority class: batch
    ones count at stage 7 too (``apps.gateway.rules.BATCH_STAGE``), every other is interactive."""
    admitted, batch = delta.get(STAGES[4], 0), delta.get(STAGES[BATCH_STAGE], 0)
    return {"requests_interactive": int(max(0, admitted - batch)), "requests_batch": int(batch)}


def scrape_gateway(now: datetime | None = None, timeout: float | None = None) -> int:
    """One scrape; returns the rows written. A gateway that does not answer is recorded, not raised."""
    now = now or timezone.now()
    timeout = timeout or settings.METRICS_SCRAPE_TIMEOUT
    state, _ = GatewayScrapeState.objects.get_or_create(pk=1)
    # {"keys": {key: counters}, "pid": worker pid, "slots": slot owners} of the last scrape.
    baseline = state.counters.get("keys") if state.fetched_at is not None else None
    before = state.counters if baseline is not None else {}
    try:
        current = read_exporter(timeout)
    except (OSError, ValueError) as exc:
        GatewayScrapeState.objects.filter(pk=1).update(last_error=f"{type(exc).__name__}: {exc}"[:500])
        return 0
    error = ""
    try:
        counts, pid = read_counts(timeout)
    except (OSError, ValueError) as exc:
        # The exporter's figures still count; the stage counters carry over, so the refusals of this
        # interval are counted at the next scrape that reaches the socket.
        error = f"admin socket: {type(exc).__name__}: {exc}"[:500]
        pid = before.get("pid")
        carried = (*STAGES, *(f"counted_{name}" for name in REFUSALS))
        counts = {
            key: {name: values[name] for name in carried if name in values}
            for key, values in (baseline or {}).items()
        }
    for key, stages in counts.items():
        current.setdefault(key, {}).update(stages)
    if baseline is not None and before.get("pid") not in (None, pid):
        baseline = {}  # HAProxy reloaded since: every counter started again at zero
    elif baseline is None and not error and _started_by_gateway(pid):
        baseline = {}  # the first reading of a worker the gateway started: it counted from zero
    bucket = now.replace(second=0, microsecond=0)
    slots = read_slot_owners()
    if slots is None:  # out of reach with the admin socket: the last known owners
        slots = before.get("slots", {})
    # Sum the deltas of every key (frontends, backends or slots, stage counts) into its row's owner.
    totals: dict[int | None, dict[str, float]] = {}
    for key, values in current.items():
        owner = _owner(key, slots)
        before = baseline.get(key) if baseline is not None else None
        delta, restarted = _deltas(values, before)
        if STAGES[0] in values:
            if baseline is None:  # the first scrape is only the baseline: what is there counts as counted
                before, restarted = (
                    {f"counted_{n}": v for n, v in _refusals(values, owner is None).items()},
                    False,
                )
            delta.update(_counted_refusals(values, before, restarted, owner is None))
            delta.update(_by_class(delta))
        if baseline is None or owner is False:
            continue
        delta["time_ms"] = values.get("time_s", 0) * 1000 * delta.get("requests", 0)
        target = totals.setdefault(owner, {})
        for name, value in delta.items():
            target[name] = target.get(name, 0) + value
    live = set(
        Deployment.objects.filter(pk__in=[k for k in totals if k is not None]).values_list("pk", flat=True)
    )
    rows = 0
    with transaction.atomic():
        for deployment_id, delta in totals.items():
            if deployment_id is not None and deployment_id not in live:
                continue
            counts = {
                "requests": int(delta.get("requests", 0)),
                "responses_2xx": int(delta.get("2xx", 0)),
                "responses_4xx": int(delta.get("4xx", 0)),
                "responses_5xx": int(delta.get("5xx", 0)),
                **{name: int(delta.get(name, 0)) for name in (*REFUSALS, *BY_CLASS)},
            }
            if not any(counts.values()):
                continue  # e.g. only other teams' requests naming this model: not this deployment's
            row, _ = GatewayMetrics.objects.select_for_update().get_or_create(
                period_seconds=MINUTE, bucket=bucket, deployment_id=deployment_id
            )
            for name, count in counts.items():
                setattr(row, name, getattr(row, name) + count)
            row.time_ms_sum += delta.get("time_ms", 0)
            row.save()
            rows += 1
        GatewayScrapeState.objects.filter(pk=1).update(
            counters={"keys": current, "pid": pid, "slots": slots}, fetched_at=now, last_error=error
        )
    return rows


# --------------------------------------------------------------------------------------- what pages show
def deployment_summary(deployment: Deployment, since: datetime) -> dict:
    """Totals for the deployment page: requests, responses by class, refusals, average gateway time."""
    return summary(GatewayMetrics.objects.filter(deployment=deployment, bucket__gte=since))


def model_summary(model, since: datetime) -> dict:
    """The same over every deployment of a model (the model's metrics page)."""
    return summary(GatewayMetrics.objects.filter(deployment__model=model, bucket__gte=since))


def gateway_wide_summary(since: datetime) -> dict:
    """Everything that reached the gateway (the staff dashboard), refusals before any model included."""
    return summary(GatewayMetrics.objects.filter(deployment=None, bucket__gte=since))


def summary(rows: QuerySet) -> dict:
    totals = rows.aggregate(**{name: Sum(name) for name in SUMMED})
    totals = {name: totals[name] or 0 for name in SUMMED}
    requests = totals["requests"]
    return {
        **{name: int(value) for name, value in totals.items() if name != "time_ms_sum"},
        "avg_ms": totals["time_ms_sum"] / requests if requests else None,
    }


def gateway_series(rows: QuerySet, window) -> dict:
    """Chart lines over ``window`` (an ``apps.monitoring.rollups.Window``): requests/s forwarded, refusals
    (401, 404, 429), bad requests (400) and server errors (5xx) per second, the average time at the gateway
    (ms), and the totals."""
    point = TruncHour("bucket") if window.range.step == HOUR else F("bucket")
    grouped = (
        rows.filter(bucket__gte=window.start, bucket__lt=window.end)
        .annotate(point=point)
        .values("point")
        .annotate(**{name: Sum(name) for name in SUMMED})
        .order_by()
    )
    sums = {name: [0.0] * window.points for name in SUMMED}
    for item in grouped:
        i = window.index(item["point"])
        if 0 <= i < window.points:
            for name in SUMMED:
                sums[name][i] += item[name] or 0
    step = window.range.step
    per_second = {
        "requests_per_second": "requests",
        "unauthorized_per_second": "responses_401",
        "not_found_per_second": "responses_404",
        "rate_limited_per_second": "responses_429",
        "bad_requests_per_second": "responses_400",
        "server_errors_per_second": "responses_5xx",
        "interactive_per_second": "requests_interactive",
        "batch_per_second": "requests_batch",
    }
    return {
        **{key: [round(v / step, 4) for v in sums[name]] for key, name in per_second.items()},
        "avg_ms": [
            round(t / r, 3) if r else None for t, r in zip(sums["time_ms_sum"], sums["requests"], strict=True)
        ],
        "totals": {name: int(sum(sums[name])) for name in SUMMED if name != "time_ms_sum"},
    }
