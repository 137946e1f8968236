"""One instance's tritonserver as its agent owns it, and the restart policy the supervisor applies to it."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from backend_ge import sandbox
from backend_ge.runtime import TritonServer
from hostagent.protocol import InstanceState


@dataclass
class RestartPolicy:
    """Exponential backoff between restarts; quarantine after ``max_crashes`` within ``window``."""

    base_delay: float = 1.0
    max_delay: float = 60.0
    max_crashes: int = 5
    window: timedelta = timedelta(minutes=10)

    def delay(self, recent_crashes: int) -> float:
        return min(self.max_delay, self.base_delay * 2 ** max(0, recent_crashes - 1))


class LoadOverlap:
    """Which loads on one instance overlapped in time. Loads run in parallel (``--parallel-loads``), and a
    footprint read around one load (device memory used, the server's RSS) also counts the others that ran
    meanwhile (and the unloads, whose memory leaves meanwhile: they count as loads here): the meter asks
    whether its load ran alone."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._started = 0

    @contextlib.contextmanager
    def loading(self):
        """Around one load of the instance's server."""
        with self._lock:
            self._running += 1
            self._started += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1

    def mark(self) -> tuple[int, int]:
        """Taken just before a load: (loads started so far, loads running now)."""
        with self._lock:
            return self._started, self._running

    def alone_since(self, mark: tuple[int, int]) -> bool:
        """After that one load ended: True when no other load ran at any moment of it."""
        started, running = mark
        with self._lock:
            return running == 0 and self._running == 0 and self._started == started + 1


@dataclass
class InstanceProcess:
    """The tritonserver of one instance, owned by this agent, with the state this agent reports for it."""

    instance_id: int
    root: Path
    server: TritonServer | None = None
    next_start_at: float = 0.0
    # What this agent knows and reports (adopted from the platform's record when the agent starts).
    state: str = InstanceState.STOPPED
    crash_times: list[str] = field(default_factory=list)
    restarts: int = 0
    last_error: str = ""
    command_seq: int = 0
    # Who its tritonserver runs as (None: the agent's own user), and whether that user was checked.
    user: sandbox.ServerUser | None = None
    access_checked: bool = False
    # Held by the reconcile pass that loads, unloads and switches models on the instance (several models at
    # once, never two steps of one model: ``hostagent.placement.run_per_model``) and by a stop or restart;
    # the supervisor skips a busy instance.
    lock: threading.RLock = field(default_factory=threading.RLock)
    loads: LoadOverlap = field(default_factory=LoadOverlap)

    @property
    def repository(self) -> Path:
        return self.root / "repository"

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    def running(self) -> bool:
        return (
            self.server is not None and self.server.process is not None and self.server.process.poll() is None
        )

    def exit_code(self) -> int | None:
        if self.server is None or self.server.process is None:
            return None
        return self.server.process.poll()

    def restart(self) -> None:
        """Stop the server now; the supervisor starts it again at once (a requested restart, not a crash)."""
        with self.lock:
            if self.server is not None:
                self.server.stop()
                self.server = None
            self.next_start_at = 0.0
