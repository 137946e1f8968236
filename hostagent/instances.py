"""One instance's tritonserver as its agent owns it, and the restart policy the supervisor applies to it."""

from __future__ import annotations

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
    # Loads, unloads and switches on one instance run one at a time; reconcile skips a busy instance.
    lock: threading.RLock = field(default_factory=threading.RLock)

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
