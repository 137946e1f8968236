"""The agent API (``/agent/v1/``): how a host agent talks to the platform, with its host's credential only.

An agent holds no database or broker credentials. It joins once with the join token staff got when they created
the host (``POST /agent/v1/join``) and from then on sends ``Authorization: Bearer hag_...``. The management
API's sessions and tokens do not work here, and the host credential does not work on the management API (its
token check refuses anything that is not a ``tgp_`` token). A revoked host's calls get 401 at once: every call
looks its credential up (one indexed query), nothing is cached.

This module has the fleet's part: join, register/heartbeat (facts + NPU inventory + log tails) and instance
state reports. The desired state, placement reports and artifacts are ``apps.deployments.agent_api`` (it
builds on this module's ``host_only``). Every body is checked against an allow-list; another host's objects
are 404.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from functools import wraps

from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from apps.core.errors import public_error
from apps.fleet import services
from apps.fleet.models import InstanceState, TritonInstance
from backend_ge import npu_smi

log = logging.getLogger(__name__)

MAX_TEXT = 20_000  # a log tail of 30 lines, with room to spare
FACT_FIELDS = {"cpus": int, "memory_mb": int, "platform": str, "python": str, "agent_version": str}
# Every number an agent sends fits the column it goes to (PostgreSQL's integer) and is a real number: a value
# out of range is the agent's 400, never the database's error.
MAX_INT = 2**31 - 1
MAX_FLOAT = 1e9


class BadReport(ValueError):
    """The agent's body does not fit the allow-list; the message says what to fix."""


def error(status: int, code: str, message: str) -> JsonResponse:
    return JsonResponse({"error": code, "message": message}, status=status)


def unauthorized() -> JsonResponse:
    return error(
        401,
        "unauthorized",
        "Missing, unknown or revoked host credential: send 'Authorization: Bearer hag_...' as "
        "`manage.py hostagent` stored it at join; a revoked host must be given a new join token.",
    )


def host_only(view):
    """Only a joined, unrevoked host's credential passes; ``request.host`` is that host."""

    @csrf_exempt
    @wraps(view)
    def wrapped(request, *args, **kwargs):
        keyword, _, raw = request.headers.get("Authorization", "").partition(" ")
        host = services.host_for_credential(raw.strip()) if keyword.lower() == "bearer" else None
        if host is None:
            return unauthorized()
        request.host = host
        try:
            return view(request, *args, **kwargs)
        except BadReport as exc:
            return error(400, "invalid", str(exc))

    return wrapped


def _not_json(constant: str):
    raise BadReport(f"The body is not JSON: {constant} is not a number in JSON.")


def read_json(request) -> dict:
    try:
        body = json.loads(request.body or b"{}", parse_constant=_not_json)
    except BadReport:
        raise
    except ValueError:
        raise BadReport("The body is not JSON.") from None
    if not isinstance(body, dict):
        raise BadReport("The body must be a JSON object.")
    return body


def _text(value, name: str, limit: int = MAX_TEXT) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise BadReport(f"'{name}' must be a string.")
    return value[-limit:]


def _is_int(value, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_number(value) -> bool:
    """A float column's value: an int or float within +-MAX_FLOAT (``read_json`` refuses NaN and Infinity)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and -MAX_FLOAT <= value <= MAX_FLOAT


def _facts(raw) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise BadReport("'facts' must be an object.")
    facts = {}
    for key, kind in FACT_FIELDS.items():
        value = raw.get(key)
        if value is None:
            continue
        if kind is int and not _is_int(value, 0, MAX_INT):
            raise BadReport(f"'facts.{key}' must be an integer from 0 to {MAX_INT}.")
        if kind is str:
            value = _text(value, f"facts.{key}", 200)
        facts[key] = value
    return facts


_CHIP_FIELDS = {
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
_CHIP_FLOATS = {"power_w", "temperature_c", "aicore_percent"}  # float columns; the other numbers are integers


def _inventory(raw) -> npu_smi.NpuInventory | None:
    """The agent's `npu-smi info` as parsed on the host (``null`` on hosts without npu-smi)."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("chips", []), list):
        raise BadReport("'npu' must be null or an object with 'driver_version' and a list 'chips'.")
    chips = []
    for index, chip in enumerate(raw.get("chips", [])[:64]):
        if not isinstance(chip, dict):
            raise BadReport(f"'npu.chips[{index}]' must be an object.")
        values = {}
        for key, kind in _CHIP_FIELDS.items():
            value = chip.get(key, 0 if kind is int else "" if kind is str else None)
            if isinstance(value, bool) or not isinstance(value, kind):
                raise BadReport(f"'npu.chips[{index}].{key}' has the wrong type.")
            if key in _CHIP_FLOATS:
                if value is not None and not _is_number(value):
                    raise BadReport(f"'npu.chips[{index}].{key}' must be a number within +-{MAX_FLOAT:g}.")
            elif isinstance(value, int) and not _is_int(value, 0, MAX_INT):
                raise BadReport(f"'npu.chips[{index}].{key}' must be an integer from 0 to {MAX_INT}.")
            values[key] = value[:50] if isinstance(value, str) else value
        chips.append(npu_smi.NpuChip(**values))
    return npu_smi.NpuInventory(
        npu_smi_version=_text(raw.get("npu_smi_version"), "npu.npu_smi_version", 50),
        driver_version=_text(raw.get("driver_version"), "npu.driver_version", 50),
        chips=chips,
    )


def _log_tails(raw) -> dict[int, str]:
    """Instance id -> its last log lines; the service writes only this host's instances."""
    if raw is None:
        return {}
    if not isinstance(raw, list):
        raise BadReport("'instances' must be a list of {id, log_tail}.")
    tails = {}
    for entry in raw[:256]:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), int):
            raise BadReport("'instances' must be a list of {id, log_tail}.")
        tails[entry["id"]] = _text(entry.get("log_tail"), "log_tail")
    return tails


@require_POST
@csrf_exempt
def join(request):
    """Exchange a one-time join token for the host's credential (shown in this answer only)."""
    try:
        body = read_json(request)
    except BadReport as exc:
        return error(400, "invalid", str(exc))
    token = body.get("join_token")
    if not isinstance(token, str) or not token:
        return error(400, "invalid", 'Send {"join_token": "hjt_..."} as staff got it when creating the host.')
    try:
        host, credential = services.join_host(token)
    except services.JoinRefused:
        return error(
            401,
            "unauthorized",
            "Unknown, used or expired join token: ask platform staff for a new one (host page, 'New join token').",
        )
    return JsonResponse({"host": host.name, "address": host.address, "credential": credential}, status=201)


@require_POST
@host_only
def heartbeat(request):
    """Liveness, facts, NPU inventory and the instances' log tails (every 10 s; also the agent's register call).
    Answers the host's identity and its desired-state generation, so an agent learns of news here too."""
    body = read_json(request)
    inventory = _inventory(body.get("npu"))
    facts = _facts(body.get("facts"))
    tails = _log_tails(body.get("instances"))
    services.record_heartbeat(
        request.host, facts=facts, inventory=inventory, log_tails=tails, read_local=False
    )
    return JsonResponse(
        {
            "host": request.host.name,
            "address": request.host.address,
            "generation": request.host.desired_generation,
        }
    )


REPORTED_STATES = {state.value for state in InstanceState}


@require_POST
@host_only
def instance_state(request, instance_id: int):
    """The agent's supervisor moved an instance: state, pid, restarts, crash times, error, log tail."""
    instance = TritonInstance.objects.filter(pk=instance_id, host=request.host).first()
    if instance is None:
        return error(404, "not_found", "No such instance on this host.")
    body = read_json(request)
    fields: dict = {}
    if "state" in body:
        if body["state"] not in REPORTED_STATES:
            raise BadReport(f"'state' must be one of {', '.join(sorted(REPORTED_STATES))}.")
        fields["state"] = body["state"]
    if "pid" in body:
        if body["pid"] is not None and not _is_int(body["pid"], 1, MAX_INT):
            raise BadReport(f"'pid' must be an integer from 1 to {MAX_INT}, or null.")
        fields["pid"] = body["pid"]
    if "restarts" in body:
        if not _is_int(body["restarts"], 0, MAX_INT):
            raise BadReport(f"'restarts' must be an integer from 0 to {MAX_INT}.")
        fields["restarts"] = body["restarts"]
    if "crash_times" in body:
        times = body["crash_times"]
        if not isinstance(times, list) or len(times) > 100:
            raise BadReport("'crash_times' must be a list of at most 100 ISO timestamps.")
        for value in times:
            try:
                datetime.fromisoformat(value)
            except (TypeError, ValueError):
                raise BadReport("'crash_times' must be a list of ISO timestamps.") from None
        fields["crash_times"] = times
    if "last_error" in body:
        text = _text(body["last_error"], "last_error", 4000)
        fields["last_error"] = public_error(text) if text else ""
    if "log_tail" in body:
        fields["log_tail"] = _text(body["log_tail"], "log_tail")
    services.record_instance_state(instance, **fields)
    return JsonResponse({"id": instance.pk, "accepted": True})


def instance_entry(instance: TritonInstance) -> dict:
    """What the agent needs to run one instance (its secret included: only its own host gets it)."""
    return {
        "id": instance.pk,
        "name": instance.name,
        "label": str(instance),
        "http_port": instance.http_port,
        "grpc_port": instance.grpc_port,
        "metrics_port": instance.metrics_port,
        "device_ids": list(instance.device_ids or []),
        "executor": instance.executor,
        "latency_summaries": instance.latency_summaries,
        "desired_state": instance.desired_state,
        "state": instance.state,
        "restarts": instance.restarts,
        "crash_times": list(instance.crash_times or []),
        "pid": instance.pid,
        "command": instance.command,
        "command_seq": instance.command_seq,
        "api_key": instance.api_key,
    }


def host_instances(host) -> list[dict]:
    instances = list(TritonInstance.objects.filter(host=host))
    for instance in instances:
        instance.host = host  # the labels name it: no join for a row the caller holds
    return [instance_entry(i) for i in instances]
