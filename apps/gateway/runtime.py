"""The admin-socket commands that turn a running HAProxy from one :class:`GatewayState` into another.

No Django here. Order matters, so that no request meets a half-applied change:

1. health-check paths (``checks.map``) change, so a server added next is checked with the right path;
2. servers that appear are added (``add server``, which creates them in maintenance), given their health
   check and put in rotation; servers whose weight changed are updated; then routes, tokens and limits
   change (a route never names a slot whose servers are not there yet);
3. servers that disappear are put in maintenance (in-flight requests finish) and are never deleted: while one
   still has a request in flight (``show stat``'s current or queued sessions) it is *draining* and the next
   sync looks again; then it is *parked*. A draining or parked server that is wanted again is put back in
   rotation instead of added.

Why never deleted: HAProxy 2.6 keeps a keep-alive client's server connection with the client's session
(``http-reuse never``) and reuses it for the client's next request to "the same server", compared by the
server's address in memory - which ``del server`` hands on to the next server added (another deployment,
another instance). That request then went over the old connection to the old instance with the new
instance's key: Triton's 403 (3 requests in 3,000 of the density benchmark, seen in a capture; reproduced by
``tests/gateway/test_runtime.py``). A parked server keeps its memory; parked servers are few (slots times
instances) and a reload, which starts a new worker, forgets them (the sync reloads past
``MAX_PARKED_SERVERS``).

A server that was out of rotation only because its placement did not serve yet (loading on a READY instance:
``GatewayState.awaiting_placement``) enters the rotation at once when its agent reports the version served -
Triton's readiness seen moments ago, as for a server added. Before, it went through the health checks below
like any other, and a deployment reported SERVING answered 503 for another 0.06-0.6 s.

A server that comes back from maintenance for any other reason (its instance restarted, a draining server
wanted again) enters the rotation only through its health check: HAProxy itself counts a server leaving maintenance as UP at once
(its check health set to ``rise``, "start OK but check immediately"), and a restarted instance is READY to the
platform as soon as Triton answers, before its agent has loaded the model again - gRPC calls that met it then
were answered "version N is not at ready state", which HAProxy cannot retry. So it leaves maintenance through
``drain`` (no new request), is set ``health down`` and only then ``ready``: it is DOWN until its model's
readiness check passed ``rise`` times. A server *added* stays as HAProxy adds it: the platform adds one only
for a placement its agent reported serving the version (Triton's readiness, moments ago), and its first
check follows at once. A *parked* server wanted again is in that case too, and is put back as if added.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from apps.gateway.haproxy import GatewayState, Options, Server, Slots, server_options


@dataclass
class Command:
    """One admin-socket command and what to do with its answer."""

    text: str
    ok: tuple[str, ...] = ("",)  # answers that mean success (an answer starting with one of these)
    # (backend, servers): servers out of rotation whose requests in flight this `show stat` counts
    leaving: tuple[str, tuple[str, ...]] | None = None

    def succeeded(self, answer: str) -> bool:
        return any(answer.startswith(prefix) if prefix else answer == "" for prefix in self.ok)


@dataclass
class Plan:
    commands: list[Command] = field(default_factory=list)

    def add(self, text: str, *ok: str, leaving: tuple[str, tuple[str, ...]] | None = None) -> None:
        self.commands.append(Command(text, ok or ("",), leaving))


def _map_commands(
    plan: Plan, before: dict[str, dict[str, str]], after: dict[str, dict[str, str]], o: Options, names: tuple
) -> None:
    for name in names:
        old, new, path = before.get(name, {}), after[name], o.map_file(name)
        for key, value in sorted(new.items()):
            if key not in old:
                plan.add(f"add map {path} {key} {value}")
            elif old[key] != value:
                plan.add(f"set map {path} {key} {value}")
        for key in sorted(old.keys() - new.keys()):
            plan.add(f"del map {path} {key}")


def _set_weight(plan: Plan, backend: str, key: str, weight: int, unchecked: bool) -> None:
    """``unchecked``: the server is in maintenance (or now at another address), so HAProxy's health for it
    says nothing about the model: it returns DOWN and is UP only once its checks pass."""
    if not weight:
        plan.add(f"set server {backend}/{key} state maint")
        return
    plan.add(f"set server {backend}/{key} weight {weight}")
    if unchecked:
        # Out of maintenance without taking a request (drain), DOWN until its checks pass (see above).
        plan.add(f"set server {backend}/{key} state drain")
        plan.add(f"set server {backend}/{key} health down")
    plan.add(f"set server {backend}/{key} state ready")


def runtime_plan(
    old: GatewayState,
    old_slots: Slots,
    new: GatewayState,
    new_slots: Slots,
    o: Options,
    draining: set[tuple[str, str]],
    parked: set[tuple[str, str]] = frozenset(),
) -> Plan:
    """Commands from ``old`` to ``new`` (same structure and slot pool size). ``draining`` and ``parked``:
    servers still in HAProxy, in maintenance, that left in an earlier sync, with requests in flight at the
    last look and without."""
    plan = Plan()
    old_maps, new_maps = old.maps(old_slots), new.maps(new_slots)
    # Health-check paths first: a server added next is checked with its slot's path from its first check.
    _map_commands(plan, old_maps, new_maps, o, ("checks",))
    # A failed wake-up before the servers: a held request must see it no later than the failed replica's
    # server, which is in rotation until its health check fails (wake.lua looks at the failure first).
    _map_commands(plan, old_maps, new_maps, o, ("wakefail",))
    before, after = old.servers(old_slots), new.servers(new_slots)
    old_weights, new_weights = old.server_weights(old_slots), new.server_weights(new_slots)
    awaited = old.awaiting_servers(old_slots)
    for backend, servers in sorted(after.items()):
        for key, server in sorted(servers.items()):
            weight = new_weights.get((backend, key), 100)
            was: Server | None = before.get(backend, {}).get(key)
            if was is None and (backend, key) in parked:
                # Back as if added: out of rotation since its placement left, in again for a placement its
                # agent reported serving moments ago (possibly another deployment's, at another address).
                _set_address(plan, backend, key, server)
                plan.add(f"set server {backend}/{key} weight {weight}")
                if weight:
                    plan.add(f"set server {backend}/{key} state ready")
                continue
            if was is None and (backend, key) not in draining:
                plan.add(
                    f"add server {backend}/{key} {server_options(server, o, weight)}", "New server registered"
                )
                plan.add(f"enable health {backend}/{key}")
                if weight:
                    plan.add(f"set server {backend}/{key} state ready")
                continue
            moved = was is None or (was.address, was.port) != (server.address, server.port)
            if moved:
                _set_address(plan, backend, key, server)
            old_weight = 0 if was is None else old_weights.get((backend, key), 100)
            if moved or old_weight != weight:
                # Out of rotation because its instance was not READY (restarted, lost): checked first. Out
                # only because its placement did not serve yet: its agent just saw Triton serve it - at once.
                unchecked = moved or (not old_weight and (backend, key) not in awaited)
                _set_weight(plan, backend, key, weight, unchecked=unchecked)
    _map_commands(plan, old_maps, new_maps, o, ("models", "tokens", "limits", "grpc", "sleepy", "index"))
    leaving: dict[str, list[str]] = {}
    for backend, servers in sorted(before.items()):
        for key in sorted(servers.keys() - after.get(backend, {}).keys()):
            plan.add(f"set server {backend}/{key} state maint")
            leaving.setdefault(backend, []).append(key)
    for backend, key in sorted(draining):
        if key not in after.get(backend, {}) and key not in before.get(backend, {}):
            leaving.setdefault(backend, []).append(key)
    # Never `del server` (see above): count what the leaving servers still have in flight.
    for backend, keys in sorted(leaving.items()):
        plan.add(f"show stat {backend} 4 -1", "# ", leaving=(backend, tuple(sorted(keys))))
    return plan


def _set_address(plan: Plan, backend: str, key: str, server: Server) -> None:
    plan.add(
        f"set server {backend}/{key} addr {server.address} port {server.port}",
        "IP changed", "no need to change", "port changed", "IP and port",
    )  # fmt: skip


def in_flight(stat_csv: str) -> dict[str, int] | None:
    """``show stat`` CSV -> server name: requests in flight (current plus queued sessions); None for an answer
    that is not a statistics table."""
    lines = stat_csv.splitlines()
    if not lines or not lines[0].startswith("# "):
        return None
    header = lines[0][2:].split(",")
    name, current, queued = header.index("svname"), header.index("scur"), header.index("qcur")
    out = {}
    for line in lines[1:]:
        fields = line.split(",")
        if len(fields) > max(name, current, queued):
            out[fields[name]] = sum(int(fields[i]) for i in (current, queued) if fields[i].isdigit())
    return out


# Health-check results that mean the instance's address could not be reached at all (no answer, a refusal,
# a broken connection), as opposed to an answer saying the model is not ready (L7STS) - HAProxy's names.
UNREACHABLE_CHECKS = {"L4TOUT": "connection timed out", "L4CON": "connection refused or failed",
                      "L6TOUT": "timed out", "L6RSP": "invalid answer", "L7TOUT": "no answer in time",
                      "L7RSP": "invalid answer", "SOCKERR": "socket error"}  # fmt: skip


def unreachable_servers(stat_csv: str) -> dict[str, str]:
    """``show stat`` CSV -> server name: why HAProxy's health checks cannot reach it, for the servers DOWN
    after a connection-level failure (in any backend; maintenance is not a failure)."""
    lines = stat_csv.splitlines()
    if not lines or not lines[0].startswith("# "):
        return {}
    header = lines[0][2:].split(",")
    name, status, check = header.index("svname"), header.index("status"), header.index("check_status")
    out = {}
    for line in lines[1:]:
        fields = line.split(",")
        if len(fields) <= max(name, status, check) or not fields[status].startswith("DOWN"):
            continue
        code = fields[check].removeprefix("* ").strip()
        if code in UNREACHABLE_CHECKS:
            out[fields[name]] = f"health check failed: {UNREACHABLE_CHECKS[code]} ({code})"
    return out


def runtime_commands(
    old: GatewayState, old_slots: Slots, new: GatewayState, new_slots: Slots, o: Options
) -> list[str]:
    return [c.text for c in runtime_plan(old, old_slots, new, new_slots, o, set()).commands]
