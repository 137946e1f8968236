"""A version's last counters, read by the host just before it unloads the version, folded in exactly once.

Triton forgets a version's counters when it unloads it (a switch, a rollout's promote or abort, an undeploy),
so the requests it served since the last scrape would never reach the charts. The host reads them first
(``backend_ge.final_counts``) and reports them; this module adds what the scrapes have not counted yet.

What makes it exactly once, whatever the order of reports and scrapes (a report may arrive late, or twice):

- The base of the difference is the latest reading of the same version *on the same server process*: the
  scrape baseline when it still has the version, else the version's last scraped values kept in
  ``ScrapeState.retired`` when a scrape found it gone. A base higher than the final reading means a scrape
  read after it: nothing more to count (per counter, never negative).
- The folded values become the version's baseline, so a scrape that still sees the version (the unload was
  not done yet) counts only the requests after the final reading.
- ``ScrapeState.finals`` remembers each applied report (server, read time): the same report again counts
  nothing. After a restart of the server the scraper uses them as the baseline of the new process.
- Reports older than ``KEEP`` are refused: the state that tells what was counted is not kept longer.

A version loaded, unloaded, loaded again and unloaded again within one scrape interval is counted from its
first load's reading on (no undercount beyond that second load's first requests, never a double count).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime, timedelta

from django.utils.dateparse import parse_datetime

from apps.monitoring.models import ScrapeState
from backend_ge import naming, triton_metrics

KEEP = timedelta(hours=1)
MAX_METRICS_CHARS = 512 * 1024
MAX_STATISTICS = 64
VERSION = re.compile(r"^[1-9][0-9]{0,8}$")
SERVER_ID = re.compile(r"^[0-9]{1,20}$")


def check_report(report) -> tuple[str, set[str] | None, str, datetime, triton_metrics.Reading]:
    """Validate a host's report (it comes from an inference host: hostile until checked) and parse it with
    the scraper's parser. Returns ``(model, versions, server_id, read_at, reading)``; ValueError says what
    is wrong."""
    if not isinstance(report, Mapping):
        raise ValueError("the final counts must be an object")
    model = report.get("model")
    if not naming.is_triton_model_name(model):
        raise ValueError(
            f"model must be a Triton model name the platform made (<team>{naming.SEPARATOR}<model>)"
        )
    versions = report.get("versions")
    if versions is not None:
        if not isinstance(versions, list) or not all(
            isinstance(v, str) and VERSION.match(v) for v in versions
        ):
            raise ValueError("versions must be a list of version numbers as strings, or null for all")
        versions = set(versions)
    server_id = report.get("server_id")
    if not isinstance(server_id, str) or not SERVER_ID.match(server_id):
        raise ValueError("server_id must be the tritonserver's process id")
    read_at = parse_datetime(report["read_at"]) if isinstance(report.get("read_at"), str) else None
    if read_at is None or read_at.tzinfo is None:
        raise ValueError("read_at must be an ISO 8601 time with its UTC offset")
    metrics, statistics = report.get("metrics"), report.get("statistics")
    if not isinstance(metrics, str) or len(metrics) > MAX_METRICS_CHARS:
        raise ValueError(f"metrics must be Prometheus text of at most {MAX_METRICS_CHARS} characters")
    if not isinstance(statistics, list) or len(statistics) > MAX_STATISTICS:
        raise ValueError(f"statistics must be a list of at most {MAX_STATISTICS} model_stats entries")
    try:
        reading = triton_metrics.parse_statistics(
            {"model_stats": statistics}, triton_metrics.parse_metrics(metrics)
        )
    except (ValueError, TypeError, AttributeError, KeyError, IndexError) as exc:
        raise ValueError(f"the metrics or statistics do not parse: {exc}") from None
    return model, versions, server_id, read_at, reading


def _series(flat: Mapping[str, float], key: str) -> dict[str, float]:
    prefix = key + "|"
    return {name[len(prefix) :]: value for name, value in flat.items() if name.startswith(prefix)}


def fold(
    state: ScrapeState,
    series: Mapping[triton_metrics.SeriesKey, Mapping[str, float]],
    server_id: str,
    stamp: str,
    now: datetime,
) -> dict[triton_metrics.SeriesKey, dict[str, float]]:
    """Apply one report's final readings to ``state`` (the caller holds its row lock and saves it); returns
    what the scrapes have not counted yet, per version, with the backend's failures settled."""
    same_server = state.has_baseline and state.server_id == server_id
    deltas: dict[triton_metrics.SeriesKey, dict[str, float]] = {}
    for (name, version), values in series.items():
        key = f"{name}|{version}"
        previous = state.finals.get(key)
        if previous and previous.get("server") == server_id and previous.get("read_at") == stamp:
            continue  # this report was folded already
        base, where = (_series(state.counters, key), "baseline") if same_server else ({}, None)
        if not base:
            kept = state.retired.get(key)
            base, where = (
                (dict(kept["counters"]), "retired")
                if kept and kept.get("server") == server_id
                else ({}, None)
            )
        delta = {n: v - base.get(n, 0.0) for n, v in values.items() if v > base.get(n, 0.0)}
        if delta:
            deltas[(name, version)] = delta
        merged = {n: max(values.get(n, 0.0), base.get(n, 0.0)) for n in {*values, *base}}
        if where == "retired":
            state.retired[key] = {**state.retired[key], "counters": merged}
        elif same_server:
            # Also a version loaded since the last scrape: a scrape before its unload counts only the rest.
            state.counters.update({f"{key}|{n}": v for n, v in merged.items()})
        state.finals[key] = {
            "server": server_id,
            "read_at": stamp,
            "counters": dict(values),
            "at": now.isoformat(),
        }
    owed = triton_metrics.settle_backend_failures(deltas, state.owed if same_server else {})
    if same_server:
        state.owed = owed
    return deltas


def retire(state: ScrapeState, restarted: bool, new_counters: Mapping[str, float], now: datetime) -> None:
    """Before the scraper replaces the baseline: keep the last scraped values of every version the new
    reading no longer has (or all of them, when the server restarted) for a report that arrives late, and
    forget what is older than ``KEEP``."""
    if state.has_baseline:
        present = {name.rsplit("|", 1)[0] for name in new_counters}
        gone: dict[str, dict[str, float]] = {}
        for name, value in state.counters.items():
            key, _, counter = name.rpartition("|")
            if restarted or key not in present:
                gone.setdefault(key, {})[counter] = value
        for key, values in gone.items():
            state.retired[key] = {"server": state.server_id, "counters": values, "at": now.isoformat()}
    oldest = now - KEEP
    for table in (state.retired, state.finals):
        for key in [k for k, v in table.items() if (parse_datetime(v.get("at", "")) or oldest) <= oldest]:
            del table[key]


def restart_baseline(
    state: ScrapeState, server_id: str, started_at: datetime | None = None
) -> triton_metrics.Baseline | None:
    """The baseline of a server process the scraper reads for the first time: the final counts already
    folded for it (reported between its start and this scrape), so they are not counted again. Reports read
    before ``started_at`` (the host's clock, like theirs) were of an older process with the same pid."""
    folded = {
        f"{key}|{name}": value
        for key, entry in state.finals.items()
        if entry.get("server") == server_id and _read_since(entry, started_at)
        for name, value in entry.get("counters", {}).items()
    }
    return triton_metrics.Baseline(server_id, folded) if folded else None


def _read_since(entry: Mapping, started_at: datetime | None) -> bool:
    if started_at is None:
        return True
    read_at = parse_datetime(entry.get("read_at") or "")
    return read_at is None or read_at >= started_at
