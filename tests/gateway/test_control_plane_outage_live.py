"""The data plane does not depend on the control plane: with the web server the host agent talks to stopped for
60 s, inference through the gateway goes on without a failed request, and once the web server is back the agent
reconnects and a new deploy is served.

Real processes throughout: a gunicorn web server (the agent's platform URL), ``python -m hostagent`` with its
tritonserver, and ``manage.py gateway`` (HAProxy). The gateway reads the database, which stays up (as PostgreSQL
and Redis do in the compose stack while web, worker and beat restart). No Celery worker or beat runs here: a
deploy needs neither (the platform records the decision, the agent fetches it through the web server), so the
whole control plane the agent and the gateway could depend on is down while the web server is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from django.utils import timezone

from apps.fleet.models import Host, InstanceState, TritonInstance
from apps.registry.models import RegisteredModel
from backend_ge.runtime import free_port
from tests.conftest import subprocess_database_url, wait_for
from tests.support.servers import Agent, Load, agent_env, deploy, requires_haproxy

pytestmark = [
    pytest.mark.triton,
    pytest.mark.servers,
    requires_haproxy,
    pytest.mark.django_db(transaction=True),
]

ROOT = Path(__file__).resolve().parents[2]
OUTAGE_S = 60.0


class WebServer:
    """The platform's web server as production runs it (gunicorn, gthread), on one port across restarts."""

    def __init__(self, env: dict, log_path: Path) -> None:
        self.env, self.log_path = env, log_path
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> WebServer:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "gunicorn", "serving_platform.wsgi",
                 "--config", "python:serving_platform.gunicorn_hooks", "--bind", f"127.0.0.1:{self.port}",
                 "--workers", "1", "--threads", "24", "--worker-class", "gthread"],
                cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        wait_for(self._healthy, 60, f"the web server to answer\n{self.output()}", interval=0.2)
        return self

    def _healthy(self) -> bool:
        assert self.process.poll() is None, f"the web server exited\n{self.output()}"
        try:
            return requests.get(f"{self.url}/healthz", timeout=5).status_code == 200
        except requests.ConnectionError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


@pytest.fixture
def web_server(tmp_path, artifact_root):
    env = os.environ | {
        "DATABASE_URL": subprocess_database_url(),
        "ALLOWED_HOSTS": "127.0.0.1",
        "ARTIFACT_ROOT": str(artifact_root),  # the agent downloads the versions the test wrote
    }
    server = WebServer(env, tmp_path / "web.log").start()
    yield server
    server.stop()


@pytest.fixture
def agent_on_web(web_server, tmp_path, artifact_root):
    var_dir = tmp_path / "agent-var"
    var_dir.mkdir()
    env = agent_env(var_dir, Path(artifact_root).parent / "fleet", AGENT_HEARTBEAT_INTERVAL="0.5")
    agent = Agent("edge-a", env, tmp_path / "agent.log", web_server.url)
    yield agent
    agent.stop()


@pytest.fixture(autouse=True)
def _no_rate_limit(team):
    team.quota_requests_per_second = 1_000_000
    team.save()


def _triton_has_loaded(instance: TritonInstance, name: str) -> bool:
    """Whether the instance's tritonserver itself holds ``name`` READY (asked directly, not via the platform)."""
    response = requests.post(
        f"http://127.0.0.1:{instance.http_port}/v2/repository/index",
        headers=instance.key_headers(),
        json={"ready": True},
        timeout=10,
    )
    return any(row["name"] == name for row in response.json())


def test_gateway_serves_without_a_failure_while_the_web_server_is_down_and_the_agent_resumes_after(
    owner_client, owner, team, web_server, agent_on_web, make_scaler_version, start_gateway, make_token
):
    agent = agent_on_web
    instance = wait_for(
        lambda: TritonInstance.objects.filter(host__name=agent.name, state=InstanceState.READY).first(),
        120,
        f"the agent's instance to be READY\n{agent.output()}",
    )
    first = RegisteredModel.objects.create(team=team, name="Scaler", slug="scaler", created_by=owner)
    make_scaler_version(first, 2.0)
    deploy(owner_client, team.slug, "scaler", 1, [instance])
    gateway = start_gateway()
    _, secret = make_token(name="outage")
    wait_for(lambda: gateway.infer("vision__scaler", secret)[0] == 200, 30, "the model through the gateway")

    with Load(gateway, "vision__scaler", secret, threads=3, rate=25, max_seconds=OUTAGE_S + 90) as load:
        load.wait_for_requests(50)
        web_server.stop()
        down_at = time.monotonic()
        sent_before = load.total

        # The outage: every second, the agent and the gateway are still running and Triton still holds the
        # model (an agent that gave up on the platform would have unloaded it or exited).
        def outage_over() -> bool:
            assert agent.process.poll() is None, f"the agent exited\n{agent.output()}"
            assert gateway.running, f"the gateway exited\n{gateway.output()}"
            assert _triton_has_loaded(instance, "vision__scaler"), agent.output()
            return time.monotonic() - down_at >= OUTAGE_S

        wait_for(outage_over, OUTAGE_S + 30, "the outage to last its time", interval=1.0)
        sent_during = load.total - sent_before
        failed_during = len(load.failures)

        restarted_at = timezone.now()
        web_server.start()
        # The agent reconnects: a heartbeat after the restart, over its old credential.
        wait_for(
            lambda: Host.objects.get(pk=agent.host.pk).last_heartbeat_at > restarted_at,
            60,
            f"a heartbeat after the web server's restart\n{agent.output()}",
        )
        # ... and picks up where it was: a new deploy reaches its tritonserver and serves.
        second = RegisteredModel.objects.create(team=team, name="Doubler", slug="doubler", created_by=owner)
        make_scaler_version(second, 3.0)
        deploy(owner_client, team.slug, "doubler", 1, [instance])
        wait_for(
            lambda: gateway.infer("vision__doubler", secret)[0] == 200,
            30,
            "the new deploy through the gateway",
        )
        load.wait_for_requests(50)
    status, body = gateway.infer("vision__doubler", secret)
    assert status == 200 and body["outputs"][0]["data"][0] == 3.0, body

    assert load.failures == [], load.failures[:5]
    assert sent_during >= 0.5 * 3 * 25 * OUTAGE_S, f"only {sent_during} requests during the outage"
    assert load.outputs.keys() == {2.0}
    # The outage was an outage to them, not a failure: warnings about the unreachable platform, no ERROR.
    assert " ERROR " not in agent.log_path.read_text(errors="replace"), agent.output()
    assert " ERROR " not in gateway.log_path.read_text(errors="replace"), gateway.output()
    print(
        f"control-plane outage {OUTAGE_S:.0f} s: {sent_during} requests sent during it, {failed_during} failed; "
        f"{load.total} in all, {len(load.failures)} failed"
    )
