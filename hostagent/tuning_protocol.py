"""The agent API's messages about tuning jobs (``apps.deployments.tuning_jobs`` on the platform,
``hostagent.tuning_runner`` on the host), checked the way ``hostagent.protocol`` checks the others.

platform -> agent: the desired state's ``tunings`` (optional; a platform before tuning sends none), one entry
per running job on this host: ``{"id", "instance", "version", "objective": {"p99_ms", "rate_rps"}, "budget_s",
"max_candidates", "max_instances", "gears", "cancel"}``; its version is in the desired state's ``versions``.

agent -> platform: ``POST tunings/<id>/report`` ``{"event", "points", "log", "error", "stopped", "wall_s"}``
-> ``{"accepted", "cancel"}``. ``points`` are ``backend_ge.tuning.Point.as_dict()`` plus ``at_s`` (seconds
since the job started on the host); the platform reads the recommendation from them itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from backend_ge.tuning import Objective, Point, TuningError
from hostagent.protocol import (
    MAX_ERROR,
    MAX_TEXT,
    ProtocolError,
    _bool,
    _int,
    _keys,
    _member,
    _object,
    is_number,
    text,
)

MAX_BUDGET_S = 3600
MAX_POINTS_PER_REPORT = 200
MAX_GEARS = 100


class TuningEvent(StrEnum):
    STARTED = "started"  # the scratch replica's files are in place; measuring begins
    POINTS = "points"  # measured points (and log lines) since the last report
    FINISHED = "finished"  # the search ended: done, budget, candidates or cancelled (``stopped``)
    FAILED = "failed"  # it could not run (a load failed, the server died): ``error`` says why


class TuningStop(StrEnum):
    DONE = "done"
    BUDGET = "budget"
    CANDIDATES = "candidates"
    CANCELLED = "cancelled"


TUNING_FIELDS = {
    "id": int,
    "instance": int,
    "version": int,
    "objective": dict,
    "budget_s": int,
    "max_candidates": int,
    "max_instances": int,
    "gears": list,
    "cancel": bool,
}
REPORT_FIELDS = frozenset({"event", "points", "log", "error", "stopped", "wall_s"})


def check_objective(raw, name: str = "objective") -> Objective:
    raw = _object(raw, name)
    if set(raw) - {"p99_ms", "rate_rps"}:
        raise ProtocolError(f"'{name}' may hold only 'p99_ms' and 'rate_rps'.")
    try:
        return Objective(p99_ms=raw.get("p99_ms"), rate_rps=raw.get("rate_rps"))
    except TuningError as exc:
        raise ProtocolError(f"'{name}.{exc.field}' {exc.message}.") from None


def check_tuning_entry(entry, name: str = "tuning") -> dict:
    entry = _keys(entry, TUNING_FIELDS, name)
    check_objective(entry["objective"], f"{name}.objective")
    _int(entry["id"], f"{name}.id", 1)
    _int(entry["budget_s"], f"{name}.budget_s", 1, MAX_BUDGET_S)
    _int(entry["max_candidates"], f"{name}.max_candidates", 1, 100)
    _int(entry["max_instances"], f"{name}.max_instances", 1, 64)
    if len(entry["gears"]) > MAX_GEARS:
        raise ProtocolError(f"'{name}.gears' holds more than {MAX_GEARS} batch sizes.")
    for index, gear in enumerate(entry["gears"]):
        _int(gear, f"{name}.gears[{index}]", 1, 4096)
    return entry


def check_tunings(state: dict) -> list[dict]:
    """A desired state's tuning jobs (none when the platform sends none), each one's version present."""
    raw = state.get("tunings", [])
    if not isinstance(raw, list):
        raise ProtocolError("the desired state's 'tunings' must be a list.")
    for index, entry in enumerate(raw):
        check_tuning_entry(entry, f"tunings[{index}]")
        if str(entry["version"]) not in state.get("versions", {}):
            raise ProtocolError(
                f"'tunings[{index}].version' names version {entry['version']}, not in 'versions'."
            )
    return raw


@dataclass(frozen=True)
class TuningReport:
    event: TuningEvent
    points: list[dict] = field(default_factory=list)  # each Point.as_dict() + "at_s", checked
    log: str = ""
    error: str = ""
    stopped: TuningStop | None = None
    wall_s: float | None = None


def check_point(raw, name: str) -> dict:
    """A measured point: the figures ``Point.from_dict`` checks, and ``at_s`` (when it was measured)."""
    raw = _object(raw, name)
    try:
        Point.from_dict({k: v for k, v in raw.items() if k != "at_s"})
    except TuningError as exc:
        raise ProtocolError(f"'{name}.{exc.field}' {exc.message}.") from None
    at = raw.get("at_s")
    if not (is_number(at) and 0 <= at <= 10 * MAX_BUDGET_S):
        raise ProtocolError(f"'{name}.at_s' must be the seconds since the job started.")
    return raw


def check_tuning_report(body) -> TuningReport:
    body = _object(body, "body")
    unknown = sorted(set(body) - REPORT_FIELDS)
    if unknown:
        raise ProtocolError(f"unknown field(s) {', '.join(map(repr, unknown))} in a tuning report.")
    event = _member(body.get("event"), TuningEvent, "event")
    points = body.get("points", [])
    if not isinstance(points, list) or len(points) > MAX_POINTS_PER_REPORT:
        raise ProtocolError(f"'points' must be a list of at most {MAX_POINTS_PER_REPORT} points.")
    stopped = body.get("stopped")
    if event == TuningEvent.FINISHED and stopped is None:
        raise ProtocolError("'stopped' is required for a 'finished' report.")
    wall = body.get("wall_s")
    if wall is not None and not (is_number(wall) and 0 <= wall <= 10 * MAX_BUDGET_S):
        raise ProtocolError("'wall_s' must be the search's seconds.")
    return TuningReport(
        event=event,
        points=[check_point(p, f"points[{i}]") for i, p in enumerate(points)],
        log=text(body.get("log"), "log", MAX_TEXT),
        error=text(body.get("error"), "error", MAX_ERROR, keep_head=True),
        stopped=None if stopped is None else _member(stopped, TuningStop, "stopped"),
        wall_s=wall,
    )


def check_tuning_answer(raw) -> tuple[bool, bool]:
    """The platform's answer to a tuning report: (accepted, cancel)."""
    raw = _object(raw, "answer")
    return _bool(raw.get("accepted"), "accepted"), _bool(raw.get("cancel", False), "cancel")
