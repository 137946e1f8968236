"""HAProxy as the inference gateway: the configuration and map files it runs from, and its admin socket.

No Django here: ``apps.gateway.state`` turns the database into a :class:`GatewayState`, this module turns a
state into files and runtime commands. Everything a tenant sends is checked in HAProxy itself, in this order:

1. ``/v2/health/live|ready`` (and ``/v2`` server metadata) are answered by the gateway.
2. The path must match the allow-list (``ALLOWED_PATH``) with the right method, else 404. Path tricks
   (``..``, ``//``, percent-encoding, other APIs) cannot match it.
3. ``Authorization: Bearer tgp_<prefix>_<secret>``: the secret is hashed (``sha2(256)``) and
   ``<prefix>:<sha256>`` looked up in ``tokens.map`` (value ``<team>:<expires epoch>``). Missing, wrong,
   revoked (not in the map) or expired: 401.
4. The team's request rate (stick table, ``http_req_rate(1s)``) against ``limits.map``: 429.
5. ``models.map`` gives ``<team>/<backend>/<version>`` for a served model; another team's model is the same 404
   as an unknown one. Unversioned requests are pinned to ``<version>`` (0: not pinned, during a switch).
6. The request goes to the deployment's backend (least connections over its healthy placements) with the
   client's ``Authorization`` removed and the instance key added (the server's name *is* the key, sent by
   ``http-send-name-header``, so a redispatch to another instance carries that instance's key).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from backend_ge.files import atomic_write

NEVER_EXPIRES = 32503680000  # 3000-01-01: a token without expiry
MODEL_NAME = r"[a-z0-9](?:[a-z0-9-]*[a-z0-9])?__[a-z0-9](?:[a-z0-9-]*[a-z0-9])?"
# The only inference paths a tenant may call. Slugs are [a-z0-9-], so `_`, `.`, `%` and `//` cannot match.
ALLOWED_PATH = rf"^/v2/models/{MODEL_NAME}(/versions/[1-9][0-9]{{0,8}})?(/infer|/ready|/config)?$"
GRPC_METHODS = (
    "ServerLive",
    "ServerReady",
    "ModelReady",
    "ServerMetadata",
    "ModelMetadata",
    "ModelConfig",
    "ModelInfer",
    "ModelStreamInfer",
)
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


@dataclass
class GatewayState:
    """Everything the gateway routes by. ``backends`` and ``grpc_backends`` are the structure (a change needs a
    reload); the rest changes at run time."""

    backends: dict[str, tuple[Server, ...]] = field(default_factory=dict)
    grpc_backends: dict[str, tuple[Server, ...]] = field(default_factory=dict)
    # (backend, server key) -> weight; 0 means out of rotation (maintenance).
    weights: dict[tuple[str, str], int] = field(default_factory=dict)
    routes: dict[str, str] = field(default_factory=dict)  # model -> "<team>/<backend>/<version>"
    grpc_routes: dict[str, str] = field(default_factory=dict)  # team -> grpc backend
    # backend -> the model it serves: its servers are checked with that model's readiness, so an instance
    # that restarted without the model (or lost it) is out of rotation until the agent loaded it again.
    checked_models: dict[str, str] = field(default_factory=dict)
    tokens: dict[str, str] = field(default_factory=dict)  # "<prefix>:<sha256>" -> "<team>:<expires>"
    limits: dict[str, str] = field(default_factory=dict)  # team -> requests per second

    def structure(self) -> tuple:
        return (
            sorted(self.backends.items()),
            sorted(self.grpc_backends.items()),
            sorted(self.checked_models.items()),
        )

    def maps(self) -> dict[str, dict[str, str]]:
        return {
            "tokens": self.tokens,
            "models": self.routes,
            "limits": self.limits,
            "grpc": self.grpc_routes,
        }


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

    @property
    def admin_socket(self) -> Path:
        return self.directory / "admin.sock"

    @property
    def config_file(self) -> Path:
        return self.directory / "haproxy.cfg"

    def map_file(self, name: str) -> Path:
        return self.directory / f"{name}.map"


def _json_error(status: int, message: str, extra: str = "") -> str:
    body = json.dumps({"error": message})
    if "'" in body:
        raise ValueError("error bodies are written in single quotes")
    return f"http-request return status {status} content-type application/json {extra}string '{body}'"


def _grpc_error(code: int, message: str) -> str:
    if '"' in message:
        raise ValueError("gRPC messages are written in double quotes")
    return f'http-request return status 200 hdr grpc-status {code} hdr grpc-message "{message}"'


def _server_lines(
    servers: Iterable[Server], weights: dict[tuple[str, str], int], backend: str, extra: str
) -> list[str]:
    lines = []
    for server in servers:
        if not SERVER_NAME.match(server.key):
            raise GatewayError(
                f"instance key of {server.address}:{server.port} is not usable as a server name"
            )
        weight = weights.get((backend, server.key), 100)
        state = f" weight {weight}" if weight else " weight 100 disabled"
        port = f" port {server.check_port} check-proto h1" if server.check_port else ""
        lines.append(f"    server {server.key} {server.address}:{server.port}{state}{extra}{port}")
    return lines


def _token_rules(o: Options, deny_unauthenticated: str, deny_expired: str) -> list[str]:
    """Hash the token's secret and look ``<prefix>:<sha256>`` up; both fetched from the same header line."""
    tokens = o.map_file("tokens")
    return [
        # A converter argument cannot hold parentheses, so no capture group: the prefix is the 2nd "_" field.
        "    http-request set-var(txn.prefix) req.fhdr(authorization),field(2,_)",
        "    http-request set-var(txn.hash) req.fhdr(authorization),regsub('^[Bb]earer +tgp_[0-9a-f]+_',''),sha2(256),hex,lower",
        "    http-request set-var(txn.tokkey) var(txn.prefix),concat(:,txn.hash,)",
        f"    http-request set-var(txn.tokval) var(txn.tokkey),map({tokens})",
        "    http-request set-var(txn.team) var(txn.tokval),field(1,:)",
        "    http-request set-var(txn.expires) var(txn.tokval),field(2,:)",
        "    http-request set-var(txn.now) date()",
        "    acl token_known var(txn.team) -m found",
        "    acl token_expired var(txn.expires),sub(txn.now) lt 1",
        f"    {deny_unauthenticated} if !token_known",
        f"    {deny_expired} if token_expired",
    ]


# --- Refusal counts (apps.gateway.metrics reads them with `show table gateway_counts`). -----------------------
# HAProxy 2.6 counts responses only by class, and `http-after-response` cannot increment counters, so each
# request increments the stage it has passed: a refusal is the difference between two stages (401 = stage 1 -
# stage 2, 429 = 2 - 3, the gateway's 404 = (0 - 1) + (3 - 4)); stage 5 counts 404s answered by an instance.
# Key "all": every request (sticky counter 2); key "d<id>": requests naming a served model (sticky counter 1).
COUNTS_TABLE = "gateway_counts"
COUNT_STAGES = 6


def _count(stage: int, *counters: int) -> list[str]:
    return [f"    http-request sc-inc-gpc({stage},{sc})" for sc in counters]


def render_config(state: GatewayState, o: Options) -> str:
    inter = o.check_interval_ms
    lines = [
        "# Written by the platform (apps.gateway) from its database; edits are overwritten.",
        "global",
        f"    stats socket {o.admin_socket} mode 600 level admin",
        "    stats timeout 10s",
        f"    nbthread {o.threads}",
        f"    hard-stop-after {o.hard_stop_after_s}s",
        # Requests up to this size stay buffered, so a request an instance dropped unanswered can be retried.
        "    tune.bufsize 65536",
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
        """'{"error":"no instance of this model is ready; retry shortly"}'""",
        "    http-error status 504 content-type application/json string "
        """'{"error":"the model did not answer in time"}'""",
        "    http-error status 502 content-type application/json string "
        """'{"error":"the model instance failed to answer"}'""",
        "",
        "frontend stats",
        f"    bind {o.stats_bind}",
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
        _json_error(404, "unknown model"),
        "",
        "frontend inference",
        f"    bind {o.bind}",
        f"    http-request del-header {o.key_header}",
        "    acl health path /v2/health/live /v2/health/ready",
        "    http-request return status 200 if health METH_GET",
        "    http-request return status 200 content-type application/json string "
        """'{"name":"triton","version":"2.51.0","extensions":["classification","model_configuration","binary_tensor_data","parameters"]}' """
        "if { path /v2 } METH_GET",
        f"    http-request track-sc2 str(all) table {COUNTS_TABLE}",
        *_count(0, 2),
        f"    acl allowed_path path -m reg '{ALLOWED_PATH}'",
        "    acl infer_path path -m end /infer",
        _json_error(404, "not found") + " if !allowed_path",
        _json_error(404, "not found") + " if infer_path !METH_POST",
        _json_error(404, "not found") + " if !infer_path !METH_GET",
        f"    http-request set-var(txn.counted) path,field(4,/),map({o.map_file('models')}),field(2,/)",
        f"    http-request track-sc1 var(txn.counted) table {COUNTS_TABLE}",
        *_count(1, 1, 2),
        *_token_rules(
            o,
            _json_error(
                401,
                "missing, invalid or revoked API token: send the header Authorization: Bearer tgp_<prefix>_<secret>",
                'hdr www-authenticate "Bearer realm=inference" ',
            ),
            _json_error(
                401,
                "the API token has expired; create a new one",
                'hdr www-authenticate "Bearer realm=inference" ',
            ),
        ),
        *_count(2, 1, 2),
        "    http-request track-sc0 var(txn.team) table team_rates",
        f"    http-request set-var(txn.limit) var(txn.team),map({o.map_file('limits')},{o.default_limit})",
        # Only admitted requests count (gpc0), so a client above its limit still gets the limit through.
        "    acl over_limit sc_gpc0_rate(0),sub(txn.limit) ge 0",
        "    http-request return status 429 content-type application/json hdr retry-after 1 lf-string "
        """'{"error":"rate limit exceeded: team %[var(txn.team)] may send %[var(txn.limit)] requests per second"}' if over_limit""",
        "    http-request sc-inc-gpc0(0)",
        *_count(3, 1, 2),
        "    http-request set-var(txn.model) path,field(4,/)",
        f"    http-request set-var(txn.route) var(txn.model),map({o.map_file('models')})",
        "    http-request set-var(txn.rteam) var(txn.route),field(1,/)",
        "    http-request set-var(txn.backend) var(txn.route),field(2,/)",
        "    http-request set-var(txn.version) var(txn.route),field(3,/)",
        "    acl own_model var(txn.rteam),strcmp(txn.team) eq 0",
        "    http-request return status 404 content-type application/json lf-string "
        """"{\\"error\\":\\"Request for unknown model: '%[var(txn.model)]' is not found\\"}" if !own_model""",
        *_count(4, 1, 2),
        "    http-response sc-inc-gpc(5,1) if { status 404 }",
        "    http-response sc-inc-gpc(5,2) if { status 404 }",
        "    acl explicit_version path_reg ^/v2/models/[^/]+/versions/",
        "    acl pinned var(txn.version) -m int gt 0",
        "    http-request set-var(txn.tail) path,regsub('^/v2/models/[^/]+','')",
        "    http-request set-uri /v2/models/%[var(txn.model)]/versions/%[var(txn.version)]%[var(txn.tail)] if pinned !explicit_version",
        "    http-request set-uri %[path] if !pinned or explicit_version",
        "    http-request del-header authorization",
        "    use_backend %[var(txn.backend)]",
        "    default_backend no_route",
        "",
        "frontend grpc",
        f"    bind {o.grpc_bind} proto h2",
        f"    http-request del-header {o.grpc_key_header}",
        f"    http-request track-sc2 str(all) table {COUNTS_TABLE}",
        *_count(0, 2),
        f"    acl grpc_method path -m reg '^/inference\\.GRPCInferenceService/({'|'.join(GRPC_METHODS)})$'",
        _grpc_error(12, "this gRPC method is not offered by the gateway") + " if !grpc_method",
        *_count(1, 2),
        *_token_rules(
            o,
            _grpc_error(
                16, "missing, invalid or revoked API token: send metadata authorization: Bearer tgp_..."
            ),
            _grpc_error(16, "the API token has expired; create a new one"),
        ),
        *_count(2, 2),
        "    http-request track-sc0 var(txn.team) table team_rates",
        f"    http-request set-var(txn.limit) var(txn.team),map({o.map_file('limits')},{o.default_limit})",
        "    acl over_limit sc_gpc0_rate(0),sub(txn.limit) ge 0",
        _grpc_error(8, "rate limit exceeded for the team") + " if over_limit",
        "    http-request sc-inc-gpc0(0)",
        *_count(3, 2),
        f"    http-request set-var(txn.backend) var(txn.team),map({o.map_file('grpc')})",
        _grpc_error(
            7,
            "gRPC through the gateway reaches only instances dedicated to your team and your team has none; use HTTP/REST",
        )
        + " unless { var(txn.backend) -m found }",
        *_count(4, 2),
        "    http-request del-header authorization",
        "    use_backend %[var(txn.backend)]",
        "",
    ]
    check = f" check inter {inter}ms fastinter {max(inter // 2, 100)}ms downinter {inter}ms rise 2 fall 2"
    for model in state.checked_models.values():
        if not re.fullmatch(MODEL_NAME, model):
            raise GatewayError(f"{model!r} is not a platform model name")
    for name, servers in sorted(state.backends.items()):
        lines += [
            f"backend {name}",
            "    balance leastconn",
            f"    option httpchk GET /v2/models/{state.checked_models[name]}/ready"
            if name in state.checked_models
            else "    option httpchk GET /v2/health/ready",
            "    http-check expect status 200",
            f"    http-send-name-header {o.key_header}",
            *_server_lines(servers, state.weights, name, check),
            "",
        ]
    for name, servers in sorted(state.grpc_backends.items()):
        lines += [
            f"backend {name}",
            "    balance leastconn",
            f"    http-send-name-header {o.grpc_key_header}",
            "    option httpchk GET /v2/health/ready",
            "    http-check expect status 200",
            *_server_lines(servers, state.weights, name, " proto h2" + check),
            "",
        ]
    return "\n".join(lines) + "\n"


def render_map(entries: dict[str, str]) -> str:
    return "".join(f"{key} {value}\n" for key, value in sorted(entries.items()))


def write_files(state: GatewayState, o: Options) -> None:
    """Maps first, then the configuration: a restart at any moment comes back with a consistent state."""
    o.directory.mkdir(parents=True, exist_ok=True)
    for name, entries in state.maps().items():
        atomic_write(o.map_file(name), render_map(entries))
    atomic_write(o.config_file, render_config(state, o))


def runtime_commands(old: GatewayState, new: GatewayState, o: Options) -> list[str]:
    """Admin-socket commands that turn the running ``old`` into ``new`` (same structure)."""
    commands = []
    for name, entries in new.maps().items():
        before, path = old.maps()[name], o.map_file(name)
        for key in sorted(before.keys() - entries.keys()):
            commands.append(f"del map {path} {key}")
        for key, value in sorted(entries.items()):
            if key not in before:
                commands.append(f"add map {path} {key} {value}")
            elif before[key] != value:
                commands.append(f"set map {path} {key} {value}")
    for (backend, key), weight in sorted(new.weights.items()):
        if old.weights.get((backend, key), 100) == weight:
            continue
        if weight:
            commands.append(f"set server {backend}/{key} weight {weight}")
            commands.append(f"set server {backend}/{key} state ready")
        else:
            commands.append(f"set server {backend}/{key} state maint")
    return commands


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

    def worker_pid(self) -> int | None:
        try:
            info = self.ask("show info")
        except OSError:
            return None
        match = re.search(r"^Pid: (\d+)$", info, re.M)
        return int(match.group(1)) if match else None


class HAProxyProcess:
    """HAProxy in master-worker mode (``-W``) as a child of the gateway command.

    ``reload()`` sends SIGUSR2 to the master: it re-reads the files and starts new workers while the old ones
    finish their requests (listening sockets are passed on, no connection is refused).
    """

    def __init__(self, o: Options, binary: str = "haproxy") -> None:
        self.o, self.binary = o, binary
        self.process: subprocess.Popen | None = None
        self.admin = AdminSocket(o.admin_socket)

    def check_config(self) -> None:
        result = subprocess.run(
            [self.binary, "-c", "-q", "-f", str(self.o.config_file)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if result.returncode != 0:
            raise GatewayError(f"haproxy refused the configuration: {result.stdout}{result.stderr}".strip())

    def start(self, timeout: float = 10.0) -> None:
        self.check_config()
        self._stop_orphan()
        log = open(self.o.directory / "haproxy.log", "ab")  # noqa: SIM115 - the child writes to it
        try:
            self.process = subprocess.Popen(
                [
                    self.binary,
                    "-W",
                    "-db",
                    "-f",
                    str(self.o.config_file),
                    "-p",
                    str(self.o.directory / "haproxy.pid"),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # A gateway command killed outright stops its HAProxy gracefully instead of leaving it running.
                preexec_fn=_soft_stop_when_parent_dies,
            )
        finally:
            log.close()
        self._wait_for_worker(None, timeout)

    def _stop_orphan(self, timeout: float = 30.0) -> None:
        """An HAProxy left running from this directory (its gateway command was killed) would share the ports
        with the new one (SO_REUSEPORT) and keep routing from stale files: stop it first."""
        try:
            pid = int((self.o.directory / "haproxy.pid").read_text().split()[0])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            return
        if str(self.o.config_file).encode() not in cmdline:
            return  # the pid was reused by something else
        os.kill(pid, signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if pid_alive(pid):
            os.kill(pid, signal.SIGTERM)

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def reload(self, timeout: float = 10.0) -> None:
        self.check_config()
        if not self.running():
            raise GatewayError("haproxy is not running")
        old = self.admin.worker_pid()
        self.process.send_signal(signal.SIGUSR2)
        self._wait_for_worker(old, timeout)

    def _wait_for_worker(self, old_pid: int | None, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running():
                raise GatewayError(f"haproxy exited with code {self.process.returncode}: {self.log_tail()}")
            pid = self.admin.worker_pid()
            if pid is not None and pid != old_pid:
                return
            time.sleep(0.05)
        raise GatewayError(f"haproxy's new worker did not answer within {timeout:.0f}s: {self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> None:
        """Graceful: SIGUSR1 lets in-flight requests finish; SIGTERM after ``timeout``."""
        if not self.running():
            return
        self.process.send_signal(signal.SIGUSR1)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.terminate()
            self.process.wait(10)

    def worker_pids(self) -> list[int]:
        pid = self.admin.worker_pid()
        return [pid] if pid else []

    def log_tail(self, lines: int = 20) -> str:
        path = self.o.directory / "haproxy.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


def _soft_stop_when_parent_dies() -> None:
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGUSR1)


def pid_alive(pid: int) -> bool:
    """Running (an exited process its parent has not reaped yet counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
