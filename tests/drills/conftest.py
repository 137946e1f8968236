"""Fixtures of the network drills: test hosts in network namespaces (``tests/support/netns.py``), each with a
real agent and tritonserver, the platform reached through the fault proxy, the drill's figures recorded."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from apps.deployments import healing
from apps.fleet.models import InstanceState, Pool, TritonInstance
from tests.conftest import wait_for
from tests.support import netns
from tests.support.servers import ROOT, Agent, agent_env

# The drills' own short settings: a host unheard of for GRACE_S s is lost; agents heartbeat well inside it.
GRACE_S = 3
HEARTBEAT_S = "0.5"


@pytest.fixture(scope="session")
def _network_unavailable() -> str | None:
    return netns.unavailable()


@pytest.fixture
def network(_network_unavailable, live_server, settings):
    """A bridge and the fault proxy to the live server; removed at the end (its hosts too), pass or fail."""
    if _network_unavailable:
        pytest.skip(f"network drills need network namespaces: {_network_unavailable}")
    # Agents call the platform by the proxy's bridge address, not the live server's own.
    settings.ALLOWED_HOSTS = ["*"]
    url = urlsplit(live_server.url)
    net = netns.TestNetwork(("127.0.0.1", url.port))
    yield net
    net.close()


@pytest.fixture
def start_net_agent(network, tmp_path, artifact_root):
    """Start a host in its own namespace with its own address: its agent (joined through the fault proxy),
    its tritonserver bound to that address, its own fleet root."""
    agents: list[Agent] = []

    def _start(name: str, labels: dict | None = None, **extra) -> Agent:
        host = network.add_host(name)
        var_dir = tmp_path / f"agent-{name}-var"
        var_dir.mkdir()
        env = agent_env(var_dir, Path(artifact_root).parent / f"fleet-{name}", AGENT_HEARTBEAT_INTERVAL=HEARTBEAT_S,
                        **extra)  # fmt: skip
        agent = Agent(name, env, tmp_path / f"agent-{name}.log", network.platform_url, labels,
                      address=host.address, wrap=host.exec_prefix())  # fmt: skip
        host.inference_ports = agent.ports[:2]  # what the gateway calls: HTTP and gRPC
        agents.append(agent)
        return agent

    yield _start
    for agent in agents:
        agent.stop(timeout=20)


@pytest.fixture
def pool_of_net_hosts(start_net_agent, settings):
    """Pool ``cpu`` and hosts in it, each in its own namespace, every instance READY: {name: (agent, instance)}."""
    settings.SCHEDULER_HOST_GRACE_S = GRACE_S

    def _make(names, budget_mb: int = 2048):
        Pool.objects.create(name="cpu", memory_budget_mb=budget_mb)
        agents = {name: start_net_agent(name, labels={"pool": "cpu"}) for name in names}
        hosts = {}
        for name, agent in agents.items():
            instance = wait_for(
                lambda n=name: TritonInstance.objects.filter(host__name=n, state=InstanceState.READY).first(),
                120,
                f"the instance of {name} to be READY\n{agent.output()}",
            )
            hosts[name] = (agent, instance)
        return hosts

    return _make


@pytest.fixture(autouse=True)
def _no_rate_limit(db, team):
    team.quota_requests_per_second = 1_000_000
    team.quota_instances = 100  # replicas of the 20-model drill
    team.save()


def ticking(predicate):
    """A wait_for predicate that runs the beat's scheduler tick before each look (beat is not running)."""

    def run():
        healing.tick()
        return predicate()

    return run


class Stopwatch:
    def __init__(self) -> None:
        self.started = time.monotonic()

    def lap(self) -> float:
        return round(time.monotonic() - self.started, 2)


def record_figures(name: str, **figures) -> dict:
    """A drill's figures: printed, and appended to ``$DRILL_FIGURES`` (one JSON line per drill) when set -
    ``benchmarks/drills.py`` reads them from there."""
    row = {"name": name, "sent": 0, "failed": 0, "detect_s": None, "converge_s": None,
           "duplicate_placements": 0, "rows_lost": 0, **figures}  # fmt: skip
    print(f"drill {json.dumps(row)}")
    if path := os.environ.get("DRILL_FIGURES"):
        with open(path, "a") as out:
            out.write(json.dumps(row) + "\n")
    return row


class PlatformWeb:
    """The platform's web process as production runs it (gunicorn, gthread, ``serving_platform.gunicorn_hooks``)
    on the test database, on one loopback port kept across restarts: the agents reach it through the fault
    proxy. For the drills that restart the platform under agents (the live server cannot be restarted)."""

    def __init__(self, log_path: Path, settings) -> None:
        from backend_ge.runtime import free_port
        from tests.conftest import subprocess_database_url

        self.port = free_port()
        self.log_path = log_path
        self.env = {
            **os.environ, "DATABASE_URL": subprocess_database_url(), "DEBUG": "1", "ALLOWED_HOSTS": "*",
            "ARTIFACT_ROOT": str(settings.ARTIFACT_ROOT), "GATEWAY_DIR": str(settings.GATEWAY_DIR),
            "WEB_THREADS": "24", "AGENT_LONG_POLL_MAX_WAITERS": "8",
        }  # fmt: skip
        self.process: subprocess.Popen | None = None

    def start(self) -> PlatformWeb:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child writes to it
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "serving_platform.wsgi", "--config",
             "python:serving_platform.gunicorn_hooks", "--bind", f"127.0.0.1:{self.port}", "--workers", "1",
             "--threads", "24", "--worker-class", "gthread", "--timeout", "120"],
            cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        log.close()
        wait_for(self._answers, 30, f"the platform's web process to answer\n{self.output()}")
        return self

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"GET /agent/v1/desired-state HTTP/1.0\r\nHost: x\r\n\r\n")
                return sock.recv(12).startswith(b"HTTP/1.")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL to the whole process group (master and workers): a crash, not a graceful stop."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


@pytest.fixture
def platform_web(network, tmp_path, settings, start_gateway):
    """The platform's web process in a subprocess, with the fault proxy pointed at it (before any agent joins).
    The module's gateway is started first so its directory (where the web process pokes it) is known."""
    web = PlatformWeb(tmp_path / "web.log", settings)
    web.start()
    network.proxy.target = ("127.0.0.1", web.port)
    yield web
    web.kill()
