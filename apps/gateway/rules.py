"""HAProxy rule snippets both gateway frontends (HTTP and gRPC) share, and the options they are rendered with.

No Django here (see ``apps.gateway.haproxy``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from apps.core import priority


@dataclass(frozen=True)
class Options:
    """Where and how the gateway runs (from settings)."""

    directory: Path
    bind: str
    grpc_bind: str
    stats_bind: str
    key_header: str
    grpc_key_header: str
    default_limit: int
    threads: int = 1
    check_interval_ms: int = 500
    hard_stop_after_s: int = 60
    # HAProxy's tune.bufsize: the largest request kept whole (for retries, and for reading a gRPC message).
    buffer_size: int = 16384
    # The largest gRPC request message the gateway forwards (it walks it as it streams through the buffer).
    grpc_max_message: int = 64 * 2**20
    # How long a request for a sleeping model is held while a replica loads (then 503 with Retry-After).
    activation_timeout_s: int = 60
    # Requests one server (a model's replica on one instance) is sent at once; more wait in the gateway's
    # queue, where interactive requests go first (apps.core.priority). 0: no limit, and no priority queue.
    server_maxconn: int = 64

    @property
    def admin_socket(self) -> Path:
        return self.directory / "admin.sock"

    @property
    def wake_socket(self) -> Path:
        """Where the gateway command listens for wake.lua's signals (a stream socket: Lua has no datagrams)."""
        return self.directory / "wake.sock"

    @property
    def config_file(self) -> Path:
        return self.directory / "haproxy.cfg"

    def map_file(self, name: str) -> Path:
        return self.directory / f"{name}.map"

    def make_directory(self) -> None:
        """The gateway's directory is the platform's alone (0700): its configuration and maps name every
        instance's key and the tokens' hashes, and Triton's servers may run on this machine as other users."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.directory.chmod(0o700)


def json_error(status: int, message: str, extra: str = "") -> str:
    body = json.dumps({"error": message})
    if "'" in body:
        raise ValueError("error bodies are written in single quotes")
    return f"http-request return status {status} content-type application/json {extra}string '{body}'"


def token_rules(o: Options, deny_unauthenticated: str, deny_expired: str) -> list[str]:
    """Hash the token's secret and look ``<prefix>:<sha256>`` up in ``tokens.map``.

    The hash is the costliest step, and a client sends the same header on every request of a connection: the
    key is kept for the connection (``sess.`` variables) beside the header it was computed from, and computed
    again whenever the header differs. The map lookup itself runs on every request, so a revocation or expiry
    applies to open connections too. Both ``sess.`` variables are dropped before a new key is computed, so a
    request without the header (or with one that yields no key) never finds the previous request's key.
    """
    tokens = o.map_file("tokens")
    return [
        "    acl auth_cached req.fhdr(authorization),strcmp(sess.auth) eq 0",
        "    http-request unset-var(sess.tokkey) if !auth_cached",
        "    http-request unset-var(sess.auth) if !auth_cached",
        # A converter argument cannot hold parentheses, so no capture group: the prefix is the 2nd "_" field.
        "    http-request set-var(txn.hash) req.fhdr(authorization),regsub('^[Bb]earer +tgp_[0-9a-f]+_',''),sha2(256),hex,lower if !auth_cached",
        "    http-request set-var(sess.tokkey) req.fhdr(authorization),field(2,_),concat(:,txn.hash,) if { var(txn.hash) -m found }",
        "    http-request set-var(sess.auth) req.fhdr(authorization) if { var(txn.hash) -m found }",
        f"    http-request set-var(txn.tokval) var(sess.tokkey),map({tokens})",
        "    http-request set-var(txn.team) var(txn.tokval),field(1,:)",
        "    http-request set-var(txn.expires) var(txn.tokval),field(2,:)",
        "    http-request set-var(txn.pclass) var(txn.tokval),field(3,:)",
        "    acl token_known var(txn.team) -m found",
        "    acl token_expired date(),sub(txn.expires) ge 0",
        f"    {deny_unauthenticated} if !token_known",
        f"    {deny_expired} if token_expired",
        *(
            f"    http-request set-priority-class int({rank}) if {{ var(txn.pclass) -m str {name} }}"
            for name, rank in priority.GATEWAY_CLASS.items()
            if rank
        ),
    ]


# --- Refusal counts (apps.gateway.metrics reads them with `show table gateway_counts`). -----------------------
# HAProxy 2.6 counts responses only by class, and `http-after-response` cannot increment counters, so each
# request increments the stage it has passed: a refusal is the difference between two stages (401 = stage 1 -
# stage 2, 429 = 2 - 3, the gateway's 404 = (0 - 1) + (3 - 4)); stage 5 counts 404s answered by an instance,
# stage 6 the 400s (bad requests: the instance's own and those ``client_error_rules`` rewrote), stage 7 the
# requests of stage 4 whose caller's class is batch (the rest of stage 4 are interactive).
# Key "all": every request (sticky counter 2); key "d<id>": requests naming a served model (sticky counter 1).
COUNTS_TABLE = "gateway_counts"
COUNT_STAGES = 8
BAD_REQUEST_STAGE = 6
BATCH_STAGE = 7


def count_rules(stage: int, *counters: int) -> list[str]:
    return [f"    http-request sc-inc-gpc({stage},{sc})" for sc in counters]


def class_count_rules(*counters: int) -> list[str]:
    """After stage 4: the batch-class requests among them (``txn.pclass``, set by ``token_rules``)."""
    batch = f"{{ var(txn.pclass) -m str {priority.BATCH} }}"
    return [f"    http-request sc-inc-gpc({BATCH_STAGE},{sc}) if {batch}" for sc in counters]


# --- Client errors are 400s. ----------------------------------------------------------------------------------
# Triton 2.51 answers a request its HTTP frontend cannot parse with 500, although nothing failed on the server:
# malformed JSON, a field of the wrong JSON type, a shape that does not match its data, a data type that does
# not match its data. (Its other checks - shape or data type against the model, batch size, unknown or missing
# inputs, binary data sizes - and the GE backend's own (INVALID_ARG) already answer 400.) Measured with the
# real server for every case: docs/users/call.md. Only these messages, at the start of the body, are a bad
# request; every other 500 (a model that failed in execute) stays a 500.
TRITON_CLIENT_ERRORS = (
    "failed to parse the request JSON buffer",  # not JSON, or trailing bytes after it
    r"Unable to parse \x27[A-Za-z_]+\x27",  # a field missing or of the wrong type; shape vs data
    r"Unable to set \x27[A-Za-z_]+\x27",  # an output parameter of the wrong type (classification)
)
CLIENT_ERROR_BODY = r'^\{"error":"(' + "|".join(TRITON_CLIENT_ERRORS) + "): "
# How long a 500's body may take to arrive before the rules judge what came (Triton sends it at once).
ERROR_BODY_WAIT_MS = 1000


def client_error_rules(infer_acl: str) -> list[str]:
    """Rewrite Triton's parse failures on the infer path from 500 to 400, body unchanged.

    Only a 500's body is buffered (``wait-for-body``): a successful answer streams through untouched. The
    rewrite runs before HAProxy counts the response, so the exporter's classes (and the stage-6 count of
    400s) see the 400. Triton sends some error bodies as ``text/plain``; they are JSON, and say so here.
    """
    if "'" in CLIENT_ERROR_BODY:
        raise ValueError("the regex is written in single quotes")
    infer = "{ var(txn.infer) -m found }"
    return [
        f"    http-request set-var(txn.infer) int(1) if {infer_acl}",
        f"    http-response wait-for-body time {ERROR_BODY_WAIT_MS}ms if {{ status 500 }} {infer}",
        f"    http-response set-status 400 if {{ status 500 }} {infer} {{ res.body -m reg '{CLIENT_ERROR_BODY}' }}",
        "    http-response set-header content-type application/json"
        f" if {infer} {{ status 400:599 }} {{ res.hdr(content-type) -m beg text/plain }}",
        *(f"    http-response sc-inc-gpc({BAD_REQUEST_STAGE},{sc}) if {{ status 400 }}" for sc in (1, 2)),
    ]


# --- Tensor shapes (apps/gateway/shapes.lua): Triton 2.51 sizes a JSON input from its shape before reading it. ---
SHAPES_LUA_FILE = Path(__file__).with_name("shapes.lua")


def shape_request_rules() -> list[str]:
    """What ``tensor_shapes`` reads: the body's length and a binary request's JSON header length (one such
    header: Triton would read another than the one checked). Declared with the filter, on the HTTP frontend."""
    return [
        "    filter lua.tensor_shapes",
        "    filter lua.priority_param",
        json_error(400, "send at most one Inference-Header-Content-Length header")
        + " if { req.hdr_cnt(inference-header-content-length) gt 1 }",
        "    http-request set-var(txn.blen) req.hdr(content-length)",
        "    http-request set-var(txn.jlen) req.hdr(inference-header-content-length)",
    ]


def shape_response_rules(before_counts: bool) -> list[str]:
    """A request whose shape (or top-level key: priority.lua) a filter refused reached Triton as JSON it
    cannot parse (nothing sized): 400 first (so it counts as a bad request), then the filter's reason instead
    of Triton's parse error."""
    refused = "{ var(txn.shape_refused) -m found }"
    keys = "{ var(txn.priority_refused) -m found }"
    if before_counts:
        return [
            f"    http-response set-status 400 if {refused}",
            f"    http-response set-status 400 if {keys}",
        ]
    return [
        "    http-response return status 400 content-type application/json lf-string "
        """'{"error":"a tensor shape was refused before the model read it: %[var(txn.shape_refused)]"}' """
        f"if {refused}",
        "    http-response return status 400 content-type application/json lf-string "
        """'{"error":"the request was refused before the model read it: %[var(txn.priority_refused)]"}' """
        f"if {keys}",
    ]


# --- Triton priority levels (apps/gateway/priority.lua) from the caller's class (apps.core.priority). ---------
PRIORITY_LUA_FILE = Path(__file__).with_name("priority.lua")
PRIORITY_INSERT_BASE = 27  # priority.lua's INSERT_BASE: the bytes it writes are this plus the level's digits


def priority_level_rules(o: Options) -> list[str]:
    """For an inference request to a version whose config defines priority levels (``priority.map``): the
    caller's class as Triton's level (``txn.plevel``, which priority.lua writes into the body). After the route
    and the caller's class are known."""
    found = "{ var(txn.plevels) -m found }"
    interactive = priority.triton_level(priority.INTERACTIVE, 2)
    return [
        "    http-request set-var(txn.pversion) var(txn.version) if !explicit_version",
        "    http-request set-var(txn.pversion) path,field(6,/) if explicit_version",
        "    http-request set-var(txn.pkey) var(txn.model),concat(/,txn.pversion) if infer_path",
        f"    http-request set-var(txn.plevels) var(txn.pkey),map({o.map_file('priority')}) if infer_path",
        f"    http-request set-var(txn.plevel) str({interactive}) if {found} {{ var(txn.pclass) -m str {priority.INTERACTIVE} }}",
        f"    http-request set-var(txn.plevel) var(txn.plevels) if {found} {{ var(txn.pclass) -m str {priority.BATCH} }}",
        *priority_body_rules(),
    ]


def priority_body_rules() -> list[str]:
    """The body's lengths raised by what priority.lua writes (``txn.plevel`` set: a level of digits), before
    the body is read. ``txn.jlen`` is the binary request's JSON header length as the client sent it."""
    inserting = "{ var(txn.pinsert) -m found }"
    return [
        f"    http-request set-var(txn.pinsert) var(txn.plevel),length,add({PRIORITY_INSERT_BASE})"
        " if { var(txn.plevel) -m reg ^[0-9]{1,4}$ }",
        "    http-request set-header content-length %[req.hdr(content-length),add(txn.pinsert)]"
        f" if {inserting} {{ req.hdr(content-length) -m found }}",
        "    http-request set-header inference-header-content-length %[var(txn.jlen),add(txn.pinsert)]"
        f" if {inserting} {{ var(txn.jlen) -m found }}",
    ]
