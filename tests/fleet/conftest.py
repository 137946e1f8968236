"""Fixtures for fleet tests: READY versions made by the real ONNX preparation path, and host agents run as
real `python -m hostagent` processes with real tritonservers, talking to the test's live server over the
agent API."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from apps.registry.models import ModelVersion, RegisteredModel
from backend_ge.runtime import free_port
from tests.factories import ready_onnx_version

ROOT = Path(__file__).resolve().parents[2]


def classifier_onnx(scale: float) -> bytes:
    """Seed example 3's interface (input [N,3,224,224] -> output [N,1000]) in a model small enough to load in
    a moment; ``scale`` makes versions distinguishable by their outputs."""
    weights = (np.arange(3 * 1000, dtype=np.float32).reshape(3, 1000) / 3000.0) * scale
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["input", "axes"], ["pooled"], keepdims=0),
            helper.make_node("MatMul", ["pooled", "w"], ["output"]),
        ],
        "classifier",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 224, 224])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", 1000])],
        initializer=[
            helper.make_tensor("axes", TensorProto.INT64, [2], [2, 3]),
            helper.make_tensor("w", TensorProto.FLOAT, weights.shape, weights.flatten().tolist()),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model.SerializeToString()


def expected_output(scale: float, batch: np.ndarray) -> np.ndarray:
    weights = (np.arange(3 * 1000, dtype=np.float32).reshape(3, 1000) / 3000.0) * scale
    return batch.mean(axis=(2, 3)) @ weights


@pytest.fixture
def artifact_root(settings):
    """The artifact store, beside the agents' fleet root (``<its parent>/fleet``) in a fresh 0700 directory
    outside pytest's temp root: pytest keeps that one 0700, resetting the traverse access an agent running
    as root grants its Triton users on the way to the fleet root."""
    base = Path(tempfile.mkdtemp(prefix="ge-fleet-test-"))
    settings.ARTIFACT_ROOT = base / "artifacts"
    yield settings.ARTIFACT_ROOT
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def make_ready_version(team, owner, artifact_root, tmp_path):
    """A READY version converted by the real ONNX path (checker, shape inference, onnxruntime test run)."""

    def _make(
        model: RegisteredModel | None = None, scale: float = 1.0, slug: str = "classifier"
    ) -> ModelVersion:
        if model is None:
            model = RegisteredModel.objects.create(team=team, name=slug.title(), slug=slug, created_by=owner)
        return ready_onnx_version(
            model, classifier_onnx(scale), tmp_path, created_by=owner,
            preferred_batch_sizes=(4, 8), max_queue_delay_us=2000,
        )  # fmt: skip

    return _make


def instance_key_headers(url: str) -> dict[str, str]:
    """The key header of the instance at ``host:port`` (every Triton API but health requires it)."""
    from apps.fleet.models import TritonInstance

    port = int(url.rsplit(":", 1)[1].split("/", 1)[0])
    return TritonInstance.objects.get(http_port=port).key_headers()


def agent_command(platform: str, token: str, credential_file: Path) -> list[str]:
    """The host agent's command line, as an inference host runs it."""
    return [sys.executable, "-m", "hostagent", "--platform", platform, "--join-token", token,
            "--credential-file", str(credential_file)]  # fmt: skip


def agent_environment(extra: dict) -> dict:
    """An inference host's environment: no database or broker URL, and nothing of the platform importable
    (``tests/without_django/sitecustomize.py`` refuses Django and the platform's packages)."""
    env = {k: v for k, v in os.environ.items() if k not in PLATFORM_ONLY_ENV}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT / "tests" / "without_django"), env.get("PYTHONPATH")])
    )
    env.update({k: str(v) for k, v in extra.items()})
    return env


class Agent:
    """A `python -m hostagent` process for a host created the way staff create one (with one CPU instance on
    free ports): it joins with the host's one-time token and then knows only the platform's URL and its own
    credential - no DATABASE_URL, no broker URL, no Django."""

    def __init__(self, name: str, env: dict, log_path: Path, platform: str, labels: dict | None = None):
        from apps.fleet import services

        self.name = name
        self.ports = [free_port() for _ in range(3)]
        self.log_path = log_path
        self.var_dir = Path(env["VAR_DIR"])
        self.credential_file = self.var_dir / "host-credential"
        self.host, token = services.create_host(actor=None, name=name, address="127.0.0.1", labels=labels)
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
            agent_command(platform, token, self.credential_file),
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.ports[0]}"

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


# What an inference host must not hold: the agent gets neither.
PLATFORM_ONLY_ENV = ("DATABASE_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "REDIS_URL")


@pytest.fixture
def start_agent(tmp_path, artifact_root, live_server):
    agents: list[Agent] = []

    def _start(name: str, labels: dict | None = None, **extra) -> Agent:
        var_dir = tmp_path / f"agent-{name}-var"
        var_dir.mkdir()
        # The host's own directory (beside the artifact store, see ``artifact_root``); no artifact store.
        env = agent_environment(
            {"VAR_DIR": var_dir, "FLEET_ROOT": Path(artifact_root).parent / "fleet", **extra}
        )
        agent = Agent(name, env, tmp_path / f"agent-{name}.log", live_server.url, labels)
        agents.append(agent)
        return agent

    yield _start
    for agent in agents:
        agent.stop()
