"""Test hosts on a real network, and the faults real networks have.

Each test host lives in its own network namespace with its own address on a bridge in the root namespace; the
platform (the live server, on loopback), the gateway (HAProxy) and the databases stay in the root namespace.
An agent reaches the platform only through a :class:`FaultProxy` bound to the bridge address, which forwards
to the live server and can delay or drop what passes; the gateway reaches each host's tritonserver at the
host's own address across the bridge.

Faults are functions of :class:`TestNetwork`:

* ``partition(host, platform=True, gateway=False)``: iptables inside the host's namespace drops the packets of
  the agent API (the proxy's port) and/or of inference (the instance's HTTP and gRPC ports, what the gateway
  calls) - both sides are in the root namespace, so the partition is by port, as a firewall between zones
  would cut it; ``heal(host)`` flushes the rules;
* ``proxy.set(delay_s=..., drop_rate=...)``: a slow or lossy agent <-> platform link;
* ``kill_host(host)``: SIGKILL to every process in the host's namespace (agent, tritonserver, stubs).

Everything made is named ``gd<pid>...`` (namespaces, bridge, veths): :func:`remove_leftovers` removes those of a
run whose process is gone (a crashed run), and :meth:`TestNetwork.close` removes this run's, even after a
failed test. Only the project's own test hosts are reached, in namespaces made here.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

PREFIX = "gd"
RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a reset


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why this machine cannot run the network drills, or None: root, ``ip netns`` and ``iptables``."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    try:
        rules = _run("ip", "netns", "exec", probe, "iptables", "-L", "-n", check=False)
        if rules.returncode != 0:
            return f"iptables inside a namespace failed: {rules.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(namespace: str) -> None:
    pids = _run("ip", "netns", "pids", namespace, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def remove_leftovers() -> list[str]:
    """Remove the namespaces and links of earlier runs whose process is gone: what a crashed run left."""
    removed = []
    pattern = re.compile(rf"^{PREFIX}(\d+)")
    namespaces = [
        line.split()[0] for line in _run("ip", "netns", "list", check=False).stdout.splitlines() if line
    ]
    links = re.findall(r"^\d+: ([^:@]+)", _run("ip", "-o", "link", "show", check=False).stdout, re.M)
    for name in namespaces + links:
        match = pattern.match(name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        if name in namespaces:
            _kill_namespace_processes(name)
            _run("ip", "netns", "del", name, check=False)
        else:
            _run("ip", "link", "del", name, check=False)
        removed.append(name)
    return removed


class FaultProxy:
    """A threaded TCP proxy between agents and the platform: ``delay_s`` before each chunk it forwards (each
    way); ``drop_rate`` of new connections, and of requests on open ones, lost with a reset (nothing of them
    forwarded). Counts connections and the HTTP request lines that pass, by path, so a test sees a poll storm."""

    def __init__(self, bind: str, target: tuple[str, int]) -> None:
        self.target = target
        self.delay_s = 0.0
        self.drop_rate = 0.0
        self.connections = 0
        self.dropped = 0
        self.requests: Counter = Counter()
        self._lock = threading.Lock()
        self._draws = 0
        self._listener = socket.create_server((bind, 0), backlog=256)
        self.address = f"{bind}:{self._listener.getsockname()[1]}"
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._sockets: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True, name="fault-proxy").start()

    def set(self, *, delay_s: float = 0.0, drop_rate: float = 0.0) -> None:
        self.delay_s, self.drop_rate = delay_s, drop_rate

    def count(self, fragment: str) -> int:
        """Requests seen whose path contains ``fragment``."""
        with self._lock:
            return sum(n for path, n in self.requests.items() if fragment in path)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
            if self._lose():
                # A connection lost as it opens, as a flaky link shows it: reset, nothing forwarded.
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET)
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets.update((client, upstream))
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, upstream: bool) -> None:
        try:
            while data := source.recv(65536):
                if upstream and self._note_requests(data) and self._lose():
                    # The connection dies with this request unsent, as on a flaky link: a reset.
                    for sock in (source, sink):
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET)
                    return
                if self.delay_s:
                    time.sleep(self.delay_s)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            with self._lock:
                self._sockets.difference_update((source, sink))

    def _lose(self) -> bool:
        """Whether this connection or request is lost: exactly ``drop_rate`` of them, evenly spread (a test
        sees the same losses on every run)."""
        with self._lock:
            self._draws += 1
            lost = self._draws * self.drop_rate >= self.dropped + 1
            self.dropped += lost
        return lost

    def _note_requests(self, data: bytes) -> int:
        paths = re.findall(rb"(?:^|\r\n)(?:GET|POST|PUT|PATCH|DELETE) (\S+) HTTP/1\.[01]\r\n", data)
        with self._lock:
            for path in paths:
                self.requests[path.decode(errors="replace").split("?", 1)[0]] += 1
        return len(paths)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()


@dataclass
class NetHost:
    """One test host: its namespace, its address on the bridge, the ports its tritonserver serves on (what
    the gateway calls), and the iptables rules cutting it off now."""

    name: str
    namespace: str
    address: str
    inference_ports: list[int] = field(default_factory=list)
    cut: set[str] = field(default_factory=set)

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.namespace]


class TestNetwork:
    """A bridge with an address in the root namespace, a namespace per host, a fault proxy to the platform."""

    __test__ = False  # not a test class, whatever its name says to pytest

    def __init__(self, platform: tuple[str, int]) -> None:
        remove_leftovers()
        self.tag = f"{PREFIX}{os.getpid()}"
        self.subnet = f"10.231.{os.getpid() % 240 + 10}"
        self.gateway_address = f"{self.subnet}.1"
        self.bridge = f"{self.tag}b"
        self.hosts: dict[str, NetHost] = {}
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        try:
            _run("ip", "addr", "add", f"{self.gateway_address}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            self.proxy = FaultProxy(self.gateway_address, platform)
        except BaseException:
            self.close()
            raise

    @property
    def platform_url(self) -> str:
        """The platform as agents on the test hosts reach it: through the fault proxy, over the bridge."""
        return f"http://{self.proxy.address}"

    def add_host(self, name: str) -> NetHost:
        index = len(self.hosts) + 1
        host = NetHost(name, f"{self.tag}-{index}", f"{self.subnet}.{10 + index}")
        self.hosts[name] = host
        outside, inside = f"{self.tag}h{index}", f"{self.tag}n{index}"
        _run("ip", "netns", "add", host.namespace)
        _run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
        _run("ip", "link", "set", outside, "master", self.bridge)
        _run("ip", "link", "set", outside, "up")
        _run("ip", "link", "set", inside, "netns", host.namespace)
        _run("ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", inside)
        _run("ip", "-n", host.namespace, "link", "set", inside, "up")
        _run("ip", "-n", host.namespace, "link", "set", "lo", "up")
        return host

    # --- faults ---------------------------------------------------------------------------------------------
    def _iptables(self, host: NetHost, *rule: str) -> None:
        _run("ip", "netns", "exec", host.namespace, "iptables", *rule)

    def partition(self, name: str, *, platform: bool = True, gateway: bool = False) -> None:
        """Drop, inside the host's namespace, the agent API's packets (``platform``) and/or the inference
        ports' packets (``gateway``), both ways: the peer sees silence, as across a real partition."""
        host = self.hosts[name]
        if platform and "platform" not in host.cut:
            port = str(self.proxy.port)
            self._iptables(
                host, "-A", "OUTPUT", "-d", self.gateway_address, "-p", "tcp", "--dport", port, "-j", "DROP"
            )
            self._iptables(
                host, "-A", "INPUT", "-s", self.gateway_address, "-p", "tcp", "--sport", port, "-j", "DROP"
            )
            host.cut.add("platform")
        if gateway and "gateway" not in host.cut:
            for port in map(str, host.inference_ports):
                self._iptables(
                    host,
                    "-A",
                    "INPUT",
                    "-s",
                    self.gateway_address,
                    "-p",
                    "tcp",
                    "--dport",
                    port,
                    "-j",
                    "DROP",
                )
                self._iptables(
                    host,
                    "-A",
                    "OUTPUT",
                    "-d",
                    self.gateway_address,
                    "-p",
                    "tcp",
                    "--sport",
                    port,
                    "-j",
                    "DROP",
                )
            host.cut.add("gateway")

    def heal(self, name: str) -> None:
        host = self.hosts[name]
        self._iptables(host, "-F")
        host.cut.clear()

    def kill_host(self, name: str) -> None:
        """Every process in the host's namespace gets SIGKILL: the machine is gone."""
        _kill_namespace_processes(self.hosts[name].namespace)

    def close(self) -> None:
        proxy = getattr(self, "proxy", None)
        if proxy is not None:
            proxy.close()
        for host in self.hosts.values():
            _kill_namespace_processes(host.namespace)
        for host in self.hosts.values():
            _run("ip", "netns", "del", host.namespace, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        for index in range(1, len(self.hosts) + 1):  # a veth whose namespace went first is gone with it
            _run("ip", "link", "del", f"{self.tag}h{index}", check=False)
