"""HAProxy as a child process in master-worker mode: start, graceful reload and stop, orphan clean-up."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from apps.gateway.haproxy import AdminSocket, GatewayError, Options

# How often a stop signal is repeated while HAProxy's master has not exited (see HAProxyProcess.stop).
SIGNAL_REPEAT_S = 0.5


class HAProxyProcess:
    """HAProxy in master-worker mode (``-W``) as a child of the gateway command.

    ``reload()`` sends SIGUSR2 to the master: it re-reads the files and starts new workers while the old ones
    finish their requests (listening sockets are passed on, no connection is refused).
    """

    def __init__(self, o: Options, binary: str = "haproxy") -> None:
        self.o, self.binary = o, binary
        self.process: subprocess.Popen | None = None
        self.admin = AdminSocket(o.admin_socket)
        self.retiring: set[int] = set()  # old workers' pids (see retiring_workers)

    def check_config(self) -> None:
        result = subprocess.run(
            [self.binary, "-c", "-q", "-f", str(self.o.config_file)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if result.returncode != 0:
            raise GatewayError(f"haproxy refused the configuration: {result.stdout}{result.stderr}".strip())

    def start(self, timeout: float = 10.0) -> int:
        """Start HAProxy; returns its worker's pid once the worker answers."""
        self.check_config()
        self._stop_orphan()
        self.retiring = set()
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
        return self._wait_for_worker(None, timeout)

    def _stop_orphan(self, timeout: float = 30.0) -> None:
        """An HAProxy left running from this directory (its gateway command was killed) holds the ports and
        routes from stale files: stop it first."""
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
            # The ports are not shared (``noreuseport``): the new HAProxy binds them once this one is gone.
            deadline = time.monotonic() + 5.0
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def reload(self, timeout: float = 10.0) -> int:
        """Reload gracefully; returns the new worker's pid (its counters start at zero)."""
        self.check_config()
        if not self.running():
            raise GatewayError("haproxy is not running")
        old = self.admin.worker_pid()
        self.process.send_signal(signal.SIGUSR2)
        pid = self._wait_for_worker(old, timeout)
        if old is not None:
            self.retiring.add(old)
        return pid

    def retiring_workers(self) -> set[int]:
        """Workers a reload replaced that still run: they finish the requests they had in flight (until
        ``hard-stop-after``), which the new worker's admin socket does not show."""
        self.retiring = {pid for pid in self.retiring if pid_alive(pid)}
        return self.retiring

    def _wait_for_worker(self, old_pid: int | None, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running():
                raise GatewayError(f"haproxy exited with code {self.process.returncode}: {self.log_tail()}")
            pid = self.admin.worker_pid()
            if pid is not None and pid != old_pid:
                return pid
            time.sleep(0.05)
        raise GatewayError(f"haproxy's new worker did not answer within {timeout:.0f}s: {self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> None:
        """Graceful: SIGUSR1 lets in-flight requests finish; SIGTERM after ``timeout``, SIGKILL if even that
        goes unheard.

        Each signal is sent again every ``SIGNAL_REPEAT_S`` until the master exits: just after a start or a
        reload - its new worker already answering on the admin socket - the master still drops a signal (a
        lost SIGUSR1 left the gateway command waiting the whole ``timeout`` with nothing in flight). HAProxy
        takes a repeated soft stop as the one already under way."""
        if not self.running():
            return
        if self._signal_until_exit(signal.SIGUSR1, timeout) or self._signal_until_exit(signal.SIGTERM, 10):
            return
        self.process.kill()
        self.process.wait(10)

    def _signal_until_exit(self, signum: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            self.process.send_signal(signum)
            try:
                self.process.wait(max(0.0, min(SIGNAL_REPEAT_S, deadline - time.monotonic())))
                return True
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    return False

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
