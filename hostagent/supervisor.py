"""The host agent's supervisor: runs this host's Triton + GE instances and keeps them as the platform wants.

One ``HostAgent`` per host process (``python -m hostagent --platform URL``). It holds the platform's URL and this
host's credential, nothing else: no database, no broker. A poll thread long-polls the desired state over the agent
API (held by the platform until it changes, then fetched at once); a supervisor thread starts the instances the
platform wants running, acts on start/stop/restart commands, restarts a crashed ``tritonserver`` with exponential
backoff and quarantines an instance that crashes too often, reporting each state change; a heartbeat thread
reports the host's facts and NPU inventory (``hostagent.host_facts``) and log tails every 10 s; the reconcile
step (after every start, every few seconds, and when the desired state changed) makes each instance's loaded
models match the placements (``hostagent.placement``, which gets this agent passed in).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from backend_ge import sandbox
from backend_ge.errors import public_error
from backend_ge.runtime import TritonError, TritonRuntime, TritonServer, assemble_runtime, server_environment
from hostagent import placement
from hostagent.client import (
    CredentialRefused,
    DesiredState,
    InstanceSpec,
    PlatformClient,
    PlatformError,
    ProtocolRefused,
)
from hostagent.config import AgentConfig
from hostagent.host_facts import host_facts, npu_inventory
from hostagent.instances import InstanceProcess, RestartPolicy
from hostagent.protocol import DesiredInstanceState, InstanceCommand, InstanceState
from hostagent.reports import Reports
from hostagent.tuning_runner import TuningRunner

log = logging.getLogger(__name__)

# A pass applying a stream of decisions keeps its instance's lock for at most this many reconcile intervals.
HOLD_INTERVALS = 6


class HostAgent:
    """Supervises the instances of one host. ``start()`` runs its threads; ``stop()`` stops every instance
    gracefully (in-flight requests finish)."""

    def __init__(
        self,
        client: PlatformClient,
        host_name: str,
        config: AgentConfig,
        *,
        bind_address: str = "127.0.0.1",
        tick: float = 0.5,
        full_fetch_every: float = 30.0,
    ) -> None:
        self.config = config
        self.client = client
        self.host_name = host_name
        self.desired = DesiredState()
        self.reports = Reports(client, self.desired)
        self.bind_address = bind_address
        self.root = config.host_root(host_name)
        self.policy = RestartPolicy(
            base_delay=config.restart_base_delay_ms / 1000,
            max_crashes=config.max_crashes,
            window=timedelta(seconds=config.crash_window),
        )
        self.tick = tick
        self.reconcile_every = config.reconcile_interval_ms / 1000
        self.heartbeat_every = config.heartbeat_interval
        self.poll_every = config.poll_interval_ms / 1000
        self.long_poll_wait = config.long_poll_wait
        self.full_fetch_every = full_fetch_every
        # (instance, server pid, model, version) -> (retry after, last failure) of loads that failed
        self.failed_loads: dict[tuple[int, int, str, int], tuple[float, str]] = {}
        self._etag: str | None = None
        self._fetched_at = 0.0
        self.revoked = threading.Event()
        self.processes: dict[int, InstanceProcess] = {}
        self.runtime: TritonRuntime | None = None
        self._stop = threading.Event()
        self._poke = threading.Event()
        self._threads: list[threading.Thread] = []
        self.tuning = TuningRunner(self, self.processes)

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> HostAgent:
        self.fetch_desired_state(force=True)
        self._adopt_recorded_states()
        self._prepare_host()
        self._kill_orphans()
        self.heartbeat()
        loops = (
            (self._poll_loop, "poll"),
            (self._supervise_loop, "supervisor"),
            (self._reconcile_loop, "reconcile"),
            (self._heartbeat_loop, "heartbeat"),
        )
        for target, name in loops:
            thread = threading.Thread(target=target, name=f"agent-{self.host_name}-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the loops, then every instance with SIGINT so in-flight requests finish."""
        self._stop.set()
        self._poke.set()
        self.tuning.stop()
        for thread in self._threads:
            # The poll thread may be inside a long poll the platform holds for seconds: it ends by itself.
            thread.join(0.5 if thread.name.endswith("-poll") else timeout)
        for proc in self.processes.values():
            with proc.lock:
                if proc.server is not None:
                    proc.server.stop()
                    with contextlib.suppress(PlatformError):
                        self._set_state(proc.instance_id, InstanceState.STOPPED, pid=None)

    def poke(self) -> None:
        """Reconcile now instead of at the next interval."""
        self._poke.set()

    # -- unprivileged servers ----------------------------------------------------------------------------
    def _prepare_host(self) -> None:
        """The runtime tree every server of this host runs from, and - as root - the users it runs as.

        Raises ``sandbox.SandboxError`` with one message naming what an instance's user cannot reach (or
        can read but must not), so a misconfigured host fails at start instead of at its first model load.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o711)
        cache = self.config.cache_dir
        cache.mkdir(parents=True, exist_ok=True)
        cache.chmod(0o700)
        self.runtime = assemble_runtime(self.root / "runtime")
        if not sandbox.can_switch_users():
            log.warning(
                "the host agent does not run as root: tritonserver and every python stub run as this "
                "agent's own user and can read everything it can (the artifact store, var/, its settings). "
                "Run the agent as root to give every instance an unprivileged user of its own."
            )
            return
        granted = sandbox.ensure_traversable(self.root, sandbox.ensure_group())
        for directory in granted:
            log.warning("granted group %s traverse-only access to %s", sandbox.SHARED_GROUP, directory)
        for instance in self.desired.all_instances():
            self._prepare_instance(instance, self.process_for(instance))

    def _prepare_instance(self, instance: InstanceSpec, proc: InstanceProcess) -> None:
        if sandbox.can_switch_users() and proc.user is None:
            proc.user = sandbox.ensure_user(self.host_name, instance.name)
        sandbox.prepare_instance_dirs(proc.root, proc.repository, proc.user)
        if proc.user is None or proc.access_checked:
            return
        proc.run_dir.mkdir(exist_ok=True)
        os.chown(proc.run_dir, proc.user.uid, proc.user.gid, follow_symlinks=False)
        proc.run_dir.chmod(0o700)
        sandbox.check_access(
            proc.user,
            python=self.runtime.python_bin / "python3",
            repository=proc.repository,
            run_dir=proc.run_dir,
            binary=self.runtime.binary,
            backends=self.runtime.backends,
            env=server_environment(self.runtime, home=proc.run_dir, include_checkout=False),
            private=self._private_paths(proc),
        )
        proc.access_checked = True

    def _private_paths(self, proc: InstanceProcess) -> list[Path]:
        """What a server must not read: this agent's credential and download cache, other instances'
        repositories, and what the host's configuration names private (``--private-path``: on a host that
        also runs the platform, its state and secrets)."""
        paths = [self.config.cache_dir, self.config.credential_file, *self.config.private_paths]
        paths += [other.repository for other in self.processes.values() if other is not proc]
        return paths

    # -- loops -------------------------------------------------------------------------------------------
    def _supervise_loop(self) -> None:
        while not self._stop.is_set():
            try:
                if self.supervise_once():
                    self.poke()  # a (re)started server gets its models back right away
            except Exception:  # the supervisor must outlive any one bad iteration
                log.exception("supervisor iteration failed")
            self._stop.wait(self.tick)

    def _reconcile_loop(self) -> None:
        # Its own thread: a load can block for minutes, and crash detection must not wait for it.
        while not self._stop.is_set():
            self._poke.wait(self.reconcile_every)
            self._poke.clear()
            if self._stop.is_set():
                break
            try:
                self.reconcile()
            except (CredentialRefused, ProtocolRefused) as exc:
                self._refused(exc)
            except Exception:
                log.exception("reconcile failed")

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_every):
            try:
                self.heartbeat()
            except (CredentialRefused, ProtocolRefused) as exc:
                self._refused(exc)
            except Exception as exc:
                log.warning("heartbeat failed: %s", exc)

    def _poll_loop(self) -> None:
        """Long polls back to back: the platform answers when the desired state changes or after the wait.
        An answer that comes at once without news (a platform that does not hold polls, or holds as many as
        it may) is followed by the next poll after ``poll_every``; failures back off up to 30 s."""
        failures = 0
        while not self._stop.wait(min(self.poll_every * 2**failures, 30.0) if failures else 0):
            started = time.monotonic()
            try:
                changed = self.fetch_desired_state(wait=self.long_poll_wait)
                failures = 0
            except CredentialRefused as exc:
                self._refused(exc)
                changed, failures = False, 0
            except ProtocolRefused as exc:
                # Only an upgrade (or a platform rolled back) ends it: ask again every 30 s, not every poll.
                self._refused(exc)
                failures = 5
                continue
            except Exception as exc:
                log.warning("desired state not fetched: %s", exc)
                changed, failures = False, min(failures + 1, 5)
                continue
            if self._stop.is_set():
                break
            if changed:
                self.poke()
            else:
                self._stop.wait(max(0.0, self.poll_every - (time.monotonic() - started)))

    def _refused(self, exc: Exception) -> None:
        """The platform refused this agent: its credential (revoked) or its agent protocol (the platform was
        upgraded past it). It takes no more work; running servers keep serving what they have, and a
        desired state fetched again (a new credential, a platform that serves it again) ends it."""
        if not self.revoked.is_set():
            if isinstance(exc, ProtocolRefused):
                log.error("%s; this agent takes no more work until it is upgraded", exc)
            else:
                log.error("%s; this agent takes no more work until it joins again with a new join token", exc)
        self.revoked.set()

    def fetch_desired_state(self, force: bool = False, wait: float = 0) -> bool:
        """Poll the desired state (a long poll of up to ``wait`` s); True when it changed. A full fetch now and
        then, whatever the ETag says, picks up what changed without a new generation (a team's quota, say)."""
        until_full = self.full_fetch_every - (time.monotonic() - self._fetched_at)
        force = force or until_full <= 0
        wait = 0 if force else min(wait, until_full)
        etag, state = self.client.desired_state(None if force else self._etag, wait=wait)
        if state is None:
            return False
        self.desired.replace(state)
        self._etag, self._fetched_at = etag, time.monotonic()
        self.revoked.clear()
        return True

    def _adopt_recorded_states(self) -> None:
        """A restarted agent continues from what it reported before: a quarantine holds, crashes still count,
        and commands issued before it started are not replayed."""
        for instance in self.desired.all_instances():
            proc = self.process_for(instance)
            proc.state = instance.state
            proc.crash_times = list(instance.crash_times)
            proc.restarts = instance.restarts
            proc.command_seq = instance.command_seq

    # -- supervision -------------------------------------------------------------------------------------
    def process_for(self, instance: InstanceSpec) -> InstanceProcess:
        proc = self.processes.get(instance.pk)
        if proc is None:
            proc = self.processes[instance.pk] = InstanceProcess(instance.pk, self.root / instance.name)
        return proc

    def supervise_once(self) -> bool:
        """One pass over this host's instances; returns True when an instance (re)started."""
        started = False
        for instance in self.desired.all_instances():
            proc = self.process_for(instance)
            if self.revoked.is_set():
                continue  # no more work for a revoked host; running servers are left as they are
            self._take_command(instance, proc)
            if proc.server is not None and proc.exit_code() is not None:
                # Dead server: kill what is left of its process group (python backend stubs) at once. They
                # hold the server's sockets, so a request blocked on the dead server only returns after this.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.server.process.pid, signal.SIGKILL)
            if not proc.lock.acquire(blocking=False):
                continue  # a load or switch is running on it
            try:
                started |= self._supervise_instance(instance, proc)
            finally:
                proc.lock.release()
        return started

    def _take_command(self, instance: InstanceSpec, proc: InstanceProcess) -> None:
        """Act once on each new start/stop/restart command (numbered by the platform)."""
        if instance.command_seq <= proc.command_seq:
            return
        proc.command_seq = instance.command_seq
        if instance.command in (InstanceCommand.START, InstanceCommand.RESTART) and proc.state in (
            InstanceState.QUARANTINED,
            InstanceState.FAILED,
        ):
            # A start lifts a quarantine: the crash count starts again.
            proc.crash_times = []
            self._set_state(instance.pk, InstanceState.STOPPED, pid=None, crash_times=[])
        if instance.command == InstanceCommand.RESTART:
            proc.restart()

    def _supervise_instance(self, instance: InstanceSpec, proc: InstanceProcess) -> bool:
        if instance.desired_state == DesiredInstanceState.STOPPED or proc.state == InstanceState.QUARANTINED:
            if proc.server is not None:
                proc.server.stop()
                proc.server = None  # stopped on purpose: not a crash
            if proc.state not in (InstanceState.QUARANTINED, InstanceState.STOPPED):
                self._set_state(instance.pk, InstanceState.STOPPED, pid=None)
            return False
        if proc.server is not None and not proc.running():
            self._record_crash(instance, proc)
            return False
        if proc.running() or time.monotonic() < proc.next_start_at:
            return False
        return self._start_instance(instance, proc)

    def _record_crash(self, instance: InstanceSpec, proc: InstanceProcess) -> None:
        code = proc.exit_code()
        tail = proc.server.log_tail(30)
        proc.server = None
        now = datetime.now(UTC)
        recent = [t for t in proc.crash_times if now - datetime.fromisoformat(t) <= self.policy.window]
        recent.append(now.isoformat())
        error = f"tritonserver exited with code {code}"
        if len(recent) >= self.policy.max_crashes:
            log.error("%s crashed %d times within %s: quarantined", instance, len(recent), self.policy.window)
            self._set_state(
                instance.pk,
                InstanceState.QUARANTINED,
                pid=None,
                crash_times=recent,
                last_error=f"{error}; {len(recent)} crashes within {self.policy.window}: quarantined",
                log_tail=tail,
            )
            return
        delay = self.policy.delay(len(recent))
        proc.next_start_at = time.monotonic() + delay
        log.warning("%s crashed (%s); restarting in %.1fs", instance, error, delay)
        self._set_state(
            instance.pk,
            InstanceState.STARTING,
            pid=None,
            crash_times=recent,
            last_error=error,
            log_tail=tail,
            restarts=proc.restarts + 1,
        )

    def _server_for(self, instance: InstanceSpec, proc: InstanceProcess) -> TritonServer:
        # Not strict: one model that fails to load must not take the server's readiness (and every other
        # model's traffic behind a load balancer) with it.
        extra = ["--strict-readiness=false", f"--model-load-thread-count={self.config.parallel_loads}"]
        if instance.latency_summaries:
            extra.append("--metrics-config=summary_latencies=true")
        return TritonServer(
            proc.repository,
            workdir=proc.root,
            runtime=self.runtime,
            user=proc.user,
            address=self.bind_address,
            http_port=instance.http_port,
            grpc_port=instance.grpc_port,
            metrics_port=instance.metrics_port,
            extra_args=extra,
            # Every API but health needs the instance's key: only the gateway and the platform hold it.
            api_key=instance.api_key,
            open_apis=("health",),
            # If this agent is killed outright, Linux interrupts its servers (a graceful stop) instead of
            # leaving them orphaned on the instance's ports.
            die_with_parent=True,
            # The platform serves only complete configs (build_served_config requires typed inputs and
            # outputs): the backend's auto-complete has nothing to add, and costs an extra stub and a 1 s
            # sleep per load (measured 9.1 s -> 3.4 s for 20 small models, 0.32 -> 0.15 CPU-s per load).
            auto_complete_config=False,
        )

    def _start_instance(self, instance: InstanceSpec, proc: InstanceProcess) -> bool:
        try:
            self._prepare_instance(instance, proc)
        except (sandbox.SandboxError, OSError) as exc:
            # Not a crash of Triton: nothing to quarantine, but nothing to start either until it is fixed.
            log.error("%s cannot start: %s", instance, exc)
            proc.next_start_at = time.monotonic() + self.policy.max_delay
            self._set_state(instance.pk, InstanceState.FAILED, pid=None, last_error=str(exc))
            return False
        self._set_state(instance.pk, InstanceState.STARTING)
        proc.server = self._server_for(instance, proc)
        # Reported with its pid: a server this agent started counted nothing before, so the platform's first
        # scrape of it counts from zero instead of taking its counters as a baseline.
        started_at = datetime.now(UTC).isoformat()
        try:
            proc.server.start(timeout=self.config.start_timeout)
        except TritonError as exc:
            log.error("%s failed to start: %s", instance, exc)
            proc.server.stop(timeout=5)
            # A start failure counts like a crash: a server that can never start must end up quarantined.
            self._record_crash(instance, proc)
            return False
        if proc.user is not None and not sandbox.has_private_dev_shm(proc.server.process.pid):
            log.warning(
                "%s shares /dev/shm with the host (no mount namespace without CAP_SYS_ADMIN): other instances' "
                "users can read its python stubs' shared memory",
                instance,
            )
        self._set_state(
            instance.pk,
            InstanceState.READY,
            pid=proc.server.process.pid,
            started_at=started_at,
            log_tail=proc.server.log_tail(30),
        )
        return True

    def _set_state(self, instance_id: int, state: str | None = None, **fields) -> None:
        """Keep the instance's state here and report it to the platform (absolute values: safe to retry)."""
        if state is not None:
            fields["state"] = state
        if "pid" in fields and fields["pid"] is None:
            fields["started_at"] = None
        if fields.get("last_error"):
            # Tenants read it: no host paths or tracebacks (those go to the log under an error id).
            fields["last_error"] = public_error(fields["last_error"])
        proc = self.processes.get(instance_id)
        if proc is not None:
            for key in ("state", "crash_times", "restarts", "last_error"):
                if key in fields:
                    setattr(proc, key, fields[key])
        try:
            self.client.report_instance(instance_id, fields)
        except (CredentialRefused, ProtocolRefused) as exc:
            self._refused(exc)
        except PlatformError as exc:
            log.warning("instance %s: state %s not reported: %s", instance_id, fields.get("state"), exc)

    def _kill_orphans(self) -> None:
        """A previous agent killed with SIGKILL leaves its servers running on our ports: stop them."""
        for instance in [i for i in self.desired.all_instances() if i.pid]:
            cmdline = Path(f"/proc/{instance.pid}/cmdline")
            with contextlib.suppress(OSError):
                if (
                    b"tritonserver" in cmdline.read_bytes()
                    and str(instance.http_port).encode() in cmdline.read_bytes()
                ):
                    log.warning("stopping orphaned tritonserver pid %s of %s", instance.pid, instance)
                    os.killpg(instance.pid, signal.SIGKILL)
            self._set_state(instance.pk, InstanceState.STOPPED, pid=None)

    # -- heartbeat ---------------------------------------------------------------------------------------
    def heartbeat(self) -> None:
        tails = [
            {"id": proc.instance_id, "log_tail": proc.server.log_tail(30)}
            for proc in list(self.processes.values())
            if proc.running()
        ]
        body = {"facts": host_facts(), "npu": npu_inventory(), "instances": tails}
        if self.config.ports() is not None:
            body["ports"] = self.config.ports()
        self.client.heartbeat(body)

    # -- reconcile ---------------------------------------------------------------------------------------
    def reconcile(self) -> None:
        if self.revoked.is_set():
            return
        pending_before = self._pending()
        for instance in self.desired.all_instances():
            proc = self.processes.get(instance.pk)
            if proc is None or proc.state != InstanceState.READY or not proc.running():
                # Its placements are not READY while it is down.
                state = proc.state if proc else instance.state
                if state == InstanceState.READY:
                    state = "not running"  # died since the supervisor's last look: it records the crash next
                placement.report_instance_down(self, instance, state, proc.last_error if proc else "")
                continue
            # Wait a little for a running load: with a queue of deploys the lock is rarely free at one instant,
            # and the check of what Triton really serves must not wait for the whole queue.
            if not proc.lock.acquire(timeout=self.reconcile_every):
                continue
            try:
                placement.reconcile_instance(self, instance, proc, hold=self._holder(instance.pk, proc))
            finally:
                proc.lock.release()
        self.tuning.sync()
        pending = self._pending()
        if pending and pending < pending_before:
            # A queue of decisions (a burst of deploys): go on with the next one at once instead of waiting
            # for the interval; a pass that made no progress waits as usual.
            self.poke()

    def _holder(self, instance_id: int, proc: InstanceProcess):
        """Whether a pass applying a stream of decisions on the instance may go on for another interval
        (``placement.reconcile_instance``): not when the agent stops or was revoked, the instance is to stop
        or has a new command (they wait for its lock), another instance of the host has decisions waiting
        (the pass goes over the instances one after another), or after ``HOLD_INTERVALS`` intervals (the
        tuning jobs start between passes)."""
        until = time.monotonic() + HOLD_INTERVALS * self.reconcile_every

        def hold() -> bool:
            instance = self.desired.instance(instance_id)
            if self._stop.is_set() or self.revoked.is_set() or instance is None or time.monotonic() > until:
                return False
            if (
                instance.desired_state != DesiredInstanceState.RUNNING
                or instance.command_seq > proc.command_seq
            ):
                return False
            return not self._instances_waiting() - {instance_id}

        return hold

    def _instances_waiting(self) -> set[int]:
        """The running instances with decisions not applied yet."""
        return {p.instance_id for p in self._waiting_placements()}

    def _pending(self) -> set[tuple[int, int]]:
        """(placement, generation) of decisions not applied yet on a running instance."""
        return {(p.pk, p.generation) for p in self._waiting_placements()}

    def _waiting_placements(self) -> list:
        """The placements on a running instance whose decision is not applied yet."""
        running = {pk for pk, proc in self.processes.items() if proc.running()}
        with self.desired.lock:
            placements = list(self.desired.placements.values())
        return [p for p in placements if not p.is_applied() and p.instance_id in running]
