"""Fixtures for gateway tests: the real `manage.py gateway` (HAProxy) in front of real host agents and
tritonservers, a model small enough to call thousands of times, and a bounded load generator."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from apps.deployments.models import Deployment, DeploymentState
from apps.fleet.models import InstanceState, TritonInstance
from apps.gateway.haproxy import AdminSocket, Slots
from apps.registry.models import ModelVersion, RegisteredModel
from backend_ge.runtime import free_port
from tests.conftest import subprocess_database_url, wait_for
from tests.factories import ready_onnx_version
from tests.fleet.conftest import artifact_root, start_agent  # noqa: F401 - shared fixtures

ROOT = Path(__file__).resolve().parents[2]
requires_haproxy = pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed")


def scaler_onnx(scale: float) -> bytes:
    """input [N,4] -> output [N,4] = input * scale: versions are told apart by their outputs."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["input", "s"], ["output"])],
        "scaler",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", 4])],
        initializer=[helper.make_tensor("s", TensorProto.FLOAT, [1], [scale])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model.SerializeToString()


INFER_BODY = json.dumps(
    {"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [1.0, 2.0, 3.0, 4.0]}]}
).encode()


@pytest.fixture
def make_scaler_version(artifact_root, tmp_path):  # noqa: F811 - the shared fixture
    def _make(model: RegisteredModel, scale: float = 1.0) -> ModelVersion:
        return ready_onnx_version(
            model, scaler_onnx(scale), tmp_path, preferred_batch_sizes=(4, 8), max_queue_delay_us=100
        )

    return _make


class GatewayProcess:
    """`manage.py gateway` with HAProxy on free loopback ports."""

    def __init__(self, env: dict, directory: Path, log_path: Path) -> None:
        self.env, self.directory, self.log_path = env, directory, log_path
        self.process: subprocess.Popen | None = None

    @property
    def port(self) -> int:
        return int(self.env["GATEWAY_BIND"].rsplit(":", 1)[1])

    @property
    def grpc_url(self) -> str:
        return self.env["GATEWAY_GRPC_BIND"]

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> GatewayProcess:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child writes to it
        self.process = subprocess.Popen(
            [sys.executable, "manage.py", "gateway"], cwd=ROOT, env=self.env, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        log.close()
        try:
            wait_for(
                lambda: self.get("/v2/health/ready")[0] == 200, 30, f"the gateway to answer\n{self.output()}"
            )
        except AssertionError:
            self.stop()  # a command that never answered would keep its database connection past the test
            raise
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def request(self, method: str, path: str, token: str | None = None, body: bytes | None = None):
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        headers = {"Content-Type": "application/json"} if body else {}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            raw = response.read()
        except OSError:
            return 0, {}
        finally:
            connection.close()
        try:
            return response.status, json.loads(raw) if raw else {}
        except ValueError:
            return response.status, {"raw": raw.decode(errors="replace")}

    def get(self, path: str, token: str | None = None):
        return self.request("GET", path, token)

    def infer(self, model: str, token: str | None, version: int | None = None):
        path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
        return self.request("POST", path, token, INFER_BODY)


@pytest.fixture
def gateway_env(tmp_path, artifact_root):  # noqa: F811 - the shared fixture
    env = os.environ.copy()
    env.update(
        DATABASE_URL=subprocess_database_url(),
        ARTIFACT_ROOT=str(artifact_root),
        DEBUG="1",
        GATEWAY_DIR=str(tmp_path / "gateway"),
        GATEWAY_BIND=f"127.0.0.1:{free_port()}",
        GATEWAY_GRPC_BIND=f"127.0.0.1:{free_port()}",
        GATEWAY_STATS_BIND=f"127.0.0.1:{free_port()}",
        GATEWAY_SYNC_INTERVAL_MS="500",
        GATEWAY_CHECK_INTERVAL_MS="300",
    )
    return env


@pytest.fixture
def start_gateway(gateway_env, tmp_path, settings):
    """Start (or restart) the gateway; the test process pokes it through the same directory."""
    settings.GATEWAY_DIR = Path(gateway_env["GATEWAY_DIR"])
    gateways: list[GatewayProcess] = []

    def _start() -> GatewayProcess:
        gateway = GatewayProcess(gateway_env, Path(gateway_env["GATEWAY_DIR"]), tmp_path / "gateway.log")
        gateways.append(gateway)  # before start(): stopped at teardown even if it never answered
        return gateway.start()

    yield _start
    for gateway in gateways:
        gateway.stop()


def ready_instance(start_agent, name: str, **env):  # noqa: F811 - the shared fixture
    agent = start_agent(name, **env)
    instance = wait_for(
        lambda: TritonInstance.objects.filter(host__name=name, state=InstanceState.READY).first(),
        120,
        f"the instance of {name} to be READY\n{agent.output()}",
    )
    return agent, instance


def deploy(client, team_slug: str, model_slug: str, version: int, instances) -> Deployment:
    response = client.post(
        f"/api/v1/teams/{team_slug}/deployments/",
        {"model": model_slug, "version": version, "instances": [i.pk for i in instances]},
        format="json",
    )
    assert response.status_code == 201, response.json()
    return wait_for(
        lambda: Deployment.objects.filter(pk=response.json()["id"], state=DeploymentState.SERVING).first(),
        120,
        "the deployment to be SERVING",
    )


class Load:
    """Threads calling one model through the gateway until stopped; bounded in count and time.

    Each thread is paced to ``rate`` requests per second, so a test sees the same traffic on a fast machine and a
    slow one, and the count bound (the most the pace allows in ``max_seconds``) is never what ends a load early.
    """

    def __init__(self, gateway: GatewayProcess, model: str, token: str, threads: int = 4,
                 rate: float = 150.0, max_seconds: float = 120.0) -> None:  # fmt: skip
        self.gateway, self.model, self.token = gateway, model, token
        self.interval = 1.0 / rate
        self.max_requests = int(threads * rate * max_seconds) + threads
        self.deadline = time.monotonic() + max_seconds
        self.statuses: Counter = Counter()
        self.failures: list[str] = []
        self.outputs: Counter = Counter()
        self.closed_by_gateway = 0  # answers that came with "Connection: close" (none expected)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    @property
    def total(self) -> int:
        return sum(self.statuses.values())

    def _run(self) -> None:
        # A plain keep-alive client: no resend, no retry. Every request that did not get a 200 is a failure.
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.token}"}
        path = f"/v2/models/{self.model}/infer"
        connection = self._connect()
        next_at = time.monotonic()
        while not self._stop.is_set() and time.monotonic() < self.deadline and self.total < self.max_requests:
            next_at = max(next_at + self.interval, time.monotonic() - self.interval)
            if (pause := next_at - time.monotonic()) > 0:
                self._stop.wait(pause)
            try:
                connection.request("POST", path, body=INFER_BODY, headers=headers)
                response = connection.getresponse()
                raw, status = response.read(), response.status
                if response.will_close:  # counted below; the next request needs a new connection
                    connection.close()
                    connection = self._connect()
                    status = -status
            except (OSError, http.client.HTTPException) as exc:
                connection.close()
                connection = self._connect()
                status, raw = 0, repr(exc).encode()
            with self._lock:
                if status < 0:
                    status = -status
                    self.closed_by_gateway += 1
                self.statuses[status] += 1
                if status != 200:
                    self.failures.append(f"{status}: {raw[:200]!r}")
                else:
                    self.outputs[json.loads(raw)["outputs"][0]["data"][0]] += 1
        connection.close()

    def _connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.gateway.port, timeout=30)

    @property
    def running(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)

    def wait_for_requests(self, count: int, timeout: float = 30) -> None:
        target = self.total + count

        def sent() -> bool:
            assert self.running or self.total >= target, f"the load ended at its bound ({self.statuses})"
            return self.total >= target

        wait_for(sent, timeout, f"{count} more requests ({self.statuses})")


def slot_of(gateway: GatewayProcess, logical: str) -> str:
    """The HAProxy backend (slot) that holds ``d<id>`` (or its canary ``d<id>c``) now."""
    owners = Slots.read(gateway.directory / "slots.map", 1).owners
    return next((slot for slot, owner in owners.items() if owner == logical), "absent")


def server_status(gateway: GatewayProcess, logical: str, key: str) -> str:
    """The server's status column (UP, DOWN, MAINT, ...) in HAProxy's own statistics."""
    backend = slot_of(gateway, logical)
    csv = AdminSocket(gateway.directory / "admin.sock").ask("show stat")
    header = csv.splitlines()[0].lstrip("# ").split(",")
    for line in csv.splitlines()[1:]:
        row = dict(zip(header, line.split(","), strict=False))
        if row.get("pxname") == backend and row.get("svname") == key:
            return row["status"]
    return "absent"


def worker_pid(gateway: GatewayProcess) -> int | None:
    """HAProxy's worker: a reload replaces it, so an unchanged pid means no reload happened."""
    return AdminSocket(gateway.directory / "admin.sock").worker_pid()


def output_of(answer: dict) -> list[float]:
    return np.array(answer["outputs"][0]["data"]).tolist()
