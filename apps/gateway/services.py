"""Keep a running HAProxy in line with the database, without dropping requests.

Each sync renders the desired state, writes the files (so a restart comes back in the same state) and then
applies the difference: map entries, weights and server states over the admin socket; a graceful reload only
when the set of backends or servers changed. Pokes (a datagram on ``poke.sock``) make the loop sync at once
after a deploy, switch, undeploy or token change; otherwise it syncs every ``GATEWAY_SYNC_INTERVAL_MS``.
"""

from __future__ import annotations

import logging
import shutil
import socket
from pathlib import Path

from django.conf import settings
from django.db import close_old_connections

from apps.gateway.haproxy import (
    GatewayError,
    GatewayState,
    HAProxyProcess,
    Options,
    runtime_commands,
    write_files,
)
from apps.gateway.state import desired_state, options

log = logging.getLogger(__name__)

# More changes than this at once (e.g. thousands of tokens created by a script) go through a reload.
MAX_RUNTIME_COMMANDS = 500
_BATCH = 50


def poke_socket_path() -> Path:
    return Path(settings.GATEWAY_DIR) / "poke.sock"


def poke_gateway() -> None:
    """Ask a running gateway to sync now (best effort: without one, nothing happens)."""
    path = poke_socket_path()
    if not path.exists():
        return
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            sock.sendto(b"sync", str(path))
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
    """HAProxy plus the state it was last given."""

    def __init__(self, o: Options | None = None, binary: str | None = None) -> None:
        self.o = o or options()
        self.process = HAProxyProcess(self.o, find_haproxy(binary))
        self.applied: GatewayState | None = None
        self.reloads = 0

    def start(self) -> None:
        state = desired_state()
        write_files(state, self.o)
        self.process.start()
        self.applied = state

    def sync(self) -> str:
        """Bring HAProxy to the database's state; returns what it did: unchanged, runtime or reloaded."""
        state = desired_state()
        if self.applied is None or not self.process.running():
            self.start()
            return "started"
        if state == self.applied:
            return "unchanged"
        write_files(state, self.o)
        commands = runtime_commands(self.applied, state, self.o)
        if state.structure() != self.applied.structure() or len(commands) > MAX_RUNTIME_COMMANDS:
            self.process.reload()
            self.reloads += 1
            self.applied = state
            return "reloaded"
        errors = self._run(commands)
        if errors:
            # The files already hold the new state: a reload applies it whatever the socket refused.
            log.warning("runtime changes refused (%s); reloading", "; ".join(errors[:3]))
            self.process.reload()
            self.reloads += 1
        self.applied = state
        return "runtime"

    def _run(self, commands: list[str]) -> list[str]:
        errors = []
        for start in range(0, len(commands), _BATCH):
            batch = commands[start : start + _BATCH]
            answers = self.process.admin.run(batch)
            errors += [answer.strip() for answer in answers if answer.strip()]
        return errors

    def stop(self) -> None:
        self.process.stop()


def run_gateway(stop, interval: float | None = None) -> None:
    """The gateway command's loop: start HAProxy, then sync on every poke or interval until ``stop`` is set."""
    interval = settings.GATEWAY_SYNC_INTERVAL_MS / 1000 if interval is None else interval
    gateway = Gateway()
    gateway.o.directory.mkdir(parents=True, exist_ok=True)
    poke_path = poke_socket_path()
    poke_path.unlink(missing_ok=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as poke:
        poke.bind(str(poke_path))
        poke.settimeout(interval)
        try:
            gateway.start()
            log.info("gateway listening on %s (gRPC %s)", settings.GATEWAY_BIND, settings.GATEWAY_GRPC_BIND)
            while not stop.is_set():
                try:
                    poke.recv(64)
                    while True:  # several pokes at once are one sync
                        poke.setblocking(False)
                        poke.recv(64)
                except (TimeoutError, BlockingIOError, InterruptedError):
                    pass
                finally:
                    poke.settimeout(interval)
                if stop.is_set():
                    break
                try:
                    outcome = gateway.sync()
                    if outcome not in ("unchanged", "runtime"):
                        log.info("gateway %s", outcome)
                except (GatewayError, OSError) as exc:
                    log.error("gateway sync failed: %s", exc)
                except Exception:
                    log.exception("gateway sync failed")
                finally:
                    close_old_connections()
        finally:
            gateway.stop()
            poke_path.unlink(missing_ok=True)
