"""Keep a running HAProxy in line with the database, without dropping requests.

Each sync renders the desired state, writes the files (so a restart comes back in the same state) and then
applies the difference over the admin socket: map entries, servers added and deleted, weights and states.
Deployments live in pre-declared backend slots, so deploy, switch, undeploy, placements, rollouts and instance
deaths never reload; a graceful reload happens only when the slot pool is exhausted (it grows by
``GATEWAY_SLOT_CHUNK``), when a team's gRPC backend appears or goes, or when HAProxy refused a runtime change. Pokes (a datagram on ``poke.sock``) make the loop sync at once
after a deploy, switch, undeploy or token change - a poke naming one deployment syncs that deployment alone;
otherwise it syncs everything every ``GATEWAY_SYNC_INTERVAL_MS``.

Drain, then unload (``apps.deployments.draining``): a placement is marked routed before a sync first puts it
in rotation (one the platform told to unload meanwhile stays out), and a routed placement told to unload is
confirmed drained once HAProxy holds it out of rotation with no session on it (its requests in flight
finished) - only then does its agent unload it. An undeploying deployment's backend goes at once (no route:
new requests get the gateway's 404), but its servers stay in HAProxy, in maintenance (draining while a request
is in flight there, then parked: ``apps.gateway.runtime`` never deletes one): its replica is confirmed once none
of them holds a request.
"""

from __future__ import annotations

import logging
import re
import selectors
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from django.conf import settings
from django.db import close_old_connections, connection

from apps.deployments import draining, routing
from apps.fleet import services as fleet
from apps.gateway import grpc_frontend
from apps.gateway.autoscaling import InFlight, poll_wakeups
from apps.gateway.haproxy import GatewayError, GatewayState, Options, Slots, write_files
from apps.gateway.metrics import record_worker_started
from apps.gateway.process import HAProxyProcess
from apps.gateway.runtime import Plan, in_flight, runtime_plan, unreachable_servers
from apps.gateway.state import Tracked, desired_state, options, with_deployments

log = logging.getLogger(__name__)

# More changes than this at once (e.g. thousands of tokens created by a script) go through a reload.
MAX_RUNTIME_COMMANDS = 500
# Wake-ups read together are placed side by side by this many threads of the gateway command.
WAKE_WORKERS = 4
# Servers kept in maintenance after they left (``apps.gateway.runtime``: never deleted): past this many, a
# reload (a new worker) forgets them. Slots times instances bounds them; this only caps a very large fleet.
MAX_PARKED_SERVERS = 5000
# A poke naming the deployment whose change it announces (``!``: to be synced on its own at once).
POKE_NAMING = re.compile(rb"d([0-9]{1,18})(!?)")


def poke_socket_path() -> Path:
    return Path(settings.GATEWAY_DIR) / "poke.sock"


def poke_gateway(deployment_id: int | None = None, urgent: bool = False) -> None:
    """Ask a running gateway to sync now (best effort: without one, nothing happens). ``deployment_id``: the
    change is this deployment's - if a request is held for it, or the change is ``urgent`` (a replica told to
    unload: its room frees once it drained), the gateway syncs it on its own first."""
    path = poke_socket_path()
    if not path.exists():
        return
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            text = b"sync" if deployment_id is None else b"d%d%s" % (deployment_id, b"!" if urgent else b"")
            sock.sendto(text, str(path))
    except OSError:
        pass  # no gateway listening, or it is already busy with a sync: it syncs again shortly anyway


def find_haproxy(binary: str | None = None) -> str:
    binary = binary or settings.GATEWAY_HAPROXY
    found = shutil.which(binary)
    if found is None:
        raise GatewayError(
            f"haproxy ({binary}) is not installed: run `apt-get install haproxy` (Debian) or set GATEWAY_HAPROXY"
        )
    return found


class Gateway:
    """HAProxy plus the state and slot assignment it was last given, and the servers that left it: still
    draining (requests in flight) or parked (``apps.gateway.runtime``)."""

    def __init__(self, o: Options | None = None, binary: str | None = None) -> None:
        self.o = o or options()
        self.process = HAProxyProcess(self.o, find_haproxy(binary))
        self.applied: GatewayState | None = None
        self.slots = Slots(settings.GATEWAY_SLOT_CHUNK)
        self.draining: set[tuple[str, str]] = set()
        self.parked: set[tuple[str, str]] = set()
        # Logical backend -> the slot it left while servers there still drain (the slot is not reassigned
        # meanwhile): where the requests sent to an undeployed deployment are still counted.
        self.vacated: dict[str, str] = {}
        self.reloads = 0
        # What clients can call, as last reported to the platform (``apps.deployments.routing``), and when.
        self.name = f"{socket.gethostname()} {self.o.bind}"
        self.reported: dict[int, tuple[int, int]] | None = None
        self.reported_at = 0.0
        # Instances its health checks cannot reach (key -> reason), as last reported, and when.
        self.unreachable: dict[str, str] | None = None
        self.unreachable_at = 0.0
        # Deployment id -> epoch ms a sync put its first server in rotation (a cold start's "routed" mark).
        self.routed_at: dict[int, float] = {}
        self._in_rotation: set[int] = set()
        # Deployment id -> when (monotonic) the wake thread last read a held request's signal for it, until a
        # server of it is in rotation: the deployments a poke naming them syncs on their own (``sync(only)``).
        self.held: dict[int, float] = {}
        self.files_behind = False  # a sync of a few deployments left the files to the next full sync
        self._held_lock = threading.Lock()

    def note_held(self, ids: set[int]) -> None:
        """The wake thread read requests held for these deployments."""
        with self._held_lock:
            self.held.update(dict.fromkeys(ids, time.monotonic()))

    def held_among(self, ids: set[int]) -> set[int]:
        """Those of ``ids`` with a request held for them now (a signal older than the activation timeout
        is forgotten: that request was answered 503)."""
        since = time.monotonic() - self.o.activation_timeout_s
        with self._held_lock:
            self.held = {pk: at for pk, at in self.held.items() if at >= since}
            return {pk for pk in ids if pk in self.held}

    def _assign(self, state: GatewayState, previous: Slots, unavailable: set[str]) -> Slots:
        return previous.assign(state.backends, unavailable, settings.GATEWAY_SLOT_CHUNK)

    def start(self) -> None:
        state = desired_state()
        self.files_behind = False
        # The slots a previous run used (written beside the config): a restart keeps every deployment's slot.
        previous = Slots.read(self.o.map_file("slots"), settings.GATEWAY_SLOT_CHUNK)
        slots = self._assign(state, previous, set())
        write_files(state, slots, self.o)
        record_worker_started(self.process.start())
        self._forget(state, slots)

    def sync(self, only: set[int] | None = None) -> str:
        """Bring HAProxy to the database's state; returns what it did: unchanged, runtime or reloaded. Marks
        the placements it puts in rotation first, and confirms those it drained after.

        ``only``: bring just these deployments in line (``with_deployments``), the rest as last applied - for
        a deployment whose request is held while it wakes, its first server in rotation a few milliseconds
        after its agent's report instead of after a sync of every deployment (at 300 deployments 75 ms idle,
        several times that on busy cores, and the syncs rest between them). The next full sync follows
        as before, and reconciles."""
        tracked = Tracked()
        if only is None:
            state = desired_state(tracked)
        elif self.applied is None or not self.process.running():
            return "unchanged"  # a start reads everything: the full sync does it
        else:
            state = with_deployments(self.applied, desired_state(tracked, only=only), only)
        if tracked.to_mark:
            marked = draining.placements_routed(set(tracked.to_mark))
            for pk, servers in tracked.to_mark.items():
                if pk not in marked:  # told to unload since it was read: it stays out of rotation
                    state.weights.update(dict.fromkeys(servers, 0))
        before = self.slots
        outcome = self._apply(state, write=only is None)
        self._remember_vacated(before)
        self._note_rotation()
        self.report_routes()
        if only is None:
            self.report_reachability()
        # After a reload an old worker may still hold requests this one cannot see: no confirmation until it
        # has finished them and exited (or GATEWAY_DRAIN_TIMEOUT_S hands the replicas to their agents).
        if tracked.to_confirm and outcome != "reloaded" and not self.process.retiring_workers():
            busy = self.sessions({server for servers in tracked.to_confirm.values() for server in servers})
            drained = {
                pk for pk, servers in tracked.to_confirm.items() if not any(busy.get(s) for s in servers)
            }
            draining.placements_drained(drained, "no request in flight at the gateway")
        return outcome

    def _note_rotation(self) -> None:
        if self.applied is None:
            return
        now_ms = time.time() * 1000
        serving = {pk for pk, (_, servers) in self.applied.routed().items() if servers}
        for pk in serving - self._in_rotation:
            self.routed_at[pk] = now_ms
        self._in_rotation = serving
        with self._held_lock:
            self.held = {pk: at for pk, at in self.held.items() if pk not in serving}
        self.routed_at = {pk: at for pk, at in self.routed_at.items() if pk in serving}

    def report_routes(self) -> None:
        """Tell the platform what HAProxy now routes (a deployment is SERVING once it is callable): on a
        change, and as a heartbeat a few times per ``GATEWAY_ROUTES_STALE_S``."""
        if self.applied is None:
            return
        routes = self.applied.routed()
        due = time.monotonic() - self.reported_at >= settings.GATEWAY_ROUTES_STALE_S / 3
        if routes == self.reported and not due:
            return
        routing.record_gateway_routes(self.name, routes)
        self.reported, self.reported_at = routes, time.monotonic()

    def report_reachability(self) -> None:
        """Tell the platform which instances HAProxy's health checks cannot reach (a partition between this
        gateway and a host the platform may still hear): on a change, and as a heartbeat like the routes."""
        if self.applied is None:
            return
        unreachable = unreachable_servers(self.process.admin.ask("show stat -1 4 -1"))
        due = time.monotonic() - self.unreachable_at >= settings.GATEWAY_ROUTES_STALE_S / 3
        if unreachable == self.unreachable and not due:
            return
        if unreachable != self.unreachable:
            log.info("instances unreachable from this gateway: %s", len(unreachable))
        fleet.record_gateway_reachability(self.name, unreachable)
        self.unreachable, self.unreachable_at = unreachable, time.monotonic()

    def _draining_slots(self) -> set[str]:
        """The slots with a server still draining, in the HTTP backend or its gRPC twin."""
        twins = {grpc_frontend.twin(slot): slot for slot in self.slots.names()}
        return {twins.get(backend, backend) for backend, _ in self.draining}

    def _remember_vacated(self, before: Slots) -> None:
        """After a sync: the slots that backends left (``before``: the assignment it started from), for as long
        as servers there drain. A reload or a start forgets them (``draining`` and ``parked`` too: a new
        worker)."""
        owners = self.slots.owners
        wanted = set(owners.values())
        vacated = {**self.vacated, **{o: slot for slot, o in before.owners.items() if o not in wanted}}
        still = self._draining_slots()
        self.vacated = {o: slot for o, slot in vacated.items() if slot in still and slot not in owners}

    def sessions(self, servers: set[tuple[str, str]]) -> dict[tuple[str, str], int]:
        """Requests in flight (HAProxy's current sessions) per (logical backend, server key), on the slot's
        HTTP backend and its gRPC twin; a server HAProxy does not have counts none. A backend gone in a sync
        (undeployed) counts on the slot it left, its servers still draining there."""
        busy: dict[tuple[str, str], int] = {}
        by_backend: dict[str, list[tuple[str, str]]] = {}
        for logical, key in servers:
            if self.slots.holds(logical):
                slot = self.slots.slot_of(logical)
                backends = [slot, grpc_frontend.twin(slot)]
            elif logical in self.vacated:
                slot = self.vacated[logical]
                backends = [b for b in (slot, grpc_frontend.twin(slot)) if (b, key) in self.draining]
            else:
                continue
            for backend in backends:
                by_backend.setdefault(backend, []).append((logical, key))
        backends = sorted(by_backend)
        for backend, answer in zip(
            backends, self.process.admin.each([f"show stat {b} 4 -1" for b in backends]), strict=True
        ):
            current = in_flight(answer) or {}
            for logical, key in by_backend[backend]:
                busy[(logical, key)] = busy.get((logical, key), 0) + current.get(key, 0)
        return busy

    def _apply(self, state: GatewayState, write: bool = True) -> str:
        """``write=False`` (a sync of a few deployments): the files - what a restart or a reload reads - are
        left to the next full sync unless this one reloads (rendering them is most of such a sync's time)."""
        if self.applied is None or not self.process.running():
            self.start()
            return "started"
        if state == self.applied and not self.draining:
            if write and self.files_behind:
                write_files(state, self.slots, self.o)
                self.files_behind = False
            return "unchanged"
        # A slot freed now, or with servers still draining, is not given to anyone in this sync.
        freed = {slot for slot, owner in self.slots.owners.items() if owner not in state.backends}
        slots = self._assign(state, self.slots, freed | self._draining_slots())
        if write:
            write_files(state, slots, self.o)
        self.files_behind = not write
        if state.structure() != self.applied.structure() or slots.size != self.slots.size:
            return self._reload(state, slots)
        plan = runtime_plan(self.applied, self.slots, state, slots, self.o, self.draining, self.parked)
        if len(plan.commands) > MAX_RUNTIME_COMMANDS:
            return self._reload(state, slots)
        errors = self._run(plan, state.servers(slots))
        self.applied, self.slots = state, slots
        if errors:
            # The files hold the new state: a reload applies it whatever the socket refused.
            log.warning("runtime changes refused (%s); reloading", "; ".join(errors[:3]))
            return self._reload(state, slots)
        if len(self.parked) > MAX_PARKED_SERVERS:
            log.info("%d servers parked in maintenance; reloading to release them", len(self.parked))
            return self._reload(state, slots)
        return "runtime"

    def _reload(self, state: GatewayState, slots: Slots) -> str:
        if self.files_behind:  # a new worker reads the files: they must hold this state
            write_files(state, slots, self.o)
            self.files_behind = False
        record_worker_started(self.process.reload())
        self.reloads += 1
        self._forget(state, slots)
        return "reloaded"

    def _forget(self, state: GatewayState, slots: Slots) -> None:
        """A new worker: it has the configuration's servers only."""
        self.applied, self.slots, self.vacated = state, slots, {}
        self.draining, self.parked = set(), set()

    def _run(self, plan: Plan, wanted: dict[str, dict]) -> list[str]:
        errors = []
        answers = self.process.admin.each([command.text for command in plan.commands])
        for command, answer in zip(plan.commands, answers, strict=True):
            if command.leaving is not None:
                backend, keys = command.leaving
                counts = in_flight(answer)
                for key in keys:
                    # An answer that is no table counts as busy: a later sync looks again.
                    if counts is None or counts.get(key, 0):
                        self.draining.add((backend, key))
                    else:
                        self.draining.discard((backend, key))
                        self.parked.add((backend, key))
            elif not command.succeeded(answer):
                errors.append(f"{command.text}: {answer}")
        # A draining or parked server that is wanted again was put back in rotation.
        self.draining = {(b, k) for b, k in self.draining if k not in wanted.get(b, {})}
        self.parked = {(b, k) for b, k in self.parked if k not in wanted.get(b, {})}
        return errors

    def stop(self) -> None:
        self.process.stop()
        if self.files_behind and self.applied is not None:
            # Syncs of single deployments leave the files to the next full sync: a stop writes them, so
            # HAProxy started from them alone (a restart without the database) routes what this one did.
            write_files(self.applied, self.slots, self.o)
            self.files_behind = False
        if self.reported is not None:
            try:
                routing.forget_gateway(self.name)
            except Exception:  # the database is gone too: the row ages out after GATEWAY_ROUTES_STALE_S
                log.warning("could not remove this gateway's routes from the platform", exc_info=True)
            self.reported = None
        if self.unreachable is not None:
            try:
                fleet.forget_gateway_reachability(self.name)
            except Exception:  # the rows age out after GATEWAY_ROUTES_STALE_S
                log.warning("could not remove this gateway's reachability from the platform", exc_info=True)
            self.unreachable = None


def _sync(gateway: Gateway, only: set[int] | None = None) -> None:
    try:
        outcome = gateway.sync(only)
        if outcome not in ("unchanged", "runtime"):
            log.info("gateway %s", outcome)
    except (GatewayError, OSError) as exc:
        log.error("gateway sync failed: %s", exc)
    except Exception:
        log.exception("gateway sync failed")
    finally:
        close_old_connections()


def _drain_datagrams(sock: socket.socket) -> tuple[set[int], set[int], bool]:
    """Every poke waiting (several at once are one sync); returns the deployments they name (``d<id>``),
    those of them to sync at once (``d<id>!``), and whether one named none (``sync``, or anything else):
    a change that is not one deployment's, for a full sync."""
    named, urgent, full = set(), set(), False
    try:
        while True:
            match = POKE_NAMING.fullmatch(sock.recv(64))
            if match:
                named.add(int(match[1]))
                if match[2]:
                    urgent.add(int(match[1]))
            else:
                full = True
    except (BlockingIOError, InterruptedError):
        pass
    return named, urgent, full


def _accept_all(listener: socket.socket) -> None:
    """wake.lua's connections say only "read the wake-ups now" (the map holds what): accepted and closed."""
    try:
        while True:
            connection, _ = listener.accept()
            connection.close()
    except (BlockingIOError, InterruptedError):
        pass


def _wake_loop(gateway: Gateway, listener: socket.socket, *stops: threading.Event) -> None:
    """The wake-ups of held requests, on a thread of their own: read as soon as wake.lua connects to the wake
    socket (and every ``GATEWAY_WAKE_POLL_MS`` in any case), never behind a sync of the whole state - under a
    stream of cold starts the syncs ran back to back and a wake-up waited for the one in progress - nor
    behind the wake-ups read before it, which its workers are still placing."""
    step = settings.GATEWAY_WAKE_POLL_MS / 1000
    in_flight = InFlight()
    try:
        with (
            selectors.DefaultSelector() as selector,
            ThreadPoolExecutor(WAKE_WORKERS, thread_name_prefix="gateway-wake") as pool,
        ):
            selector.register(listener, selectors.EVENT_READ)
            while not any(s.is_set() for s in stops):
                if selector.select(timeout=step):
                    _accept_all(listener)
                if any(s.is_set() for s in stops):
                    break
                try:
                    poll_wakeups(
                        gateway.process.admin,
                        gateway.o,
                        gateway.routed_at,
                        pool=pool,
                        held=gateway.note_held,
                        in_flight=in_flight,
                    )
                except Exception:
                    log.exception("reading the gateway's wake-ups failed")
                finally:
                    close_old_connections()
    finally:
        connection.close()


class SyncSchedule:
    """When the gateway command's loop syncs, and what.

    At most half of a core: after a sync that took T, the next one starts T later at the earliest, and the
    pokes meanwhile are folded into it (under a stream of cold starts, pokes came faster than syncs and the
    loop synced back to back, a core that loads needed). A poke naming a deployment with a request held, or
    one whose replica was told to unload (``d<id>!``), does not wait: that deployment syncs on its own at
    once. The other deployments named are synced together, alone too, at the next rested moment. The full
    sync (every deployment, the instances, the tokens: 75 ms at 300 deployments idle, several times that on
    busy cores) runs after a poke that names none, and every ``interval`` s to reconcile what no poke
    announces (an instance's state)."""

    def __init__(self, interval: float, now: float) -> None:
        self.interval = interval
        self.next_full = now + interval
        self.rested_at = 0.0
        self.full_asked = False
        self.pending: set[int] = set()

    def due(self) -> float:
        return max(self.rested_at, 0.0 if self.full_asked or self.pending else self.next_full)

    def poked(self, named: set[int], at_once: set[int], full: bool) -> set[int]:
        """The deployments to sync alone now (``at_once``); the rest of ``named`` waits for the next rested
        moment."""
        self.pending |= named - at_once
        self.full_asked = self.full_asked or full
        return at_once

    def take(self, now: float) -> set[int] | None:
        """What to sync now that it is due: None for everything, else the deployments named since."""
        if self.full_asked or now >= self.next_full:
            self.next_full, self.full_asked, self.pending = now + self.interval, False, set()
            return None
        only, self.pending = self.pending, set()
        return only

    def synced(self, began: float, ended: float) -> None:
        self.rested_at = 2 * ended - began


def run_gateway(stop, interval: float | None = None) -> None:
    """The gateway command's loop: start HAProxy, then sync on every poke or interval until ``stop`` is set;
    the wake-ups of held requests are read on a thread of their own (``_wake_loop``)."""
    interval = settings.GATEWAY_SYNC_INTERVAL_MS / 1000 if interval is None else interval
    gateway = Gateway()
    gateway.o.make_directory()
    poke_path, wake_path = poke_socket_path(), gateway.o.wake_socket
    poke_path.unlink(missing_ok=True)
    wake_path.unlink(missing_ok=True)
    waker, ending = None, threading.Event()
    with (
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as poke,
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as wake,
        selectors.DefaultSelector() as selector,
    ):
        poke.bind(str(poke_path))
        wake.bind(str(wake_path))
        wake.listen(64)
        poke.setblocking(False)
        wake.setblocking(False)
        selector.register(poke, selectors.EVENT_READ)
        try:
            gateway.start()
            gateway.report_routes()
            waker = threading.Thread(
                target=_wake_loop, args=(gateway, wake, stop, ending), name="gateway-wake", daemon=True
            )
            waker.start()
            log.info("gateway listening on %s (gRPC %s)", settings.GATEWAY_BIND, settings.GATEWAY_GRPC_BIND)
            schedule = SyncSchedule(interval, time.monotonic())
            while not stop.is_set():
                if selector.select(timeout=max(0.0, schedule.due() - time.monotonic())):
                    named, urgent, full = _drain_datagrams(poke)
                    alone = schedule.poked(named, gateway.held_among(named) | urgent, full)
                    if alone and not stop.is_set():
                        _sync(gateway, alone)
                    continue
                if stop.is_set():
                    break
                began = time.monotonic()
                if began < schedule.due():
                    continue
                what = schedule.take(began)
                if what is None:
                    _drain_datagrams(poke)  # folded into this sync
                _sync(gateway, what)
                schedule.synced(began, time.monotonic())
        finally:
            ending.set()
            if waker is not None:
                waker.join(settings.GATEWAY_WAKE_POLL_MS / 1000 + 30)
            gateway.stop()
            poke_path.unlink(missing_ok=True)
            wake_path.unlink(missing_ok=True)
