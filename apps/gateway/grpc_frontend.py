"""The gateway's gRPC frontend: per-model tenancy for KServe v2 gRPC on shared instances.

No Django here (see ``apps.gateway.haproxy``). A unary call's body is one protobuf message whose field 1 names
the model; ``grpc.lua`` (a Lua action) walks the whole message and HAProxy then applies the HTTP frontend's
rules to the name it found. In this order:

1. The method must be one the gateway offers (``GRPC_METHODS``), else ``UNIMPLEMENTED``: the repository,
   shared-memory, trace and logging services stay closed to tenants.
2. A unary model call waits for its whole body (bounded by the buffer: ``max_grpc_message``); the Lua action
   refuses a body it cannot parse completely, one that is compressed, larger than the limit, carries more than
   one message, or names ``model_name``/``model_version`` twice (protobuf keeps the *last* value) with
   ``INVALID_ARGUMENT``, and nothing is forwarded.
3. Token (``UNAUTHENTICATED``), rate limit (``RESOURCE_EXHAUSTED``), the model's route in ``models.map`` and
   the team check: another team's model and an unknown one are the same ``NOT_FOUND``.
4. Canary and pinning as for HTTP: an unversioned call is pinned to the route's version (or the canary's, for
   ``weight`` % of them, one ``rand()`` draw) by inserting ``model_version`` into the message (the Lua filter
   ``grpc_walk`` on the slot's gRPC twin, the only way HAProxy 2.6 changes a body); a call naming the canary version goes to the canary.
   ``ModelStatistics`` is not pinned: unversioned, it asks for every version of the model.
5. A model call for a sleeping deployment (scale to zero) is held until its gRPC twin has a ready server,
   as HTTP requests are (``wake.lua``); past the activation timeout it gets ``UNAVAILABLE`` with the reason.
6. The call goes to the slot's gRPC twin ``g<slot>`` (the same placements, their gRPC ports) without the
   client's ``authorization`` and with the instance key.

Server-level calls (``ServerLive``, ``ServerReady``, ``ServerMetadata``) name no model and go to any ready
instance (``grpc_any``). ``ModelStreamInfer`` is not inspected - every message of a stream names its own model
and HAProxy 2.6 cannot hold a stream's later messages back - so streams go only to instances on hosts
dedicated to the caller's team (``grpc.map``), where every model is the team's, and are refused with
``PERMISSION_DENIED`` elsewhere.
"""

from __future__ import annotations

from pathlib import Path

from apps.core import priority
from apps.gateway.rules import COUNTS_TABLE, Options, class_count_rules, count_rules, token_rules

LUA_FILE = Path(__file__).with_name("grpc.lua")
GRPC_METHODS = (
    "ServerLive",
    "ServerReady",
    "ServerMetadata",
    "ModelReady",
    "ModelMetadata",
    "ModelConfig",
    "ModelStatistics",
    "ModelInfer",
    "ModelStreamInfer",
)
SERVICE = "/inference.GRPCInferenceService/"
ANY_INSTANCE = "grpc_any"
# How much of a refused call's body the refusal service reads (and drops) beyond the largest message before it
# answers anyway: a trailers-only answer while the client still uploads reaches grpcio as CANCELLED.
DRAIN_SLACK = 65536


def twin(slot: str) -> str:
    """The gRPC backend beside the HTTP slot ``slot``: the same placements, their gRPC ports."""
    return f"g{slot}"


def refusal(code: int | str, message: str) -> str:
    """The rule that records a refusal (``<grpc status> <message>``); ``answer()`` sends it."""
    if '"' in message:
        raise ValueError("gRPC messages are written in double quotes")
    return f'http-request set-var-fmt(txn.gmsg) "{code} {message}"'


def answer() -> str:
    """Ends a refused call through the service that drains the body before the trailers-only answer."""
    return "    http-request use-service lua.grpc_refuse if { var(txn.gmsg) -m found }"


def frontend_lines(o: Options) -> list[str]:
    unauthenticated = "missing, invalid or revoked API token: send metadata authorization: Bearer tgp_..."
    methods = "|".join(GRPC_METHODS)
    return [
        "frontend grpc",
        f"    bind {o.grpc_bind} proto h2",
        f"    http-request del-header {o.grpc_key_header}",
        f"    http-request set-var(txn.glimit) int({o.grpc_max_message + DRAIN_SLACK})",
        f"    http-request track-sc2 str(all) table {COUNTS_TABLE}",
        *count_rules(0, 2),
        f"    acl grpc_method path -m reg '^/inference\\.GRPCInferenceService/({methods})$'",
        f"    acl stream_call path {SERVICE}ModelStreamInfer",
        # Waits (yields) until the whole body is in or the buffer is full: the Lua action reads that head.
        # Nothing yields after it before the token rules, which keep per-connection state (see token_rules).
        "    http-request wait-for-body time 15s if !stream_call",
        f"    {refusal(12, 'this gRPC method is not offered by the gateway')} if !grpc_method",
        answer(),
        f"    acl server_call path {SERVICE}ServerLive {SERVICE}ServerReady {SERVICE}ServerMetadata",
        "    acl model_call path -m reg '^/inference\\.GRPCInferenceService/Model(Ready|Metadata|Config|Statistics|Infer)$'",
        f"    http-request lua.grpc_model {o.grpc_max_message} if model_call",
        f"    {refusal('%[var(txn.gcode)]', '%[var(txn.gerr)]')} if model_call {{ var(txn.gerr) -m found }}",
        answer(),
        f"    http-request set-var(txn.route) var(txn.model),map({o.map_file('models')}) if model_call",
        f"    http-request track-sc1 var(txn.route),field(2,/) table {COUNTS_TABLE} if model_call",
        *count_rules(1, 1, 2),
        *token_rules(
            o, refusal(16, unauthenticated), refusal(16, "the API token has expired; create a new one")
        ),
        answer(),
        *count_rules(2, 1, 2),
        "    http-request track-sc0 var(txn.team) table team_rates",
        f"    http-request set-var(txn.limit) var(txn.team),map({o.map_file('limits')},{o.default_limit})",
        "    acl over_limit sc_gpc0_rate(0),sub(txn.limit) ge 0",
        "    "
        + refusal(
            8, "rate limit exceeded: team %[var(txn.team)] may send %[var(txn.limit)] requests per second"
        )
        + " if over_limit",
        answer(),
        "    http-request sc-inc-gpc0(0)",
        *count_rules(3, 1, 2),
        "    acl own_model var(txn.route),field(1,/),strcmp(txn.team) eq 0",
        "    "
        + refusal(5, "Request for unknown model: '%[var(txn.model)]' is not found")
        + " if model_call !own_model",
        answer(),
        f"    http-request set-var(txn.backend) var(txn.team),map({o.map_file('grpc')}) if stream_call",
        "    acl dedicated var(txn.backend) -m found",
        # A stream's first message (a bounded wait): the refusal then reaches a client that sent it (see above).
        "    http-request wait-for-body time 1s if stream_call !dedicated",
        "    "
        + refusal(
            7,
            "ModelStreamInfer reaches only instances dedicated to your team and your team has none; use ModelInfer",
        )
        + " if stream_call !dedicated",
        answer(),
        *count_rules(4, 1, 2),
        *class_count_rules(1, 2),
        # An instance's NOT_FOUND (a version it does not serve) comes back as a trailers-only answer.
        "    http-response sc-inc-gpc(5,1) if { res.hdr(grpc-status) 5 } !{ var(txn.gmsg) -m found }",
        "    http-response sc-inc-gpc(5,2) if { res.hdr(grpc-status) 5 } !{ var(txn.gmsg) -m found }",
        # ... and its INVALID_ARGUMENT (a request that does not fit the model) is a bad request, like HTTP's 400.
        "    http-response sc-inc-gpc(6,1) if { res.hdr(grpc-status) 3 } !{ var(txn.gmsg) -m found }",
        "    http-response sc-inc-gpc(6,2) if { res.hdr(grpc-status) 3 } !{ var(txn.gmsg) -m found }",
        *_routing_lines(),
        *_priority_lines(o),
        *_hold_lines(o),
        "    http-request del-header authorization",
        f"    use_backend {ANY_INSTANCE} if server_call",
        "    use_backend %[var(txn.backend)] if stream_call",
        "    use_backend g%[var(txn.backend)]",
        "",
    ]


def _routing_lines() -> list[str]:
    """The HTTP frontend's canary and pinning rules, with the version read from the message."""
    return [
        "    acl explicit_version var(txn.gversion) -m found",
        "    acl statistics path -m end /ModelStatistics",
        "    http-request set-var(txn.backend) var(txn.route),field(3,/) if model_call",
        "    http-request set-var(txn.version) var(txn.route),field(4,/) if model_call",
        "    acl no_canary var(txn.route),field(5,/) -m str -- -",
        "    http-request set-var(txn.cweight) var(txn.route),field(7,/) if model_call !no_canary !explicit_version",
        "    http-request set-var(txn.canary) int(1) if model_call !no_canary !explicit_version { rand(100),sub(txn.cweight) lt 0 }",
        "    http-request set-var(txn.cversion) var(txn.route),field(6,/) if model_call !no_canary explicit_version",
        "    http-request set-var(txn.canary) int(1) if model_call !no_canary explicit_version { var(txn.gversion),strcmp(txn.cversion) eq 0 }",
        "    acl canary var(txn.canary) -m found",
        "    http-request set-var(txn.backend) var(txn.route),field(5,/) if canary",
        "    http-request set-var(txn.version) var(txn.route),field(6,/) if canary",
        "    acl pinned var(txn.version) -m int gt 0",
        # The filter inserts the version; the body's length changes, so an announced length would be wrong.
        "    http-request set-var(txn.gpin) var(txn.version) if model_call pinned !explicit_version !statistics",
        "    http-request del-header content-length if { var(txn.gpin) -m found }",
    ]


def _priority_lines(o: Options) -> list[str]:
    """Triton's priority level from the caller's class for an inference of a version whose config defines
    levels (``priority.map``, as on HTTP): ``grpc_walk`` appends it to the message."""
    found = "{ var(txn.plevels) -m found }"
    interactive = priority.triton_level(priority.INTERACTIVE, 2)
    return [
        "    acl infer_call path -m end /ModelInfer",
        "    http-request set-var(txn.pversion) var(txn.version) if model_call infer_call !explicit_version",
        "    http-request set-var(txn.pversion) var(txn.gversion) if model_call infer_call explicit_version",
        "    http-request set-var(txn.pkey) var(txn.model),concat(/,txn.pversion) if { var(txn.pversion) -m found }",
        f"    http-request set-var(txn.plevels) var(txn.pkey),map({o.map_file('priority')}) if {{ var(txn.pkey) -m found }}",
        f"    http-request set-var(txn.plevel) str({interactive}) if {found} {{ var(txn.pclass) -m str {priority.INTERACTIVE} }}",
        f"    http-request set-var(txn.plevel) var(txn.plevels) if {found} {{ var(txn.pclass) -m str {priority.BATCH} }}",
        "    http-request del-header content-length if { var(txn.plevel) -m found }",
    ]


def _hold_lines(o: Options) -> list[str]:
    """Scale to zero: a model call for a sleeping model waits like an HTTP request (``wake.lua``, on the
    slot's gRPC twin), and past the activation timeout gets UNAVAILABLE with the reason."""
    timeout_s = o.activation_timeout_s
    return [
        f"    http-request set-var(txn.sleepy) var(txn.model),map({o.map_file('sleepy')}) if model_call",
        f"    http-request lua.hold_asleep_grpc {timeout_s * 1000} if model_call {{ var(txn.sleepy) -m found }}",
        # The wake action's reason (wakefail.map): Triton's error, as the HTTP answer gives it.
        "    "
        + refusal(
            14, "model '%[var(txn.model)]' is scaled to zero and could not be woken: %[var(txn.wake_code)]"
        )
        + " if { var(txn.wake_code) -m found }",
        "    "
        + refusal(
            14,
            f"model '%[var(txn.model)]' is scaled to zero and no replica became ready within the activation "
            f"timeout ({timeout_s} s); retry later",
        )
        + " if { var(txn.wake_failed) -m found }",
        answer(),
    ]


def backend_lines(slot: str, o: Options, checks: Path, servers: list[str]) -> list[str]:
    """The gRPC twin of an HTTP slot, checked (over the instances' HTTP ports) like the slot.

    The Lua filter that walks the rest of each message and pins the version is declared here, not on the
    frontend: only a model call that passed every rule reaches a twin, and a Lua filter costs each call it is
    attached to about as much CPU as the rest of the gateway (HAProxy 2.6 builds its Lua objects for every
    callback, ~150k instructions per call), so refusals, server-level calls and streams do not pay it."""
    return [
        f"backend {twin(slot)}",
        "    filter lua.grpc_walk",
        "    balance leastconn",
        "    option httpchk",
        f"    http-check send meth GET uri-lf /v2/models/%[str({slot}),map({checks},-)]/ready",
        "    http-check expect status 200",
        f"    http-send-name-header {o.grpc_key_header}",
        *servers,
        "",
    ]
