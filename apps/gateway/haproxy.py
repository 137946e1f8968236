"""HAProxy as the inference gateway: the configuration and map files it runs from, and its admin socket.

No Django here: ``apps.gateway.state`` turns the database into a :class:`GatewayState`, this module turns a
state into files (``apps.gateway.runtime`` into admin-socket commands, ``apps.gateway.process`` runs HAProxy).
Everything a tenant sends is checked in HAProxy itself, in this order:

1. ``/v2/health/live|ready`` (and ``/v2`` server metadata) are answered by the gateway.
2. The path must match the allow-list (``ALLOWED_PATH``) with the right method, else 404. Path tricks
   (``..``, ``//``, percent-encoding, other APIs) cannot match it.
3. ``Authorization: Bearer tgp_<prefix>_<secret>``: the secret is hashed (``sha2(256)``) and
   ``<prefix>:<sha256>`` looked up in ``tokens.map`` (value ``<team>:<expires epoch>``). Missing, wrong,
   revoked (not in the map) or expired: 401. The hash is kept for the connection while its header does not
   change; the lookup runs on every request.
4. The team's request rate (stick table, ``http_req_rate(1s)``) against ``limits.map``: 429.
5. ``models.map`` gives ``<team>/<deployment>/<slot>/<version>/<canary slot>/<canary version>/<weight>`` for a
   served model (:class:`Route`); another team's model is the same 404 as an unknown one. Unversioned requests
   are pinned to ``<version>`` (0: not pinned, during a switch), or to the canary version for ``<weight>`` %
   of them during a rollout.
6. The request goes to the deployment's slot backend (least connections over its healthy placements) with the
   client's ``Authorization`` removed and the instance key added (the server's name *is* the key, sent by
   ``http-send-name-header``, so a redispatch to another instance carries that instance's key; names appear
   only on the admin socket, never in a response or in the exporter).

No reload for deploy, switch, undeploy, placements or instance deaths: deployments live in a pool of
pre-declared backends (:class:`Slots`), servers are added and removed over the admin socket, and each slot's
health check reads its path from ``checks.map``. ``apps.gateway.runtime`` computes the commands.
"""

from __future__ import annotations

import functools
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from apps.gateway import grpc_frontend
from apps.gateway.rules import (
    COUNT_STAGES,
    COUNTS_TABLE,
    PRIORITY_LUA_FILE,
    SHAPES_LUA_FILE,
    Options,
    class_count_rules,
    client_error_rules,
    count_rules,
    json_error,
    priority_level_rules,
    shape_request_rules,
    shape_response_rules,
    token_rules,
)
from backend_ge.files import atomic_write
from backend_ge.naming import TRITON_MODEL_NAME_PATTERN

NEVER_EXPIRES = 32503680000  # 3000-01-01: a token without expiry
MODEL_NAME = TRITON_MODEL_NAME_PATTERN
# The only inference paths a tenant may call. Slugs are [a-z0-9-], so `_`, `.`, `%` and `//` cannot match
# (and a candidate name, `<name>__candidate`, is no model name).
ALLOWED_PATH = rf"^/v2/models/{MODEL_NAME}(/versions/[1-9][0-9]{{0,8}})?(/infer|/ready|/config)?$"
# GET /v2/models: the caller's team's callable models (index.lua, from index.map).
INDEX_PATH = r"^/v2/models/?$"
WAKE_LUA_FILE = Path(__file__).with_name("wake.lua")
INDEX_LUA_FILE = Path(__file__).with_name("index.lua")
RETRY_AFTER_S = 10
SERVER_NAME = re.compile(r"^[A-Za-z0-9_-]{16,128}$")


class GatewayError(RuntimeError):
    """HAProxy refused a configuration, did not start, or its socket did not answer."""


@dataclass(frozen=True, order=True)
class Server:
    """One placement of a deployment as an HAProxy server. ``key`` is the instance's secret: HAProxy sends the
    server name in the instance-key header, so the name is the key (it never leaves the platform)."""

    key: str
    address: str
    port: int
    check_port: int = 0  # health checks go here when set (gRPC servers are checked over HTTP)
    grpc_port: int = 0  # the instance's gRPC port: the server's twin in the slot's gRPC backend

    def grpc_twin(self) -> Server:
        return Server(self.key, self.address, self.grpc_port, check_port=self.port)


@dataclass(frozen=True)
class Route:
    """Where a model's requests go. ``backend`` and ``canary_backend`` are logical names (``d<id>``,
    ``d<id>c``) that :class:`Slots` turns into HAProxy backends. ``version``: the version unversioned requests
    are pinned to (0: not pinned, during a switch). During a live rollout, ``canary_weight`` % of unversioned
    requests (one ``rand()`` draw) and every request naming ``canary_version`` go to ``canary_backend``."""

    team: str
    backend: str
    version: int
    canary_backend: str = ""
    canary_version: int = 0
    canary_weight: int = 0

    def render(self, slots: Slots) -> str:
        # Field 2 is the deployment's key (apps.gateway.metrics counts by it), field 3 the slot.
        canary = slots.slot_of(self.canary_backend) if self.canary_backend else "-"
        weight = self.canary_weight if self.canary_backend else 0
        return "/".join(
            (self.team, deployment_key(self.backend), slots.slot_of(self.backend), str(self.version),
             canary, str(self.canary_version if self.canary_backend else 0), str(weight))
        )  # fmt: skip


def deployment_key(logical: str) -> str:
    """``d12`` for both ``d12`` and its canary backend ``d12c``."""
    return logical.removesuffix("c")


@dataclass
class GatewayState:
    """Everything the gateway routes by, with logical backend names. Only the set of ``grpc_backends`` is
    structure (a change needs a reload); HTTP backends live in pre-declared slots (:class:`Slots`), and every
    server, weight, health-check path and map entry changes at run time."""

    backends: dict[str, tuple[Server, ...]] = field(default_factory=dict)
    grpc_backends: dict[str, tuple[Server, ...]] = field(default_factory=dict)
    # (backend, server key) -> weight; 0 means out of rotation (maintenance).
    weights: dict[tuple[str, str], int] = field(default_factory=dict)
    routes: dict[str, Route] = field(default_factory=dict)  # model -> route
    grpc_routes: dict[str, str] = field(default_factory=dict)  # team -> grpc backend
    # backend -> what its servers' health check asks Triton: ``<model>`` or ``<model>/versions/<n>`` (ready),
    # so an instance that restarted without the model (or lost it) is out of rotation until it has it again.
    checks: dict[str, str] = field(default_factory=dict)
    # "<prefix>:<sha256>" -> "<team>:<expires>:<priority class>"
    tokens: dict[str, str] = field(default_factory=dict)
    limits: dict[str, str] = field(default_factory=dict)  # team -> requests per second
    # (backend, server key) out of rotation only because its placement does not serve (yet) on a READY
    # instance: once it does, its agent has just seen Triton serve the version, so it enters the rotation at
    # once instead of through its health checks (``apps.gateway.runtime``).
    awaiting_placement: set[tuple[str, str]] = field(default_factory=set)
    # model -> deployment key (``d12``) of deployments that may sleep (min_replicas 0): their requests are
    # held by ``wake.lua`` while the deployment's slot has no usable server.
    sleepy: dict[str, str] = field(default_factory=dict)
    # team -> its callable models for GET /v2/models, each "<model>/<versions>/<READY|ASLEEP>" (sorted).
    index: dict[str, list[str]] = field(default_factory=dict)
    # deployment key -> why its wake-up failed (``wake_failure_value``: percent-encoded), for a woken
    # deployment none of whose replicas could load: a held request is answered 503 with it at once.
    wake_failures: dict[str, str] = field(default_factory=dict)
    # "<model>/<version>" -> its dynamic_batching.priority_levels, for each routed version that defines levels:
    # the gateway sets Triton's `priority` request parameter from the caller's class on these (priority.lua).
    priority_levels: dict[str, str] = field(default_factory=dict)

    def structure(self) -> tuple:
        return tuple(sorted(self.grpc_backends))

    def maps(self, slots: Slots) -> dict[str, dict[str, str]]:
        """The map files HAProxy reads (all changeable at run time), with slot names for backends."""
        return {
            "tokens": self.tokens,
            "models": {model: route.render(slots) for model, route in self.routes.items()},
            "limits": self.limits,
            "grpc": self.grpc_routes,
            "checks": {slots.slot_of(name): check for name, check in self.checks.items()},
            "sleepy": self.sleepy,
            "wakefail": self.wake_failures,
            "index": self.index_entries(),
            "priority": self.priority_levels,
        }

    def index_entries(self) -> dict[str, str]:
        """``index`` as map entries: ``<team>`` -> how many, ``<team>.<i>`` -> the i-th model (slugs have no
        dot, so no team's keys meet another's)."""
        out = {}
        for team, models in self.index.items():
            out[team] = str(len(models))
            out.update({f"{team}.{i}": entry for i, entry in enumerate(sorted(models))})
        return out

    def servers(self, slots: Slots) -> dict[str, dict[str, Server]]:
        """HAProxy backend -> {server name: server}, for every backend that has servers: each slot, its gRPC
        twin (the same placements' gRPC ports) and the gRPC backends."""
        out = {}
        for name, servers in self.backends.items():
            slot = slots.slot_of(name)
            out[slot] = {s.key: s for s in servers}
            twins = {s.key: s.grpc_twin() for s in servers if s.grpc_port}
            if twins:
                out[grpc_frontend.twin(slot)] = twins
        out.update({name: {s.key: s for s in servers} for name, servers in self.grpc_backends.items()})
        return out

    def routed(self) -> dict[int, tuple[int, int]]:
        """Deployment id -> (the version its unversioned requests reach, 0 during a switch; its servers in
        rotation): what this state lets clients call (``apps.deployments.routing``)."""
        out = {}
        for route in self.routes.values():
            servers = self.backends.get(route.backend, ())
            in_rotation = sum(1 for s in servers if self.weights.get((route.backend, s.key), 100))
            out[int(deployment_key(route.backend)[1:])] = (route.version, in_rotation)
        return out

    def awaiting_servers(self, slots: Slots) -> set[tuple[str, str]]:
        """``awaiting_placement`` with HAProxy's backend names (the slot and its gRPC twin)."""
        out = set()
        for name, key in self.awaiting_placement:
            slot = slots.slot_of(name)
            out |= {(slot, key), (grpc_frontend.twin(slot), key)}
        return out

    def server_weights(self, slots: Slots) -> dict[tuple[str, str], int]:
        out = {}
        for (name, key), weight in self.weights.items():
            if name in self.grpc_backends:
                out[(name, key)] = weight
            else:
                slot = slots.slot_of(name)
                out[(slot, key)] = out[(grpc_frontend.twin(slot), key)] = weight
        return out


SLOT = re.compile(r"^s(\d+)$")
LOGICAL = re.compile(r"^d\d+c?$")


@dataclass
class Slots:
    """The pool of pre-declared HTTP backends ``s0`` .. ``s<size-1>`` and which logical backend owns each.

    Adding a backend at run time is not possible in HAProxy 2.6 (servers are: ``add server``), so a new
    deployment (or a rollout's canary) takes a free slot at run time; only an exhausted pool grows, by
    ``chunk`` slots, with a reload. The assignment is written to ``slots.map`` and read back on a restart.
    """

    size: int
    owners: dict[str, str] = field(default_factory=dict)  # slot -> logical backend (never changed in place)

    @functools.cached_property
    def _slot(self) -> dict[str, str]:
        # A sync asks for every backend's slot several times (the plan, the maps, the config): a scan of the
        # owners each time made a sync's plan and files O(deployments^2), 27 ms of it at 300 deployments.
        return {owner: slot for slot, owner in self.owners.items()}

    def slot_of(self, logical: str) -> str:
        try:
            return self._slot[logical]
        except KeyError:
            raise KeyError(f"no slot holds {logical}") from None

    def holds(self, logical: str) -> bool:
        return logical in self._slot

    def names(self) -> list[str]:
        return [f"s{i}" for i in range(self.size)]

    def assign(self, logicals: Iterable[str], unavailable: Iterable[str], chunk: int) -> Slots:
        """Keep every owner still wanted; give each new logical backend a free slot (never one in
        ``unavailable``: freed in this sync or still draining), after the highest one in use so a freed slot is
        reused as late as possible; grow by ``chunk`` when none is left."""
        wanted = set(logicals)
        owners = {slot: owner for slot, owner in self.owners.items() if owner in wanted}
        missing = sorted(wanted - set(owners.values()), key=lambda n: (int(n[1:].rstrip("c")), n))
        blocked = set(owners) | set(unavailable)
        size = self.size
        cursor = max((int(slot[1:]) for slot in owners), default=-1)
        for logical in missing:
            free = [i for i in range(size) if f"s{i}" not in blocked]
            if not free:
                free, size = list(range(size, size + chunk)), size + chunk
            index = min(free, key=lambda i: (i <= cursor, i))
            owners[f"s{index}"] = logical
            blocked.add(f"s{index}")
            cursor = index
        return Slots(size, owners)

    def render(self) -> str:
        return "".join(f"{slot} {owner}\n" for slot, owner in sorted(self.owners.items(), key=_slot_order))

    @classmethod
    def read(cls, path: Path, chunk: int) -> Slots:
        """The assignment a previous run wrote (anything unreadable is skipped: slots are only an optimisation
        of names, the database decides what is routed)."""
        owners = {}
        try:
            lines = path.read_text().splitlines()
        except OSError:
            lines = []
        for line in lines:
            parts = line.split()
            if len(parts) == 2 and SLOT.match(parts[0]) and LOGICAL.match(parts[1]):
                owners[parts[0]] = parts[1]
        highest = max((int(slot[1:]) for slot in owners), default=-1)
        return cls(max(chunk, -(-(highest + 1) // chunk) * chunk), owners)


def _slot_order(item: tuple[str, str]) -> int:
    return int(item[0][1:])


def server_options(server: Server, o: Options, weight: int) -> str:
    """Everything after the name on a ``server`` line, and in an ``add server`` command (dynamic servers do
    not inherit ``default-server``): the same server whether it came from the file or the admin socket."""
    if not SERVER_NAME.match(server.key):
        raise GatewayError(f"instance key of {server.address}:{server.port} is not usable as a server name")
    inter = o.check_interval_ms
    # A server that is DOWN or changing state is checked five times as often: a replica that just loaded
    # (added DOWN, see apps.gateway.runtime) serves about 200 ms after it is added rather than 750 ms - a
    # sleeping model's held request waits for it - and one that failed a check is out sooner.
    quick = max(inter // 5, 100)
    options = (
        f"{server.address}:{server.port} weight {weight or 100}"
        f" check inter {inter}ms fastinter {quick}ms downinter {quick}ms rise 2 fall 2"
    )
    if o.server_maxconn:  # beyond it requests queue in the gateway, by priority class
        options += f" maxconn {o.server_maxconn}"
    if server.check_port:  # gRPC: h2 to Triton, checked over its HTTP port
        options += f" proto h2 port {server.check_port} check-proto h1"
    return options


def _server_lines(servers: Iterable[Server], weights: dict[tuple[str, str], int], backend: str, o: Options):
    lines = []
    for server in servers:
        weight = weights.get((backend, server.key), 100)
        disabled = "" if weight else " disabled"
        lines.append(f"    server {server.key} {server_options(server, o, weight)}{disabled}")
    return lines


def render_config(state: GatewayState, slots: Slots, o: Options) -> str:
    inter = o.check_interval_ms
    lines = [
        "# Written by the platform (apps.gateway) from its database; edits are overwritten.",
        "global",
        f"    stats socket {o.admin_socket} mode 600 level admin",
        "    stats timeout 10s",
        f"    nbthread {o.threads}",
        f"    hard-stop-after {o.hard_stop_after_s}s",
        # Requests up to this size stay buffered, so a request an instance dropped unanswered can be retried.
        # HAProxy copies the whole buffer (not only the request) for every request it may retry: 64 kB
        # buffers cost ~10 us of CPU per request more than these (benchmarks/gateway.py).
        f"    tune.bufsize {o.buffer_size}",
        f"    lua-load '{grpc_frontend.LUA_FILE}'",
        # wake.lua signals wake-ups and cold starts in these maps (read and cleared by apps.gateway.wake).
        f"    presetenv TGP_WAKEUPS_MAP {o.map_file('wakeups')}",
        f"    presetenv TGP_COLDSTART_MAP {o.map_file('coldstart')}",
        f"    presetenv TGP_WAKEFAIL_MAP {o.map_file('wakefail')}",
        f"    presetenv TGP_WAKE_SOCKET unix@{o.wake_socket}",
        f"    lua-load '{WAKE_LUA_FILE}'",
        f"    presetenv TGP_INDEX_MAP {o.map_file('index')}",
        f"    lua-load '{INDEX_LUA_FILE}'",
        f"    lua-load '{SHAPES_LUA_FILE}'",
        f"    lua-load '{PRIORITY_LUA_FILE}'",
        # A port another process listens on is an error, not shared: with SO_REUSEPORT (HAProxy's default) a
        # second HAProxy bound to the same port (another gateway, an orphan, a stats port equal to the
        # inference port) silently got a share of the connections, e.g. the stats frontend's empty 404 for an
        # inference request. Reloads are unaffected: the master hands the listening sockets to the new worker.
        "    noreuseport",
        "",
        "defaults",
        "    mode http",
        "    timeout connect 1s",
        "    timeout client 120s",
        "    timeout server 300s",
        "    timeout http-request 15s",
        "    timeout http-keep-alive 60s",
        "    timeout queue 30s",
        f"    timeout check {max(inter, 500)}ms",
        "    retries 3",
        # Server connections stay with their client connection: with a shared pool, an instance killed with
        # requests in flight made HAProxy 2.6 close some clients' keep-alive connections without an answer.
        "    http-reuse never",
        "    option redispatch 1",
        # Refused connections, connections closed without an answer, and an instance that does not have the
        # model (yet: restarted, reloading) go to another placement; none of them ran the request.
        "    retry-on conn-failure empty-response junk-response 404 503",
        "    http-error status 503 content-type application/json string "
        """'{"error":"no instance of this model is ready and reachable from the gateway; retry shortly"}'""",
        "    http-error status 504 content-type application/json string "
        """'{"error":"the model did not answer in time"}'""",
        "    http-error status 502 content-type application/json string "
        """'{"error":"the model instance failed to answer"}'""",
        "",
        "frontend stats",
        f"    bind {o.stats_bind}",
        # Server names are instance keys: the exporter shows frontends and backends only.
        "    http-request set-query scope=global&scope=frontend&scope=backend",
        "    http-request use-service prometheus-exporter if { path /metrics }",
        "    http-request return status 404",
        "",
        "backend team_rates",
        "    stick-table type string len 64 size 100k expire 10s store gpc0_rate(1s)",
        "",
        f"backend {COUNTS_TABLE}",
        f"    stick-table type string len 64 size 100k store gpc({COUNT_STAGES})",
        "",
        "backend no_route",
        json_error(404, "unknown model"),
        "",
        "frontend inference",
        f"    bind {o.bind}",
        # A retry needs the whole request in the buffer: without this, a POST whose body came in a second
        # packet was forwarded before it was complete and its 503 (model still loading) reached the client.
        # (Not on the gRPC frontend: a stream's body does not end.)
        "    option http-buffer-request",
        f"    http-request del-header {o.key_header}",
        "    acl health path /v2/health/live /v2/health/ready",
        "    http-request return status 200 if health METH_GET",
        "    http-request return status 200 content-type application/json string "
        """'{"name":"triton","version":"2.51.0","extensions":["classification","model_configuration","binary_tensor_data","parameters"]}' """
        "if { path /v2 } METH_GET",
        f"    http-request track-sc2 str(all) table {COUNTS_TABLE}",
        *count_rules(0, 2),
        f"    acl allowed_path path -m reg '{ALLOWED_PATH}'",
        f"    acl index_path path -m reg '{INDEX_PATH}'",
        "    acl infer_path path -m end /infer",
        json_error(404, "not found") + " if !allowed_path !index_path",
        json_error(404, "not found") + " if infer_path !METH_POST",
        json_error(404, "not found") + " if !infer_path !METH_GET",
        *shape_request_rules(),
        *shape_response_rules(before_counts=True),
        *client_error_rules("infer_path"),  # Triton's parse failures: 500 -> 400
        *shape_response_rules(before_counts=False),
        # One lookup gives the whole route (Route.render):
        # <team>/<deployment>/<slot>/<version>/<canary slot>/<canary version>/<canary weight>
        "    http-request set-var(txn.model) path,field(4,/)",
        f"    http-request set-var(txn.route) var(txn.model),map({o.map_file('models')})",
        f"    http-request track-sc1 var(txn.route),field(2,/) table {COUNTS_TABLE}",
        *count_rules(1, 1, 2),
        *token_rules(
            o,
            json_error(
                401,
                "missing, invalid or revoked API token: send the header Authorization: Bearer tgp_<prefix>_<secret>",
                'hdr www-authenticate "Bearer realm=inference" ',
            ),
            json_error(
                401,
                "the API token has expired; create a new one",
                'hdr www-authenticate "Bearer realm=inference" ',
            ),
        ),
        *count_rules(2, 1, 2),
        "    http-request track-sc0 var(txn.team) table team_rates",
        f"    http-request set-var(txn.limit) var(txn.team),map({o.map_file('limits')},{o.default_limit})",
        # Only admitted requests count (gpc0), so a client above its limit still gets the limit through.
        "    acl over_limit sc_gpc0_rate(0),sub(txn.limit) ge 0",
        "    http-request return status 429 content-type application/json hdr retry-after 1 lf-string "
        """'{"error":"rate limit exceeded: team %[var(txn.team)] may send %[var(txn.limit)] requests per second"}' if over_limit""",
        "    http-request sc-inc-gpc0(0)",
        *count_rules(3, 1, 2),
        # The team's model list (a token and the rate limit checked, like any request of the team's); it
        # passed every refusal stage, so it counts as answered, not as a refusal.
        "    http-request sc-inc-gpc(4,2) if index_path",
        "    http-request use-service lua.models_index if index_path",
        "    acl own_model var(txn.route),field(1,/),strcmp(txn.team) eq 0",
        "    http-request return status 404 content-type application/json lf-string "
        """"{\\"error\\":\\"Request for unknown model: '%[var(txn.model)]' is not found\\"}" if !own_model""",
        *count_rules(4, 1, 2),
        *class_count_rules(1, 2),
        "    http-response sc-inc-gpc(5,1) if { status 404 }",
        "    http-response sc-inc-gpc(5,2) if { status 404 }",
        # The allow-list leaves "/versions/" only where a version is named.
        "    acl explicit_version path -m sub /versions/",
        "    http-request set-var(txn.backend) var(txn.route),field(3,/)",
        "    http-request set-var(txn.version) var(txn.route),field(4,/)",
        # Canary split, only for a route with a canary slot. Unversioned: to the canary with probability
        # weight/100 (rand(100) is 0..99, so 0 and 100 are exact; drawn once, in one rule); naming the canary
        # version: to the canary's slot, whose servers are the placements serving it.
        "    acl no_canary var(txn.route),field(5,/) -m str -- -",
        "    http-request set-var(txn.cweight) var(txn.route),field(7,/) if !no_canary !explicit_version",
        "    http-request set-var(txn.canary) int(1) if !no_canary !explicit_version { rand(100),sub(txn.cweight) lt 0 }",
        "    http-request set-var(txn.cversion) var(txn.route),field(6,/) if !no_canary explicit_version",
        "    http-request set-var(txn.canary) int(1) if !no_canary explicit_version { path,field(6,/),strcmp(txn.cversion) eq 0 }",
        "    acl canary var(txn.canary) -m found",
        "    http-request set-var(txn.backend) var(txn.route),field(5,/) if canary",
        "    http-request set-var(txn.version) var(txn.route),field(6,/) if canary",
        "    acl pinned var(txn.version) -m int gt 0",
        "    http-request set-var(txn.tail) path,regsub('^/v2/models/[^/]+','') if pinned !explicit_version",
        "    http-request set-uri /v2/models/%[var(txn.model)]/versions/%[var(txn.version)]%[var(txn.tail)] if pinned !explicit_version",
        "    http-request set-uri %[path] if !pinned or explicit_version",
        *priority_level_rules(o),
        # Scale to zero: a sleeping model's request waits here until a replica serves (wake.lua).
        f"    http-request set-var(txn.sleepy) var(txn.model),map({o.map_file('sleepy')})",
        f"    http-request lua.hold_asleep {o.activation_timeout_s * 1000} if {{ var(txn.sleepy) -m found }}",
        # A replica could not load (a broken version, no room): at once, with the reason (wake.lua).
        f"    http-request return status 503 content-type application/json hdr retry-after {RETRY_AFTER_S} lf-string "
        f"""\"{{\\\"error\\\":\\\"model '%[var(txn.model)]' is scaled to zero and could not be woken: """
        f"""%[var(txn.wake_reason)]\\\"}}\" if {{ var(txn.wake_reason) -m found }}""",
        f"    http-request return status 503 content-type application/json hdr retry-after {RETRY_AFTER_S} lf-string "
        f"""\"{{\\\"error\\\":\\\"model '%[var(txn.model)]' is scaled to zero and no replica became ready within """
        f"""the activation timeout ({o.activation_timeout_s} s); retry later\\\"}}\" if {{ var(txn.wake_failed) -m found }}""",
        # A compressed request body would hide its tensor shapes from tensor_shapes (HAProxy cannot inflate a
        # request), and Triton inflates it before it sizes them: refused. Responses may still be compressed.
        json_error(
            415,
            "compressed request bodies are not accepted: the gateway checks tensor shapes before a model "
            "reads them; send the request uncompressed (answers may still be compressed: Accept-Encoding)",
        )
        + " if infer_path { req.hdr(content-encoding) -m found } !{ req.hdr(content-encoding) -i identity }",
        "    http-request del-header authorization",
        "    use_backend %[var(txn.backend)]",
        "    default_backend no_route",
        "",
        *grpc_frontend.frontend_lines(o),
    ]
    for check in state.checks.values():
        if not re.fullmatch(rf"{MODEL_NAME}(/versions/[1-9][0-9]{{0,8}})?", check):
            raise GatewayError(f"{check!r} is not a platform model name (and version)")
    servers, weights = state.servers(slots), state.server_weights(slots)
    checks = o.map_file("checks")
    for name in slots.names():
        lines += [
            f"backend {name}",
            "    balance leastconn",
            # The slot's servers are checked with the readiness of the model (version) it serves now:
            # the path comes from checks.map, which changes at run time with the slot's owner.
            "    option httpchk",
            f"    http-check send meth GET uri-lf /v2/models/%[str({name}),map({checks},-)]/ready",
            "    http-check expect status 200",
            f"    http-send-name-header {o.key_header}",
            *_server_lines(sorted(servers.get(name, {}).values()), weights, name, o),
            "",
        ]
        twin = grpc_frontend.twin(name)
        twin_servers = _server_lines(sorted(servers.get(twin, {}).values()), weights, twin, o)
        lines += grpc_frontend.backend_lines(name, o, checks, twin_servers)
    # Dedicated teams' instances (streams) and every instance (server-level calls): checked for readiness.
    for name in sorted({*state.grpc_backends, grpc_frontend.ANY_INSTANCE}):
        lines += [
            f"backend {name}",
            "    balance leastconn",
            f"    http-send-name-header {o.grpc_key_header}",
            "    option httpchk GET /v2/health/ready",
            "    http-check expect status 200",
            *_server_lines(sorted(servers.get(name, {}).values()), weights, name, o),
            "",
        ]
    return "\n".join(lines) + "\n"


def render_map(entries: dict[str, str]) -> str:
    return "".join(f"{key} {value}\n" for key, value in sorted(entries.items()))


def write_files(state: GatewayState, slots: Slots, o: Options) -> None:
    """Maps first, then the configuration: a restart at any moment comes back with a consistent state."""
    o.make_directory()
    for name, entries in state.maps(slots).items():
        atomic_write(o.map_file(name), render_map(entries))
    atomic_write(o.map_file("slots"), slots.render())
    for name in ("wakeups", "coldstart"):  # written by wake.lua at run time; HAProxy loads them at start
        if not o.map_file(name).exists():
            atomic_write(o.map_file(name), "")
    atomic_write(o.config_file, render_config(state, slots, o))


class AdminSocket:
    """HAProxy's runtime API over its unix socket, one connection per batch of commands."""

    def __init__(self, path: Path, timeout: float = 5.0) -> None:
        self.path, self.timeout = path, timeout

    def run(self, commands: list[str]) -> list[str]:
        if not commands:
            return []
        payload = "; ".join(commands)
        if "\n" in payload:
            raise GatewayError("a runtime command may not contain a newline")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(self.timeout)
            sock.connect(str(self.path))
            sock.sendall(payload.encode() + b"\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        text = b"".join(chunks).decode(errors="replace")
        # Each command's answer ends with an empty line.
        return text.split("\n\n")

    def ask(self, command: str) -> str:
        return self.run([command])[0]

    def each(self, commands: list[str]) -> list[str]:
        """One answer per command, in order (one connection each: an empty answer is not always a line)."""
        return [self.ask(command).strip() for command in commands]

    def worker_pid(self) -> int | None:
        try:
            info = self.ask("show info")
        except OSError:
            return None
        match = re.search(r"^Pid: (\d+)$", info, re.M)
        return int(match.group(1)) if match else None
