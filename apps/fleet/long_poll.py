"""Long poll of the desired state: ``GET /agent/v1/desired-state?wait=25`` with an ``If-None-Match`` is held
until the host's generation changes (or its credential stops working) or the wait ends.

One watcher thread per web process reads the generations of every host with a held poll in one query every
``AGENT_LONG_POLL_WATCH_MS`` (200 ms) and wakes the polls whose answer changed; nothing runs while no poll is
held. Polling the table, not PostgreSQL's LISTEN/NOTIFY: one indexed query for all waiting hosts costs less
than a millisecond five times a second, it works the same on SQLite (``make run``) and PostgreSQL, and every
writer of ``desired_generation`` is covered without a trigger or a NOTIFY next to each UPDATE. The watcher
opens its connection for each sweep and closes it after: a process holds no idle connection for it, and a
database restart costs one failed sweep.

A change made on this machine does not wait for the next sweep: ``notify_hosts`` (after its commit) sends a
datagram to every watcher's socket under ``<VAR_DIR>/long-poll/`` (``poke_watchers``), which sweeps at once -
a scale-to-zero wake-up's placement reaches the agent's open poll in milliseconds, not up to 200 ms later. A
watcher whose socket cannot be made (another machine, a path too long for a socket) still sweeps on its
interval, as does every watcher for changes made elsewhere.

A held poll pins a web server thread, so one process holds at most ``AGENT_LONG_POLL_MAX_WAITERS``; beyond
that a poll is answered at once (the agent polls again after its interval, as a short poll). A process that is
shutting down answers every held poll at once (``release_all``, from the gunicorn hooks in
``serving_platform.gunicorn_hooks``), so a stop does not wait for the longest wait.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import threading
from pathlib import Path
from urllib.parse import parse_qs

from django.conf import settings
from django.db import connection

from apps.fleet.models import Host

log = logging.getLogger(__name__)

# WSGI environ key the fast path sets on a poll it already held: the Django view does not hold it again.
HELD = "fleet.long_poll.held"
_WAIT = re.compile(r"\d{1,6}(\.\d{1,3})?")


class BadWait(ValueError):
    """The ``wait`` query parameter is not a number of seconds."""


def wait_help() -> str:
    return (
        "'wait' must be a number of seconds, e.g. wait=25 (0 or more; the platform waits at most "
        f"{settings.AGENT_LONG_POLL_MAX_WAIT} s)."
    )


def parse_wait(query_string: str) -> float | None:
    """Seconds to hold the poll (capped at ``AGENT_LONG_POLL_MAX_WAIT``), or None for a short poll.
    Raises ``BadWait`` for anything but one plain decimal number."""
    values = parse_qs(query_string, keep_blank_values=True).get("wait")
    if not values:
        return None
    if len(values) > 1 or not _WAIT.fullmatch(values[0]):
        raise BadWait(wait_help())
    return min(float(values[0]), float(settings.AGENT_LONG_POLL_MAX_WAIT))


class _Waiter:
    __slots__ = ("changed", "credential_hash", "etag", "event")

    def __init__(self, credential_hash: str, etag: str) -> None:
        self.credential_hash = credential_hash
        self.etag = etag
        self.event = threading.Event()
        self.changed = False


class GenerationWatcher:
    """Holds polls and wakes them when their host's generation no longer matches their ETag."""

    def __init__(self, interval: float, max_waiters: int) -> None:
        self.interval = interval
        self.max_waiters = max_waiters
        self._lock = threading.Lock()
        self._waiters: set[_Waiter] = set()
        self._has_waiters = threading.Event()
        self._thread: threading.Thread | None = None
        self._closing = False
        self.sweeps = 0

    def waiting(self) -> int:
        with self._lock:
            return len(self._waiters)

    def wait_for_change(self, credential_hash: str, etag: str, timeout: float) -> bool | None:
        """True: the generation changed, the credential no longer works or the check failed (answer from the
        database); False: nothing changed for ``timeout`` s (a 304); None: this process holds as many polls
        as it may (answer at once)."""
        waiter = _Waiter(credential_hash, etag)
        if self._closing:
            return False  # shutting down: nothing changed, and nothing is held
        with self._lock:
            if len(self._waiters) >= self.max_waiters:
                return None
            self._waiters.add(waiter)
            # Started on first use, in the process that serves: never in a parent that forks workers.
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="agent-long-poll-watcher", daemon=True)
                self._thread.start()
            self._has_waiters.set()
        try:
            waiter.event.wait(timeout)
        finally:
            with self._lock:
                self._waiters.discard(waiter)
        return waiter.changed

    def release_all(self) -> int:
        """The process is stopping: every held poll is answered now (a 304: the agent polls again, and reaches
        a process that is still serving) and no new one is held. Returns how many were released."""
        self._closing = True
        with self._lock:
            waiters = list(self._waiters)
        for waiter in waiters:
            waiter.event.set()
        return len(waiters)

    def _run(self) -> None:
        poke = _poke_socket()
        try:
            while True:
                self._has_waiters.wait()
                _wait_for_poke(poke, self.interval)
                self._sweep_waiting()
        finally:
            if poke is not None:
                _close_poke_socket(poke)

    def _sweep_waiting(self) -> None:
        with self._lock:
            waiters = list(self._waiters)
            if not waiters:
                self._has_waiters.clear()
                return
        self.sweep(waiters)

    def sweep(self, waiters: list[_Waiter]) -> None:
        """One query for every waiting host; wakes the waiters whose answer is no longer a 304."""
        self.sweeps += 1
        try:
            current = generations({w.credential_hash for w in waiters})
        except Exception:  # the database is down or restarting: let the view answer (and retry)
            log.exception("long poll: reading the hosts' generations failed")
            current = None
        finally:
            connection.close()
        for waiter in waiters:
            generation = current.get(waiter.credential_hash) if current is not None else None
            if generation is None or f'"{generation}"' != waiter.etag:
                waiter.changed = True
                waiter.event.set()


def generations(credential_hashes: set[str]) -> dict[str, int]:
    """Credential hash -> desired generation of the joined, unrevoked hosts among them."""
    found: dict[str, int] = {}
    hashes = sorted(credential_hashes)
    for start in range(0, len(hashes), 500):
        rows = (
            Host.objects.filter(credential_hash__in=hashes[start : start + 500], revoked_at__isnull=True)
            .order_by()
            .values_list("credential_hash", "desired_generation")
        )
        found.update(rows)
    return found


def poke_directory() -> Path:
    return Path(settings.VAR_DIR) / "long-poll"


def _poke_socket() -> socket.socket | None:
    """This process's watcher socket (``<pid>.sock``), or None when it cannot be made (then: sweeps only)."""
    directory = poke_directory()
    path = directory / f"{os.getpid()}.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        sock.bind(str(path))
    except OSError as exc:
        log.info(
            "long poll: no poke socket (%s); sweeping every %s ms", exc, settings.AGENT_LONG_POLL_WATCH_MS
        )
        sock.close()
        return None
    return sock


def _close_poke_socket(sock: socket.socket) -> None:
    with contextlib.suppress(OSError, TypeError):
        Path(sock.getsockname()).unlink(missing_ok=True)
    sock.close()


def _wait_for_poke(sock: socket.socket | None, interval: float) -> None:
    """Until a poke arrives or ``interval`` passed; several pokes at once are one sweep."""
    if sock is None:
        threading.Event().wait(interval)
        return
    sock.settimeout(interval)
    try:
        sock.recv(16)
        sock.setblocking(False)
        while True:
            sock.recv(16)
    except (TimeoutError, BlockingIOError, InterruptedError):
        pass


def poke_watchers() -> int:
    """Ask every watcher on this machine to sweep now (best effort); returns how many were reached. A socket
    nobody listens on any more (its process ended) is removed."""
    directory = poke_directory()
    reached = 0
    try:
        paths = list(directory.glob("*.sock"))
    except OSError:
        return 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        for path in paths:
            try:
                sock.sendto(b"1", str(path))
                reached += 1
            except ConnectionRefusedError:
                path.unlink(missing_ok=True)
            except OSError:
                pass  # its queue is full: a sweep is coming anyway
    return reached


_watcher: GenerationWatcher | None = None
_watcher_lock = threading.Lock()


def watcher() -> GenerationWatcher:
    """The process's one watcher."""
    global _watcher
    with _watcher_lock:
        if _watcher is None:
            _watcher = GenerationWatcher(
                settings.AGENT_LONG_POLL_WATCH_MS / 1000, settings.AGENT_LONG_POLL_MAX_WAITERS
            )
        return _watcher
