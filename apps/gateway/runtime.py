"""The admin-socket commands that turn a running HAProxy from one :class:`GatewayState` into another.

No Django here. Order matters, so that no request meets a half-applied change:

1. health-check paths (``checks.map``) change, so a server added next is checked with the right path;
2. servers that appear are added (``add server``, which creates them in maintenance), given their health
   check and put in rotation; servers whose weight changed are updated; then routes, tokens and limits
   change (a route never names a slot whose servers are not there yet);
3. servers that disappear are put in maintenance (in-flight requests finish) and deleted. HAProxy refuses to
   delete a server that still has connections: such a server stays *draining* and the next sync tries again.
   A draining server that is wanted again is put back in rotation instead of added.
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


def _put_in_rotation(plan: Plan, backend: str, key: str, weight: int) -> None:
    if weight:
        plan.add(f"set server {backend}/{key} weight {weight}")
        plan.add(f"set server {backend}/{key} state ready")
    else:
        plan.add(f"set server {backend}/{key} state maint")


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
            if was is None or (was.address, was.port) != (server.address, server.port):
                plan.add(
                    f"set server {backend}/{key} addr {server.address} port {server.port}",
                    "IP changed", "no need to change", "port changed", "IP and port",
                )  # fmt: skip
            if was is None or old_weights.get((backend, key), 100) != weight:
                _put_in_rotation(plan, backend, key, weight)
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
