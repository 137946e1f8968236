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

Every call names the agent protocol it speaks (``X-Agent-Protocol``, ``hostagent.protocol``): ``speaks_protocol``
is the one check, run by ``host_only`` after the credential (a stranger learns nothing) and by ``join``. A
version the platform does not serve is a 426 naming both versions; a malformed header is a 400. The fast path
(``apps.fleet.agent_fastpath``) answers only agents this check would pass and leaves the rest to it.
"""

from __future__ import annotations

import json
import logging
from functools import wraps

from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from apps.fleet import services
from apps.fleet.models import TritonInstance
from backend_ge.errors import public_error
from hostagent import protocol

log = logging.getLogger(__name__)

# A body that does not fit the protocol: the agent's 400, with what is wrong (``hostagent.protocol``).
BadReport = protocol.ProtocolError


def error(status: int, code: str, message: str) -> JsonResponse:
    return JsonResponse({"error": code, "message": message}, status=status)


def unauthorized() -> JsonResponse:
    return error(
        401,
        "unauthorized",
        "Missing, unknown or revoked host credential: send 'Authorization: Bearer hag_...' as "
        "`python -m hostagent` stored it at join; a revoked host must be given a new join token.",
    )


def protocol_refusal(request, host=None) -> JsonResponse | None:
    """None when the caller speaks an agent protocol this platform serves, else the answer that refuses it.
    With ``host``, the version the host spoke is kept on its row (written only when it changed), so the hosts
    pages show which agents still need an upgrade."""
    raw = request.META.get(protocol.AGENT_PROTOCOL_WSGI_KEY)
    try:
        spoken = protocol.parse_agent_protocol(raw)
    except protocol.ProtocolError as exc:
        return error(400, "invalid", str(exc))
    if host is not None:
        services.record_agent_protocol(host, spoken)
    if protocol.serves_agent_protocol(spoken):
        return None
    return JsonResponse(
        {
            "error": "agent_protocol",
            "message": str(protocol.AgentProtocolRefused(spoken)),
            "agent_protocol": spoken,
            "platform_protocol": protocol.AGENT_PROTOCOL_VERSION,
            "accepted": [protocol.MIN_AGENT_PROTOCOL_VERSION, protocol.AGENT_PROTOCOL_VERSION],
        },
        status=426,
    )


def speaks_protocol(view):
    """Only an agent speaking a served protocol version passes (``join``: before it has a credential)."""

    @wraps(view)
    def wrapped(request, *args, **kwargs):
        refusal = protocol_refusal(request)
        return view(request, *args, **kwargs) if refusal is None else refusal

    return wrapped


def host_only(view):
    """Only a joined, unrevoked host's credential passes, speaking a served agent protocol; ``request.host``
    is that host."""

    @csrf_exempt
    @wraps(view)
    def wrapped(request, *args, **kwargs):
        keyword, _, raw = request.headers.get("Authorization", "").partition(" ")
        host = services.host_for_credential(raw.strip()) if keyword.lower() == "bearer" else None
        if host is None:
            return unauthorized()
        refusal = protocol_refusal(request, host)
        if refusal is not None:
            return refusal
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


@require_POST
@csrf_exempt
@speaks_protocol
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
    beat = protocol.check_heartbeat(read_json(request))
    services.record_heartbeat(
        request.host,
        facts=beat.facts,
        inventory=beat.npu,
        log_tails=beat.log_tails,
        read_local=False,
        port_range=beat.ports,
    )
    return JsonResponse(
        {
            "host": request.host.name,
            "address": request.host.address,
            "generation": request.host.desired_generation,
        }
    )


@require_POST
@host_only
def instance_state(request, instance_id: int):
    """The agent's supervisor moved an instance: state, pid, restarts, crash times, error, log tail."""
    instance = TritonInstance.objects.filter(pk=instance_id, host=request.host).first()
    if instance is None:
        return error(404, "not_found", "No such instance on this host.")
    fields = protocol.check_instance_report(read_json(request))
    if fields.get("last_error"):
        fields["last_error"] = public_error(fields["last_error"])
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
