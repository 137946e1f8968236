"""The agent API's wire protocol (``/agent/v1/``): every message, state and result name, one validator each.

Both sides use this module: the host agent (``hostagent.client``) checks what it receives and what it is about to
send, the platform (``apps.fleet.agent_api``, ``apps.deployments.agent_api``) checks what an agent sends. A
message that does not fit is refused with ``ProtocolError`` naming the field and what it must be - a 400 on the
platform, a logged refusal on the agent - never a half-applied report.

Messages, agent -> platform:
- ``POST join`` ``{"join_token"}`` -> ``{"host", "address", "credential"}``
- ``POST heartbeat`` ``{"facts", "npu", "instances": [{"id", "log_tail"}], "ports": {"first", "last"}}`` -> ``{"host", "address", "generation"}``
- ``POST instances/<id>/state`` ``{"state", "pid", "started_at", "restarts", "crash_times", "last_error", "log_tail"}``
  (any subset; ``started_at``: when this agent started the server ``pid``, so the platform counts everything
  that process counted - it had no traffic before)
- ``POST placements/<id>/report`` ``{"generation", "result", ...}`` -> ``{"accepted", "placement"}``
- ``POST instances/<id>/final-counts`` (``apps.monitoring.final_counts`` checks its rows)

platform -> agent: ``GET desired-state`` -> ``{"host", "generation", "instances", "placements", "versions"}``.

Every request carries ``X-Agent-Protocol: <AGENT_PROTOCOL_VERSION>`` (``check_agent_protocol``): the platform
serves agents that speak ``MIN_AGENT_PROTOCOL_VERSION`` to ``AGENT_PROTOCOL_VERSION`` and refuses the others
with a 426 naming both sides' versions. Raise ``AGENT_PROTOCOL_VERSION`` with every change an agent of the
previous version would misread, keeping ``MIN_AGENT_PROTOCOL_VERSION`` at that previous version so agents keep
working while the platform is upgraded first; raise the minimum only in a later release that says so.

No Django here: the agent runs without it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from backend_ge import naming, npu_smi
from backend_ge.served_config import MAX_ENSEMBLE_STEPS

API_PREFIX = "/agent/v1"

# Every number an agent sends fits the column it goes to (PostgreSQL's integer) and is a real number: a value
# out of range is the agent's 400, never the database's error.
MAX_INT = 2**31 - 1
MAX_FLOAT = 1e9
MAX_TEXT = 20_000  # a log tail of 30 lines, with room to spare
MAX_ERROR = 4000
MAX_CRASH_TIMES = 100
MAX_INSTANCES = 256
MAX_CHIPS = 64


class ProtocolError(ValueError):
    """A message does not fit the protocol; the text says which field and what it must be."""


# -- the protocol's version ----------------------------------------------------------------------------------
# The version this code speaks, and the oldest agent the platform built from it still serves. Agents released
# before the header send none: they count as version 0, which this platform does not serve (their desired
# state and reports predate fields it relies on, and an answer they misread is worse than a clear refusal).
AGENT_PROTOCOL_VERSION = 1
MIN_AGENT_PROTOCOL_VERSION = 1
AGENT_PROTOCOL_HEADER = "X-Agent-Protocol"
AGENT_PROTOCOL_WSGI_KEY = "HTTP_X_AGENT_PROTOCOL"
_PROTOCOL_DIGITS = re.compile(r"[0-9]{1,4}")  # not \d: that also matches other scripts' digits


def agent_protocol_headers() -> dict[str, str]:
    """The header the agent sends on every request."""
    return {AGENT_PROTOCOL_HEADER: str(AGENT_PROTOCOL_VERSION)}


def accepted_agent_protocols() -> str:
    return f"{MIN_AGENT_PROTOCOL_VERSION}-{AGENT_PROTOCOL_VERSION}"


class AgentProtocolRefused(ProtocolError):
    """An agent speaks a protocol version the platform does not serve (``spoken``: 0 for no header)."""

    def __init__(self, spoken: int) -> None:
        self.spoken = spoken
        action = (
            "upgrade the platform first, then the agents"
            if spoken > AGENT_PROTOCOL_VERSION
            else "upgrade the host agent"
        )
        said = (
            f"agent protocol {spoken}" if spoken else f"agent protocol 0 (no {AGENT_PROTOCOL_HEADER} header)"
        )
        super().__init__(
            f"this agent speaks {said}; the platform speaks {AGENT_PROTOCOL_VERSION} "
            f"(accepts {accepted_agent_protocols()}): {action}"
        )


def parse_agent_protocol(raw: str | None) -> int:
    """The version an ``X-Agent-Protocol`` header names (none: 0). Anything but 1-4 ASCII digits is refused."""
    if raw is None:
        return 0
    if not isinstance(raw, str) or not _PROTOCOL_DIGITS.fullmatch(raw):
        raise ProtocolError(
            f"'{AGENT_PROTOCOL_HEADER}' must be the agent's protocol version, a whole number of at most 4 "
            f"digits; the platform speaks {AGENT_PROTOCOL_VERSION} (accepts {accepted_agent_protocols()})."
        )
    return int(raw)


def check_agent_protocol(raw: str | None) -> int:
    """The agent's protocol version from its header, if the platform serves it; else ``ProtocolError`` (a
    malformed header) or ``AgentProtocolRefused`` (a version out of range, naming both)."""
    spoken = parse_agent_protocol(raw)
    if not serves_agent_protocol(spoken):
        raise AgentProtocolRefused(spoken)
    return spoken


def serves_agent_protocol(spoken: int) -> bool:
    return MIN_AGENT_PROTOCOL_VERSION <= spoken <= AGENT_PROTOCOL_VERSION


class InstanceState(StrEnum):
    """What an instance's tritonserver is doing, as its agent reports it."""

    STOPPED = "STOPPED"
    STARTING = "STARTING"
    READY = "READY"
    FAILED = "FAILED"
    QUARANTINED = "QUARANTINED"


class DesiredInstanceState(StrEnum):
    """Whether the platform wants an instance's server running."""

    RUNNING = "RUNNING"
    STOPPED = "STOPPED"


class InstanceCommand(StrEnum):
    """A one-off command to an instance, numbered by ``command_seq`` (acted on once)."""

    NONE = ""
    START = "start"
    STOP = "stop"
    RESTART = "restart"


class PlacementState(StrEnum):
    """A placement (one deployment on one instance) as the platform records it."""

    PENDING = "PENDING"
    LOADING = "LOADING"
    READY = "READY"
    FAILED = "FAILED"
    UNLOADED = "UNLOADED"


class PlacementResult(StrEnum):
    """What an agent reports it did with a placement's decision."""

    STARTED = "started"
    WAITING = "waiting"
    LOADED = "loaded"
    FAILED = "failed"
    UNLOADED = "unloaded"
    LOST = "lost"
    CANARY_LOADED = "canary_loaded"
    CANARY_FAILED = "canary_failed"


class LoadedKind(StrEnum):
    """Which event a ``loaded`` report becomes (none: the placement was already serving it)."""

    SERVING = "serving"
    RELOADED = "reloaded"
    CANARY_UNLOADED = "canary_unloaded"


def _choices(kind: type[StrEnum]) -> str:
    return ", ".join(sorted(member.value for member in kind if member.value))


# -- small checks ------------------------------------------------------------------------------------------
def is_int(value, low: int = 0, high: int = MAX_INT) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def is_number(value) -> bool:
    """A float column's value: an int or a finite float within +-MAX_FLOAT."""
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and -MAX_FLOAT <= value <= MAX_FLOAT
    )


def text(value, name: str, limit: int = MAX_TEXT, *, keep_head: bool = False) -> str:
    """A string field (null reads as empty); longer than ``limit``, its tail is kept (a log's last lines) or,
    with ``keep_head``, its head (a message's first words)."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ProtocolError(f"'{name}' must be a string.")
    return value[:limit] if keep_head else value[-limit:]


def _object(value, name: str) -> dict:
    if not isinstance(value, dict):
        raise ProtocolError(f"'{name}' must be an object.")
    return value


def _int(value, name: str, low: int = 0, high: int = MAX_INT) -> int:
    if not is_int(value, low, high):
        raise ProtocolError(f"'{name}' must be an integer from {low} to {high}.")
    return value


def _optional_int(value, name: str, low: int = 0) -> int | None:
    return None if value is None else _int(value, name, low)


def _bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError(f"'{name}' must be true or false.")
    return value


def _member(value, kind: type[StrEnum], name: str) -> StrEnum:
    try:
        return kind(value)
    except (ValueError, TypeError):
        raise ProtocolError(f"'{name}' must be one of {_choices(kind)}.") from None


# -- agent -> platform -------------------------------------------------------------------------------------
FACT_FIELDS = {"cpus": int, "memory_mb": int, "platform": str, "python": str, "agent_version": str}


def check_facts(raw) -> dict:
    if raw is None:
        return {}
    raw = _object(raw, "facts")
    facts = {}
    for key, kind in FACT_FIELDS.items():
        value = raw.get(key)
        if value is None:
            continue
        facts[key] = _int(value, f"facts.{key}") if kind is int else text(value, f"facts.{key}", 200)
    return facts


CHIP_FIELDS = {
    "npu_id": int,
    "chip_id": int,
    "device_id": (int, type(None)),
    "name": str,
    "health": str,
    "power_w": (int, float, type(None)),
    "temperature_c": (int, float, type(None)),
    "hugepages_used": int,
    "hugepages_total": int,
    "bus_id": str,
    "aicore_percent": (int, float, type(None)),
    "memory_used_mb": int,
    "memory_total_mb": int,
    "hbm_used_mb": (int, type(None)),
    "hbm_total_mb": (int, type(None)),
}
CHIP_FLOATS = {"power_w", "temperature_c", "aicore_percent"}  # float columns; the other numbers are integers


def check_inventory(raw) -> npu_smi.NpuInventory | None:
    """The agent's ``npu-smi info`` as parsed on the host (``null`` on hosts without npu-smi)."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("chips", []), list):
        raise ProtocolError("'npu' must be null or an object with 'driver_version' and a list 'chips'.")
    chips = []
    for index, chip in enumerate(raw.get("chips", [])[:MAX_CHIPS]):
        if not isinstance(chip, dict):
            raise ProtocolError(f"'npu.chips[{index}]' must be an object.")
        values = {}
        for key, kind in CHIP_FIELDS.items():
            value = chip.get(key, 0 if kind is int else "" if kind is str else None)
            if isinstance(value, bool) or not isinstance(value, kind):
                raise ProtocolError(f"'npu.chips[{index}].{key}' has the wrong type.")
            if key in CHIP_FLOATS:
                if value is not None and not is_number(value):
                    raise ProtocolError(
                        f"'npu.chips[{index}].{key}' must be a number within +-{MAX_FLOAT:g}."
                    )
            elif isinstance(value, int) and not is_int(value):
                raise ProtocolError(f"'npu.chips[{index}].{key}' must be an integer from 0 to {MAX_INT}.")
            values[key] = value[:50] if isinstance(value, str) else value
        chips.append(npu_smi.NpuChip(**values))
    return npu_smi.NpuInventory(
        npu_smi_version=text(raw.get("npu_smi_version"), "npu.npu_smi_version", 50),
        driver_version=text(raw.get("driver_version"), "npu.driver_version", 50),
        chips=chips,
    )


def check_log_tails(raw) -> dict[int, str]:
    """Instance id -> its last log lines."""
    if raw is None:
        return {}
    if not isinstance(raw, list):
        raise ProtocolError("'instances' must be a list of {id, log_tail}.")
    tails = {}
    for entry in raw[:MAX_INSTANCES]:
        if not isinstance(entry, dict) or not is_int(entry.get("id"), 1):
            raise ProtocolError("'instances' must be a list of {id, log_tail}.")
        tails[entry["id"]] = text(entry.get("log_tail"), "log_tail")
    return tails


# Three ports per instance (HTTP, gRPC, metrics); a range is at most this many ports.
MAX_PORT_RANGE = 3 * MAX_INSTANCES


def check_port_range(raw) -> tuple[int, int] | None:
    """The ports the agent owns for the instances the platform makes from its inventory (``null``: none)."""
    if raw is None:
        return None
    raw = _object(raw, "ports")
    first, last = (
        _int(raw.get("first"), "ports.first", 1, 65535),
        _int(raw.get("last"), "ports.last", 1, 65535),
    )
    if not first <= last < first + MAX_PORT_RANGE:
        raise ProtocolError(f"'ports' must be a range first..last of at most {MAX_PORT_RANGE} ports.")
    return first, last


@dataclass(frozen=True)
class Heartbeat:
    facts: dict
    npu: npu_smi.NpuInventory | None
    log_tails: dict[int, str]
    ports: tuple[int, int] | None = None


def check_heartbeat(body) -> Heartbeat:
    body = _object(body, "body")
    return Heartbeat(
        facts=check_facts(body.get("facts")),
        npu=check_inventory(body.get("npu")),
        log_tails=check_log_tails(body.get("instances")),
        ports=check_port_range(body.get("ports")),
    )


INSTANCE_REPORT_FIELDS = ("state", "pid", "started_at", "restarts", "crash_times", "last_error", "log_tail")


def check_instance_report(body) -> dict:
    """An instance state report: any subset of ``INSTANCE_REPORT_FIELDS``, each checked; others refused."""
    body = _object(body, "body")
    unknown = sorted(set(body) - set(INSTANCE_REPORT_FIELDS))
    if unknown:
        raise ProtocolError(
            f"unknown field(s) {', '.join(map(repr, unknown))}; an instance report has "
            f"{', '.join(INSTANCE_REPORT_FIELDS)}."
        )
    fields: dict = {}
    if "state" in body:
        fields["state"] = _member(body["state"], InstanceState, "state").value
    if "pid" in body:
        if body["pid"] is not None and not is_int(body["pid"], 1):
            raise ProtocolError(f"'pid' must be an integer from 1 to {MAX_INT}, or null.")
        fields["pid"] = body["pid"]
    if "started_at" in body:
        fields["started_at"] = _started_at(body["started_at"])
    if "restarts" in body:
        fields["restarts"] = _int(body["restarts"], "restarts")
    if "crash_times" in body:
        times = body["crash_times"]
        if not isinstance(times, list) or len(times) > MAX_CRASH_TIMES:
            raise ProtocolError(f"'crash_times' must be a list of at most {MAX_CRASH_TIMES} ISO timestamps.")
        for value in times:
            try:
                datetime.fromisoformat(value)
            except (TypeError, ValueError):
                raise ProtocolError("'crash_times' must be a list of ISO timestamps.") from None
        fields["crash_times"] = list(times)
    if "last_error" in body:
        fields["last_error"] = text(body["last_error"], "last_error", MAX_ERROR)
    if "log_tail" in body:
        fields["log_tail"] = text(body["log_tail"], "log_tail")
    return fields


def _started_at(value) -> str | None:
    """When the agent started the reported server: an ISO 8601 time with its UTC offset, or null."""
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value) if isinstance(value, str) and len(value) <= 40 else None
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None:
        raise ProtocolError("'started_at' must be an ISO 8601 time with its UTC offset, or null.")
    return value


@dataclass(frozen=True)
class PlacementReport:
    """What an agent did with one placement's decision of ``generation``. Version fields are version ids."""

    generation: int
    result: PlacementResult
    version: int | None = None
    canary: int | None = None
    still_serving: int | None = None
    message: str = ""
    error: str = ""
    kind: LoadedKind | None = LoadedKind.SERVING
    reloading: bool = False
    # With a first ``loaded``: the memory the version took when it loaded (CPU: the stub's PSS plus
    # Triton's growth; NPU: HBM used after minus before), for the scheduler's capacity accounting.
    footprint_mb: int | None = None
    # With a ``loaded`` that loaded the version: where the agent's time went (``LOAD_TIMINGS``, ms), so the
    # platform can break a cold start down hop by hop. Optional: an agent that sends none is still understood.
    timings: dict[str, int] | None = None

    def body(self) -> dict:
        """The JSON body the agent sends (checked again by ``check_placement_report`` on the platform)."""
        body: dict = {"generation": self.generation, "result": self.result.value}
        for key in ("version", "canary", "still_serving"):
            if getattr(self, key) is not None:
                body[key] = getattr(self, key)
        if self.message:
            body["message"] = self.message
        if self.error:
            body["error"] = self.error
        if self.result is PlacementResult.LOADED:
            body["kind"] = self.kind.value if self.kind else None
        if self.result is PlacementResult.LOST:
            body["reloading"] = self.reloading
        if self.footprint_mb is not None:
            body["footprint_mb"] = self.footprint_mb
        if self.timings:
            body["timings"] = dict(self.timings)
        return body


PLACEMENT_REPORT_FIELDS = {
    "generation",
    "result",
    "version",
    "canary",
    "still_serving",
    "message",
    "error",
    "kind",
    "reloading",
    "footprint_mb",
    "timings",
}
# An agent's load, step by step (ms): from the moment it had the decision (its desired state held it) to
# starting it, the version's files written into the instance's repository (downloaded first if not cached),
# Triton's load until the version is ready, the smoke inference, and the whole until the report was sent.
LOAD_TIMINGS = ("queued_ms", "files_ms", "load_ms", "smoke_ms", "total_ms")
MAX_TIMING_MS = 86_400_000
MAX_FOOTPRINT_MB = 1024 * 1024  # 1 TiB: more than any device holds


def check_placement_report(body) -> PlacementReport:
    body = _object(body, "body")
    unknown = sorted(set(body) - PLACEMENT_REPORT_FIELDS)
    if unknown:
        raise ProtocolError(f"unknown field(s) {', '.join(map(repr, unknown))} in a placement report.")
    generation = body.get("generation")
    if not is_int(generation, 1):
        raise ProtocolError("'generation' must be the positive generation the agent applied.")
    result = _member(body.get("result"), PlacementResult, "result")
    ids = {key: _optional_int(body.get(key), key, 1) for key in ("version", "canary", "still_serving")}
    if (
        result in (PlacementResult.LOADED, PlacementResult.FAILED, PlacementResult.CANARY_LOADED)
        and ids["version"] is None
    ):
        raise ProtocolError(f"'version' is required for a '{result}' report.")
    if result in (PlacementResult.CANARY_LOADED, PlacementResult.CANARY_FAILED) and ids["canary"] is None:
        raise ProtocolError(f"'canary' is required for a '{result}' report.")
    kind = body.get("kind", LoadedKind.SERVING.value)
    kind = None if kind is None else _member(kind, LoadedKind, "kind")
    return PlacementReport(
        generation=generation,
        result=result,
        message=text(body.get("message"), "message", MAX_ERROR, keep_head=True),
        error=text(body.get("error"), "error", MAX_ERROR, keep_head=True),
        kind=kind,
        reloading=_bool(body.get("reloading", False), "reloading"),
        footprint_mb=None
        if body.get("footprint_mb") is None
        else _int(body["footprint_mb"], "footprint_mb", 1, MAX_FOOTPRINT_MB),
        timings=check_timings(body.get("timings")),
        **ids,
    )


def check_timings(raw) -> dict[str, int] | None:
    """A load's timings: an object of ``LOAD_TIMINGS`` keys to whole milliseconds (any subset), or null."""
    if raw is None:
        return None
    raw = _object(raw, "timings")
    unknown = sorted(set(raw) - set(LOAD_TIMINGS))
    if unknown:
        raise ProtocolError(
            f"unknown timing(s) {', '.join(map(repr, unknown))}; 'timings' may hold {', '.join(LOAD_TIMINGS)}."
        )
    return {key: _int(value, f"timings.{key}", 0, MAX_TIMING_MS) for key, value in raw.items()}


# -- platform -> agent -------------------------------------------------------------------------------------
def _keys(entry, required: dict, name: str) -> dict:
    entry = _object(entry, name)
    missing = sorted(set(required) - set(entry))
    if missing:
        raise ProtocolError(f"'{name}' lacks {', '.join(map(repr, missing))}.")
    for key, kind in required.items():
        value = entry[key]
        if kind is int and not is_int(value, 0):
            raise ProtocolError(f"'{name}.{key}' must be a non-negative integer.")
        if kind is not int and (isinstance(value, bool) and kind is not bool or not isinstance(value, kind)):
            raise ProtocolError(f"'{name}.{key}' has the wrong type.")
    return entry


INSTANCE_FIELDS = {
    "id": int,
    "name": str,
    "label": str,
    "http_port": int,
    "grpc_port": int,
    "metrics_port": int,
    "device_ids": list,
    "executor": str,
    "latency_summaries": bool,
    "desired_state": str,
    "state": str,
    "restarts": int,
    "crash_times": list,
    "pid": (int, type(None)),
    "command": str,
    "command_seq": int,
    "api_key": str,
}
_VERSION_REF = (int, type(None))
PLACEMENT_FIELDS = {
    "id": int,
    "instance": int,
    "label": str,
    "deployment": int,
    "model_name": str,
    "generation": int,
    "applied_generation": int,
    "state": str,
    "undeploy": bool,
    "target": _VERSION_REF,
    "active": _VERSION_REF,
    "target_version": _VERSION_REF,
    "canary_target": _VERSION_REF,
    "served": _VERSION_REF,
    "canary": _VERSION_REF,
    "keep_model": bool,
}
PLACEMENT_VERSION_KEYS = ("target", "served", "canary", "canary_target", "active", "target_version")
VERSION_FIELDS = {
    "id": int,
    "number": int,
    "label": str,
    "model_name": str,
    "config_text": str,
    "signature": dict,
    "instance_limit": int,
    "files": (list, type(None)),
}


def check_instance_entry(entry, name: str = "instance") -> dict:
    entry = _keys(entry, INSTANCE_FIELDS, name)
    for key in ("http_port", "grpc_port", "metrics_port"):
        _int(entry[key], f"{name}.{key}", 1, 65535)
    _member(entry["state"], InstanceState, f"{name}.state")
    _member(entry["desired_state"], DesiredInstanceState, f"{name}.desired_state")
    _member(entry["command"], InstanceCommand, f"{name}.command")
    if not all(is_int(device) for device in entry["device_ids"]):
        raise ProtocolError(f"'{name}.device_ids' must be a list of device numbers.")
    return entry


def check_placement_entry(entry, name: str = "placement") -> dict:
    entry = _keys(entry, PLACEMENT_FIELDS, name)
    _member(entry["state"], PlacementState, f"{name}.state")
    return entry


def check_version_entry(entry, name: str = "version") -> dict:
    """A placed version. ``steps`` (optional; an ensemble's) lists the Triton names of the models its config
    calls: each one of the same team as the version's own model."""
    entry = _keys(entry, VERSION_FIELDS, name)
    steps = entry.setdefault("steps", [])
    if not isinstance(steps, list) or len(steps) > MAX_ENSEMBLE_STEPS:
        raise ProtocolError(f"'{name}.steps' must be a list of at most {MAX_ENSEMBLE_STEPS} model names.")
    team = naming.parse_triton_model_name(entry["model_name"])[0] if steps else None
    for index, step in enumerate(steps):
        if not naming.is_triton_model_name(step) or naming.parse_triton_model_name(step)[0] != team:
            raise ProtocolError(f"'{name}.steps[{index}]' is not a model of the version's team.")
    for index, item in enumerate(entry["files"] or []):
        item = _object(item, f"{name}.files[{index}]")
        if not isinstance(item.get("path"), str) or not isinstance(item.get("sha256"), str):
            raise ProtocolError(f"'{name}.files[{index}]' must have a 'path' and a 'sha256'.")
    return entry


def check_desired_state(raw) -> dict:
    """A desired state as the platform sends it: every instance, placement and placed version checked, and
    every version a placement names present in ``versions``."""
    raw = _object(raw, "desired state")
    for key, kind in (("generation", int), ("instances", list), ("placements", list), ("versions", dict)):
        if key not in raw or not isinstance(raw[key], kind) or isinstance(raw[key], bool):
            raise ProtocolError(f"the desired state's '{key}' is missing or not a {kind.__name__}.")
    for index, entry in enumerate(raw["instances"]):
        check_instance_entry(entry, f"instances[{index}]")
    versions = {}
    for key, entry in raw["versions"].items():
        check_version_entry(entry, f"versions[{key}]")
        if str(entry["id"]) != key:
            raise ProtocolError(f"'versions[{key}]' holds version {entry['id']}.")
        versions[entry["id"]] = entry
    for index, entry in enumerate(raw["placements"]):
        check_placement_entry(entry, f"placements[{index}]")
        for key in PLACEMENT_VERSION_KEYS:
            if entry[key] is not None and entry[key] not in versions:
                raise ProtocolError(
                    f"'placements[{index}].{key}' names version {entry[key]}, not in 'versions'."
                )
    return raw


def check_placement_answer(raw) -> tuple[bool, dict | None]:
    """The platform's answer to a placement report: (accepted, the placement as it is now or None)."""
    raw = _object(raw, "answer")
    accepted = _bool(raw.get("accepted"), "accepted")
    entry = raw.get("placement")
    return accepted, None if entry is None else check_placement_entry(entry)


def check_hello(raw) -> dict:
    """The heartbeat's answer: who this host is."""
    raw = _object(raw, "answer")
    for key in ("host", "address"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise ProtocolError(f"the platform's answer lacks '{key}'.")
    return raw


def check_join_answer(raw) -> dict:
    raw = check_hello(raw)
    if not isinstance(raw.get("credential"), str) or not raw["credential"]:
        raise ProtocolError("the platform's join answer lacks 'credential'.")
    return raw
