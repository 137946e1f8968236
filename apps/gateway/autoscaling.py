"""What the autoscaler reads from the gateway, and the wake-ups the gateway's Lua action signals.

* ``read_load``: per deployment, the requests in flight at the gateway (HAProxy's current plus queued sessions
  of its backends: the slot, its canary slot and their gRPC twins), the cumulative request count and the
  average time of a request (HAProxy's average over each backend's last 1024, weighted by the backends'
  counts), from HAProxy's Prometheus exporter (the ``slots.map`` beside it says which slot is whose). The
  count and the average time make the decision's load an average over the evaluation interval
  (``apps.deployments.scaling_policy.window_in_flight``), not the snapshot alone.
* ``poll_wakeups``: ``wake.lua`` writes ``<d12> <epoch ms>`` into ``wakeups.map`` while it holds a request
  for a sleeping deployment (when it began holding it), and ``<d12> <ms>`` into ``coldstart.map`` once the
  request went on. The gateway command's wake thread reads both at once when the Lua action connects to its
  wake socket, and every ``GATEWAY_WAKE_POLL_MS`` in any case; it removes what it read and hands it to
  ``apps.deployments.autoscaling``, with when it put each deployment's first server in rotation (the cold
  start's breakdown, ``apps.deployments.cold_start``).
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import urllib.request
from collections.abc import Callable
from concurrent.futures import Executor, wait

from django.conf import settings
from django.db import close_old_connections

from apps.deployments import autoscaling, cold_start, scheduler
from apps.gateway.haproxy import AdminSocket, Options
from apps.gateway.metrics import read_slot_owners

log = logging.getLogger(__name__)

_METRIC = re.compile(
    r"^haproxy_backend_(current_sessions|current_queue|http_requests_total|total_time_average_seconds)"
    r'\{proxy="([^"]+)"\} ([0-9.e+-]+)$'
)
_SLOT = re.compile(r"^g?(s\d+)$")
_KEY = re.compile(r"^d(\d+)$")
_MAP_ROW = re.compile(r"^0x[0-9a-f]+ (d\d+) (\d+)$")


def parse_load(text: str, owners: dict[str, str]) -> dict[int, tuple[float, int, float | None]]:
    """Exporter text -> {deployment id: (in flight, requests, average seconds per request or None)};
    ``owners``: slot -> ``d12`` or ``d12c``."""
    out: dict[int, list[float]] = {}
    per_backend: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        match = _METRIC.match(line)
        if match is None:
            continue
        metric, proxy, value = match.groups()
        slot = _SLOT.match(proxy)
        owner = owners.get(slot.group(1)) if slot else proxy
        key = _KEY.match((owner or "").removesuffix("c"))
        if key is None:
            continue
        pk = int(key.group(1))
        entry = out.setdefault(pk, [0.0, 0.0])
        if metric == "total_time_average_seconds":
            per_backend.setdefault(proxy, {"pk": pk})["avg"] = float(value)
            continue
        if metric == "http_requests_total":
            per_backend.setdefault(proxy, {"pk": pk})["total"] = float(value)
        entry[1 if metric == "http_requests_total" else 0] += float(value)
    weighted: dict[int, list[float]] = {}
    for figures in per_backend.values():
        if "avg" in figures:
            acc = weighted.setdefault(int(figures["pk"]), [0.0, 0.0])
            count = figures.get("total", 0.0)
            acc[0] += figures["avg"] * count
            acc[1] += count
    result = {}
    for pk, (in_flight, total) in out.items():
        acc = weighted.get(pk)
        avg = (acc[0] / acc[1] if acc[1] else 0.0) if acc else None
        result[pk] = (in_flight, int(total), avg)
    return result


def read_load(timeout: float = 2.0) -> dict[int, tuple[float, int, float | None]] | None:
    """None when the gateway cannot be read (then nothing is decided)."""
    owners = read_slot_owners()
    if owners is None:
        return None
    url = settings.GATEWAY_METRICS_URL + "?scope=backend"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            text = response.read().decode("utf-8", errors="replace")
    except OSError as exc:
        log.warning("autoscaler: the gateway's exporter did not answer: %s", exc)
        return None
    return parse_load(text, owners)


def autoscale() -> dict[str, int]:
    """One evaluation of every autoscaled deployment (the beat task)."""
    load = read_load()
    if load is None:
        return {"skipped": 1}
    counts = autoscaling.evaluate(load)
    counts["evicted_ahead"] = autoscaling.keep_headroom()
    return counts


def parse_map(text: str) -> dict[str, int]:
    rows = (_MAP_ROW.match(line.strip()) for line in text.splitlines())
    return {m.group(1): int(m.group(2)) for m in rows if m}


class InFlight:
    """The wake-ups the wake thread handed to its pool and that have not finished: the map is read again
    meanwhile (the Lua action signals a held request every second), and one in flight is not handed over
    twice."""

    def __init__(self) -> None:
        self._ids: set[int] = set()
        self._lock = threading.Lock()

    def take(self, ids: dict[int, int]) -> dict[int, int]:
        with self._lock:
            fresh = {pk: value for pk, value in ids.items() if pk not in self._ids}
            self._ids |= set(fresh)
        return fresh

    def done(self, ids) -> None:
        with self._lock:
            self._ids -= set(ids)

    def __len__(self) -> int:
        with self._lock:
            return len(self._ids)


def poll_wakeups(
    admin: AdminSocket,
    o: Options,
    routed_at: dict[int, float] | None = None,
    names=("wakeups", "coldstart"),
    pool: Executor | None = None,
    held: Callable[[set[int]], None] | None = None,
    in_flight: InFlight | None = None,
) -> int:
    """Wake the deployments whose requests are held, record finished cold starts (``routed_at``: deployment
    id -> epoch ms its first server entered the rotation). Returns the wake-ups. With ``pool`` the wake-ups
    read together run side by side (each its own transaction: one waiting for a row or pool lock does not
    hold back the others); their hosts are told once for all of them. ``held`` hears which deployments have
    a request held, before they are woken.

    With ``in_flight`` too (the gateway command's wake thread), nothing is waited for: the wake-ups and
    cold starts read are handed to the pool and the call returns, so the next ones are read while these are
    placed - a wake-up read while an earlier one waited for its pool's lock waited for it too (the "signal"
    hop of a cold start under a stream, p50 0.5 s). Each batch's hosts are told once its last wake-up ended;
    a failure is logged. Returns the wake-ups handed over."""
    woken, placed = 0, []
    for name in names:
        path = o.map_file(name)
        entries = parse_map(admin.ask(f"show map {path}"))
        for key in entries:
            admin.ask(f"del map {path} {key}")
        ids = {int(key[1:]): value for key, value in entries.items()}
        if name == "wakeups" and held is not None and ids:
            held(set(ids))
        if pool is not None and in_flight is not None and name == "coldstart":
            _record_apart(ids, routed_at, pool)  # a record each, kept even for a deployment in flight
            continue
        if pool is not None and in_flight is not None:
            woken += _wake_apart_all(in_flight.take(ids), pool, in_flight)
            continue
        if name == "coldstart":
            for deployment_id, held_ms in ids.items():
                _record(deployment_id, held_ms, routed_at)
            continue
        try:
            if pool is None or len(ids) < 2:
                for deployment_id, value in ids.items():
                    woken += _wake(deployment_id, value, placed)
            else:
                futures = [pool.submit(_apart, _wake, pk, value, placed) for pk, value in ids.items()]
                wait(futures)  # all of them, before their hosts are told (a failed one raises below)
                woken += sum(future.result() for future in futures if future.exception() is None)
                failed = next((future.exception() for future in futures if future.exception()), None)
                if failed is not None:
                    raise failed
        finally:
            # Every wake-up read at once reaches each host as one change of its desired state.
            scheduler.enqueue(placed)
    return woken


def _record_apart(ids: dict[int, int], routed_at, pool: Executor) -> None:
    """Cold starts read from the map, recorded by ``pool`` without waiting (``poll_wakeups``)."""
    routed = dict(routed_at or {})  # the wake thread's copy: the sync thread changes its own
    for deployment_id, held_ms in ids.items():
        pool.submit(_apart, _record, deployment_id, held_ms, routed).add_done_callback(
            functools.partial(_log_failure, "cold start")
        )


def _wake_apart_all(ids: dict[int, int], pool: Executor, in_flight: InFlight) -> int:
    """Wake-ups read from the map, handed to ``pool`` without waiting (``poll_wakeups``); their hosts are
    told once the last of them ended."""
    if not ids:
        return 0
    placed: list = []
    left = [len(ids)]
    lock = threading.Lock()

    def one_done(future) -> None:
        _log_failure("wake-up", future)
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            # Every wake-up read at once reaches each host as one change of its desired state.
            try:
                scheduler.enqueue(placed)
            except Exception:
                log.exception("telling the hosts of %d woken replicas failed", len(placed))
            finally:
                in_flight.done(ids)
                close_old_connections()

    for pk, value in ids.items():
        pool.submit(_apart, _wake, pk, value, placed).add_done_callback(one_done)
    return len(ids)


def _log_failure(what: str, future) -> None:
    if future.exception() is not None:
        log.error("the gateway's %s failed", what, exc_info=future.exception())


def _record(deployment_id: int, held_ms: int, routed_at) -> None:
    autoscaling.record_cold_start(deployment_id, held_ms, (routed_at or {}).get(deployment_id))


def _apart(function, *args):
    """``function`` on a thread of the pool, which keeps its own database connection between calls."""
    try:
        return function(*args)
    finally:
        close_old_connections()


def _wake(deployment_id: int, value: int, placed: list) -> bool:
    return autoscaling.wake(deployment_id, held_at_ms=cold_start.held_at_ms(value), placed=placed)
