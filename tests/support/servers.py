"""The real processes tests run, as plain helpers: host agents (with their tritonservers), the gateway (HAProxy)
and a bounded load generator. The fixtures that start and share them are in ``tests/support/plugin.py``."""

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
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from apps.deployments import healing
from apps.deployments.models import Deployment, DeploymentState, PlacementState
from apps.fleet.models import InstanceState, Pool, TritonInstance
from apps.gateway import autoscaling
from apps.gateway.haproxy import AdminSocket, Slots
from apps.registry.models import RegisteredModel
from backend_ge.runtime import free_port
from tests.conftest import wait_for
from tests.support.models import INFER_BODY, expected_output

ROOT = Path(__file__).resolve().parents[2]
requires_haproxy = pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed")

# What an inference host must not hold: the agent gets neither.
PLATFORM_ONLY_ENV = ("DATABASE_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "REDIS_URL")


def agent_command(platform: str, join_token: str, credential_file: Path) -> list[str]:
    """The host agent's command line, as an inference host runs it (with ``cwd=ROOT``): the one place tests
    spell it."""
    return [sys.executable, "-m", "hostagent", "--platform", platform, "--join-token", join_token,
            "--credential-file", str(credential_file)]  # fmt: skip


def agent_env(var_dir: Path, fleet_root: Path, **extra) -> dict:
    """An inference host's environment: the test's without anything only the platform may hold, and nothing
    of the platform importable (``tests/without_django/sitecustomize.py`` refuses Django and the platform's
    packages, so an agent that reached for them fails in the test that started it)."""
    env = {k: v for k, v in os.environ.items() if k not in PLATFORM_ONLY_ENV}
    extra = {k: str(v) for k, v in extra.items()}
    # A test's own PYTHONPATH (a fake runtime, say) comes after the guard, never instead of it.
    path = extra.pop("PYTHONPATH", None) or env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests" / "without_django"), path]))
    env.update(VAR_DIR=str(var_dir), FLEET_ROOT=str(fleet_root))
    env.update(extra)
    return env


def instance_key_headers(url: str) -> dict[str, str]:
    """The key header of the instance at ``host:port`` (every Triton API but health requires it)."""
    port = int(url.rsplit(":", 1)[1].split("/", 1)[0])
    return TritonInstance.objects.get(http_port=port).key_headers()


class Agent:
    """A `python -m hostagent` process for a host created the way staff create one (with one CPU instance on
    free ports): it joins with the host's one-time token and then knows only the platform's URL and its own
    credential - no DATABASE_URL, no broker URL, no Django."""

    def __init__(self, name: str, env: dict, log_path: Path, platform: str, labels: dict | None = None,
                 address: str = "127.0.0.1", wrap: list[str] | None = None):  # fmt: skip
        """``address``: the host's own (its tritonserver binds there); ``wrap``: what the command runs under
        (``ip netns exec <namespace>`` for a host in its own namespace, ``tests/support/netns.py``)."""
        from apps.fleet import services

        self.name = name
        self.ports = [free_port() for _ in range(3)]
        self.log_path = log_path
        self.var_dir = Path(env["VAR_DIR"])
        self.credential_file = self.var_dir / "host-credential"
        self.address = address
        self.host, token = services.create_host(actor=None, name=name, address=address, labels=labels)
        services.create_instance(
            actor=None,
            host=self.host,
            name="cpu-0",
            http_port=self.ports[0],
            grpc_port=self.ports[1],
            metrics_port=self.ports[2],
        )
        self.log = open(log_path, "ab")  # noqa: SIM115 - the child writes to it until stop()
        self.process = subprocess.Popen(
            [*(wrap or []), *agent_command(platform, token, self.credential_file)],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    @property
    def url(self) -> str:
        return f"{self.address}:{self.ports[0]}"

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, timeout: float = 60) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self.log.close()
        return self.process.returncode


def ready_instance(start_agent, name: str, **env):
    """Start an agent and wait for its instance to be READY: (agent, instance)."""
    agent = start_agent(name, **env)
    instance = wait_for(
        lambda: TritonInstance.objects.filter(host__name=name, state=InstanceState.READY).first(),
        120,
        f"the instance of {name} to be READY\n{agent.output()}",
    )
    return agent, instance


def pool_hosts(start_agent, artifact_root, budget_mb: int, names=("host-a",)):
    """Pool ``cpu`` with ``budget_mb`` of memory per instance and an agent per name joined to it by label (a
    heartbeat every 0.5 s, each with its own fleet root), every instance READY: (pool, {name: agent})."""
    pool = Pool.objects.create(name="cpu", memory_budget_mb=budget_mb)
    agents = {
        name: start_agent(
            name,
            labels={"pool": "cpu"},
            AGENT_HEARTBEAT_INTERVAL="0.5",
            FLEET_ROOT=Path(artifact_root).parent / f"fleet-{name}",
        )  # fmt: skip
        for name in names
    }
    for name, agent in agents.items():
        wait_for(
            lambda n=name: TritonInstance.objects.filter(host__name=n, state=InstanceState.READY).exists(),
            120,
            f"the instance of {name} to be READY\n{agent.output()}",
        )
    return pool, agents


def deploy_to_pool(client, team_slug: str, model_slug: str, replicas: int = 1, agent: Agent | None = None):
    """Deploy version 1 by intent (``replicas`` in pool ``cpu``) through the API and wait for SERVING; the
    agent's log, when given, is in the message of a deployment that never got there."""
    return wait_serving(request_pool_deployment(client, team_slug, model_slug, replicas), agent)


def request_pool_deployment(client, team_slug: str, model_slug: str, replicas: int = 1) -> int:
    """Ask the API for ``replicas`` of version 1 in pool ``cpu``: the new deployment's id."""
    response = client.post(
        f"/api/v1/teams/{team_slug}/deployments/",
        {"model": model_slug, "version": 1, "replicas": replicas, "pool": "cpu"},
        format="json",
    )
    assert response.status_code == 201, response.json()
    return response.json()["id"]


def wait_serving(pk: int, agent: Agent | None = None) -> Deployment:
    return wait_for(
        lambda: Deployment.objects.filter(pk=pk, state=DeploymentState.SERVING).first(),
        120,
        f"deployment {pk} to be SERVING\n{agent.output() if agent else ''}",
    )


def serve_in_pool(client, owner, team, start_agent, make_scaler_version, artifact_root, budget_mb: int,
                  scales: dict[str, float]) -> tuple[Pool, Agent, dict[str, int]]:  # fmt: skip
    """One agent (``host-a``) in pool ``cpu`` and a scaler model per slug in ``scales`` (output = input *
    scale), each deployed there as one replica and SERVING: (pool, agent, {slug: deployment id})."""
    pool, agents = pool_hosts(start_agent, artifact_root, budget_mb)
    agent = agents["host-a"]
    deployments = {}
    for slug, scale in scales.items():  # all asked for before any is waited on: the agent loads them together
        model = RegisteredModel.objects.create(team=team, name=slug, slug=slug, created_by=owner)
        make_scaler_version(model, scale)
        deployments[slug] = request_pool_deployment(client, team.slug, slug)
    for pk in deployments.values():
        wait_serving(pk, agent)
    return pool, agent, deployments


def asleep_and_unloaded(pk: int) -> bool:
    """The deployment is scaled to zero and none of its replicas is still loaded."""
    deployment = Deployment.objects.get(pk=pk)
    return (
        deployment.replicas == 0 and not deployment.placements.exclude(state=PlacementState.UNLOADED).exists()
    )


def ticking(predicate):
    """A ``wait_for`` predicate that runs the autoscaler's and the scheduler's beat ticks before each look."""

    def run():
        autoscaling.autoscale()
        healing.tick()
        return predicate()

    return run


def while_the_scheduler_ticks(call, timeout: float = 90) -> list:
    """Run ``call`` (a request that waits for a replica, say) in a thread while the scheduler's beat ticks
    every 0.5 s, as beat runs it, for at most ``timeout`` s: ``[its result]``, or ``[]`` if it never returned."""
    answered: list = []
    thread = threading.Thread(target=lambda: answered.append(call()), daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while thread.is_alive() and time.monotonic() < deadline:
        healing.tick()
        thread.join(0.5)
    return answered


def timed_infer(gateway: GatewayProcess, model: str, token: str, timeout: float = 90):
    """One request with a client timeout past the activation timeout (a held request is answered within it):
    (status, headers, seconds, JSON body); status 0 with the error as the body if the connection failed."""
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=timeout)
    started = time.monotonic()
    try:
        connection.request("POST", f"/v2/models/{model}/infer", body=INFER_BODY,
                           headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})  # fmt: skip
        response = connection.getresponse()
        raw = response.read()
    except OSError as exc:
        return 0, {}, time.monotonic() - started, {"error": repr(exc)}
    finally:
        connection.close()
    try:
        body = json.loads(raw)
    except ValueError:
        body = {"raw": raw[:300].decode(errors="replace")}
    return response.status, dict(response.getheaders()), time.monotonic() - started, body


def deploy(client, team_slug: str, model_slug: str, version: int, instances) -> Deployment:
    """Deploy through the API and wait for SERVING."""
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


def poll_api_until_serving(client, team_slug: str, pk: int, version: int, timeout: float = 180):
    """Poll the deployment API as a pipeline does (every 100 ms) until it says SERVING ``version``: (the
    deployment's body, when). SERVING means callable, so the caller may call the model at once."""
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        body = client.get(f"/api/v1/teams/{team_slug}/deployments/{pk}/").json()
        seen.append((body["state"], body["waiting_for"]))
        if body["state"] == "SERVING" and body["active_version"] == version:
            return body, time.time()
        time.sleep(0.1)
    raise AssertionError(f"deployment {pk} never SERVING v{version}; states seen: {seen[-10:]}")


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

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        if self.running:
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

    def admin(self) -> AdminSocket:
        return AdminSocket(self.directory / "admin.sock")


def grpc_infer(url: str, model: str, token: str) -> np.ndarray:
    client = grpcclient.InferenceServerClient(url)
    try:
        data = np.array([[1.0, 2.0, 3.0, 4.0]], dtype=np.float32)
        item = grpcclient.InferInput("input", list(data.shape), "FP32")
        item.set_data_from_numpy(data)
        # tritonclient.grpc refuses a header named "Authorization"; gRPC metadata keys are lower case.
        result = client.infer(model, [item], headers={"authorization": f"Bearer {token}"}, client_timeout=10)
        return result.as_numpy("output")
    finally:
        client.close()


def grpc_answers(gateway: GatewayProcess, model: str, token: str) -> bool:
    """Whether a gRPC inference of ``model`` through the gateway succeeds now."""
    try:
        grpc_infer(gateway.grpc_url, model, token)
    except InferenceServerException:
        return False
    return True


def grpc_error(url: str, model: str, token: str) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        grpc_infer(url, model, token)
    return caught.value


def team_rate_drained(gateway: GatewayProcess, team_slug: str, timeout: float = 10) -> None:
    """Wait until HAProxy's request rate of ``team_slug`` (``team_rates``, a 1 s period) has fallen to 0, so
    the next requests meet the whole per-second limit; HAProxy's rate is a sliding mix of the current and the
    previous period, so this takes up to two periods after the last request."""

    def drained() -> bool:
        answer = gateway.admin().ask(f"show table team_rates key {team_slug}")
        rate = next((f for f in answer.split() if f.startswith("gpc0_rate(")), None)
        return rate is None or rate.endswith("=0")

    wait_for(drained, timeout, f"team {team_slug}'s request rate at the gateway to fall to 0")


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
        self.failed_sent_at: list[float] = []  # when each failed request was sent (time.monotonic())
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
            sent_at = time.monotonic()
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
                    self.failed_sent_at.append(sent_at)
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


class GrpcLoad(Load):
    """:class:`Load` over gRPC: each thread a ``tritonclient.grpc`` client (one HTTP/2 connection) calling
    ``ModelInfer`` through the gateway's gRPC frontend, paced and bounded the same way, no retry."""

    def _run(self) -> None:
        client = grpcclient.InferenceServerClient(self.gateway.grpc_url)
        data = np.array([[1.0, 2.0, 3.0, 4.0]], dtype=np.float32)
        item = grpcclient.InferInput("input", list(data.shape), "FP32")
        item.set_data_from_numpy(data)
        headers = {"authorization": f"Bearer {self.token}"}
        next_at = time.monotonic()
        while not self._stop.is_set() and time.monotonic() < self.deadline and self.total < self.max_requests:
            next_at = max(next_at + self.interval, time.monotonic() - self.interval)
            if (pause := next_at - time.monotonic()) > 0:
                self._stop.wait(pause)
            try:
                output = client.infer(self.model, [item], headers=headers, client_timeout=30).as_numpy(
                    "output"
                )
                status, detail = 200, ""
            except InferenceServerException as exc:
                status, detail = exc.status() or "error", exc.message()
            with self._lock:
                self.statuses[status] += 1
                if status != 200:
                    self.failures.append(f"{status}: {detail[:200]}")
                else:
                    self.outputs[float(output[0][0])] += 1
        client.close()


def slot_of(gateway: GatewayProcess, logical: str) -> str:
    """The HAProxy backend (slot) that holds ``d<id>`` (or its canary ``d<id>c``) now."""
    owners = Slots.read(gateway.directory / "slots.map", 1).owners
    return next((slot for slot, owner in owners.items() if owner == logical), "absent")


def server_row(gateway: GatewayProcess, logical: str, key: str, grpc: bool = False) -> dict[str, str]:
    """The server's row in HAProxy's own statistics (``status``: UP, DOWN, MAINT, ...; ``scur``: requests in
    flight; ``wretr``/``wredis``: requests retried / sent to another server), in the slot or its gRPC twin."""
    backend = slot_of(gateway, logical)
    backend = f"g{backend}" if grpc else backend
    csv = gateway.admin().ask("show stat")
    header = csv.splitlines()[0].lstrip("# ").split(",")
    for line in csv.splitlines()[1:]:
        row = dict(zip(header, line.split(","), strict=False))
        if row.get("pxname") == backend and row.get("svname") == key:
            return row
    return {}


def server_status(gateway: GatewayProcess, logical: str, key: str) -> str:
    """The server's status column (UP, DOWN, MAINT, ...) in HAProxy's own statistics."""
    return server_row(gateway, logical, key).get("status", "absent")


def worker_pid(gateway: GatewayProcess) -> int | None:
    """HAProxy's worker: a reload replaces it, so an unchanged pid means no reload happened."""
    return gateway.admin().worker_pid()


def instance_of(agent) -> TritonInstance:
    return wait_for(
        lambda: TritonInstance.objects.filter(host__name=agent.name, state=InstanceState.READY).first(),
        120,
        f"{agent.name}'s instance to be READY\n{agent.output()}",
    )


def deployment_settled(deployment: Deployment, timeout: float = 120) -> Deployment:
    def settled():
        row = Deployment.objects.get(pk=deployment.pk)
        return (
            row
            if row.state in (DeploymentState.SERVING, DeploymentState.FAILED)
            and row.target_version_id is None
            else None
        )

    return wait_for(settled, timeout, f"deployment {deployment.pk} to settle")


def seed_example_3(url: str, model_name: str) -> np.ndarray:
    """Seed example 3, unchanged but for the model name the platform gave the model."""
    client = httpclient.InferenceServerClient(url=url)
    assert client.is_server_ready()
    assert client.is_model_ready(model_name)
    input_data = np.random.randn(1, 3, 224, 224).astype(np.float32)
    inputs = [httpclient.InferInput("input", input_data.shape, "FP32")]
    inputs[0].set_data_from_numpy(input_data)
    outputs = [httpclient.InferRequestedOutput("output")]
    results = client.infer(
        model_name=model_name, inputs=inputs, outputs=outputs, headers=instance_key_headers(url)
    )
    output_data = results.as_numpy("output")
    assert output_data.shape == (1, 1000)
    top5 = np.argsort(output_data[0])[-5:][::-1]
    assert len(top5) == 5
    np.testing.assert_allclose(output_data, expected_output(1.0, input_data), rtol=1e-4, atol=1e-5)
    return output_data
