"""The admin-socket commands that turn a running HAProxy from one :class:`GatewayState` into another.

No Django here. Order matters, so that no request meets a half-applied change:

1. health-check paths (``checks.map``) change, so a server added next is checked with the right path;
2. servers that appear are added (``add server``, which creates them in maintenance), given their health
   check and put in rotation; servers whose weight changed are updated; then routes, tokens and limits
   change (a route never names a slot whose servers are not there yet);
3. servers that disappear are put in maintenance (in-flight requests finish) and deleted. HAProxy refuses to
   delete a server that still has connections: such a server stays *draining* and the next sync tries again.
   A draining server that is wanted again is put back in rotation instead of added.

A server that comes back from maintenance (its instance restarted, a draining server wanted again) enters the
rotation only through its health check: HAProxy itself counts a server leaving maintenance as UP at once
(its check health set to ``rise``, "start OK but check immediately"), and a restarted instance is READY to the
platform as soon as Triton answers, before its agent has loaded the model again - gRPC calls that met it then
were answered "version N is not at ready state", which HAProxy cannot retry. So it leaves maintenance through
``drain`` (no new request), is set ``health down`` and only then ``ready``: it is DOWN until its model's
readiness check passed ``rise`` times. A server *added* stays as HAProxy adds it: the platform adds one only
for a placement its agent reported serving the version (Triton's readiness, moments ago), and its first
check follows at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from apps.gateway.haproxy import GatewayState, Options, Server, Slots, server_options


@dataclass
class Command:
    """One admin-socket command and what to do with its answer."""

    text: str
    ok: tuple[str, ...] = ("",)  # answers that mean success (an answer starting with one of these)
    deletes: tuple[str, str] | None = None  # (backend, server) a `del server` removes

    def succeeded(self, answer: str) -> bool:
        return any(answer.startswith(prefix) if prefix else answer == "" for prefix in self.ok)


@dataclass
class Plan:
    commands: list[Command] = field(default_factory=list)

    def add(self, text: str, *ok: str, deletes: tuple[str, str] | None = None) -> None:
        self.commands.append(Command(text, ok or ("",), deletes))


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
) -> Plan:
    """Commands from ``old`` to ``new`` (same structure and slot pool size). ``draining``: servers still in
    HAProxy, in maintenance, that an earlier sync could not delete yet."""
    plan = Plan()
    old_maps, new_maps = old.maps(old_slots), new.maps(new_slots)
    # Health-check paths first: a server added next is checked with its slot's path from its first check.
    _map_commands(plan, old_maps, new_maps, o, ("checks",))
    # A failed wake-up before the servers: a held request must see it no later than the failed replica's
    # server, which is in rotation until its health check fails (wake.lua looks at the failure first).
    _map_commands(plan, old_maps, new_maps, o, ("wakefail",))
    before, after = old.servers(old_slots), new.servers(new_slots)
    old_weights, new_weights = old.server_weights(old_slots), new.server_weights(new_slots)
    for backend, servers in sorted(after.items()):
        for key, server in sorted(servers.items()):
            weight = new_weights.get((backend, key), 100)
            was: Server | None = before.get(backend, {}).get(key)
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
                plan.add(
                    f"set server {backend}/{key} addr {server.address} port {server.port}",
                    "IP changed", "no need to change", "port changed", "IP and port",
                )  # fmt: skip
            old_weight = 0 if was is None else old_weights.get((backend, key), 100)
            if moved or old_weight != weight:
                _set_weight(plan, backend, key, weight, unchecked=moved or not old_weight)
    _map_commands(plan, old_maps, new_maps, o, ("models", "tokens", "limits", "grpc", "sleepy"))
    for backend, servers in sorted(before.items()):
        for key in sorted(servers.keys() - after.get(backend, {}).keys()):
            plan.add(f"set server {backend}/{key} state maint")
            plan.add(f"del server {backend}/{key}", "Server deleted", deletes=(backend, key))
    for backend, key in sorted(draining):
        if key not in after.get(backend, {}) and key not in before.get(backend, {}):
            plan.add(f"del server {backend}/{key}", "Server deleted", deletes=(backend, key))
    return plan


def runtime_commands(
    old: GatewayState, old_slots: Slots, new: GatewayState, new_slots: Slots, o: Options
) -> list[str]:
    return [c.text for c in runtime_plan(old, old_slots, new, new_slots, o, set()).commands]
