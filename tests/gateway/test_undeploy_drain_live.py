"""Undeploying drains (``apps.deployments.draining``), with a real host agent, tritonserver and the gateway:
requests the gateway accepted before it dropped the deployment's route answer 200 - the replica stays loaded
until the gateway has deleted its servers and nothing is in flight there - later ones get the gateway's 404,
and the deployment ends UNDEPLOYED.

The model is slow on purpose (Triton's dynamic batcher holds each request for ``SLOW_S`` waiting for a fuller
batch), so requests are in flight at the instance when the gateway applies the undeploy; and the gateway
command is paused for a moment after the undeploy (SIGSTOP; HAProxy itself runs on), so that HAProxy keeps
routing to the replica after the platform decided - the window in which, when the agent heard of an undeploy
at once, requests met an instance whose model was being unloaded."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from apps.deployments.models import Deployment, DeploymentInstance, DeploymentState, PlacementState
from apps.registry.models import RegisteredModel
from tests.conftest import wait_for
from tests.factories import ready_onnx_version
from tests.support.models import scaler_onnx
from tests.support.servers import deploy_to_pool, pool_hosts, requires_haproxy

pytestmark = [pytest.mark.triton, requires_haproxy, pytest.mark.django_db(transaction=True)]

URL = "/api/v1/teams/vision/deployments/"
SLOW_S = 2.0  # each request waits this long in Triton's queue (a batch of 8 never fills)
CLIENTS = 4
PAUSE_S = 3.0  # the gateway command paused after the undeploy: HAProxy still routes to the replica


@pytest.fixture(autouse=True)
def _no_rate_limit(team):
    team.quota_requests_per_second = 1_000_000
    team.save()


class Clients:
    """``CLIENTS`` threads sending one request after another through the gateway, each until its first answer
    other than 200 (or its bounds): every answer as (sent, answered, status), wall-clock times."""

    def __init__(self, gateway, model: str, token: str) -> None:
        self.answers: list[tuple[float, float, int]] = []
        self.lock = threading.Lock()
        self.deadline = time.monotonic() + 120
        self.threads = [
            threading.Thread(target=self._run, args=(gateway, model, token), daemon=True)
            for _ in range(CLIENTS)
        ]
        for thread in self.threads:
            thread.start()

    def _run(self, gateway, model: str, token: str) -> None:
        for _ in range(200):
            sent = time.time()
            status = gateway.infer(model, token)[0]
            with self.lock:
                self.answers.append((sent, time.time(), status))
            if status != 200 or time.monotonic() > self.deadline:
                return

    def sent_after(self, moment: float) -> list[int]:
        with self.lock:
            return [status for sent, _, status in self.answers if sent > moment]

    def stopped(self) -> bool:
        return not any(thread.is_alive() for thread in self.threads)

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=max(1.0, self.deadline - time.monotonic()))
        assert self.stopped(), "a client never got its 404"


def test_requests_in_flight_when_a_deployment_is_undeployed_answer_and_later_ones_get_404(
    owner_client, owner, team, start_agent, start_gateway, make_token, artifact_root, tmp_path,
):  # fmt: skip
    _, agents = pool_hosts(start_agent, artifact_root, 2048)
    agent = agents["host-a"]
    model = RegisteredModel.objects.create(team=team, name="Slow", slug="slow", created_by=owner)
    ready_onnx_version(
        model, scaler_onnx(2.0), tmp_path, preferred_batch_sizes=(8,), max_queue_delay_us=int(SLOW_S * 1e6)
    )
    deployment = deploy_to_pool(owner_client, "vision", "slow", agent=agent)
    gateway = start_gateway()
    _, secret = make_token(name="undeploy")
    wait_for(lambda: gateway.infer("vision__slow", secret)[0] == 200, 30, "the model through the gateway")
    placement = DeploymentInstance.objects.get(deployment=deployment)
    wait_for(
        lambda: DeploymentInstance.objects.get(pk=placement.pk).routed, 15, "the gateway to mark it routed"
    )

    clients = Clients(gateway, "vision__slow", secret)
    try:
        wait_for(lambda: len(clients.answers) >= CLIENTS, 30, "every client answered once")
        os.kill(gateway.process.pid, signal.SIGSTOP)
        try:
            assert owner_client.post(f"{URL}{deployment.pk}/undeploy/").status_code == 200
            undeployed = time.time()
            # HAProxy still routes: these requests were accepted before the gateway applied the undeploy.
            wait_for(
                lambda: (
                    time.time() - undeployed > PAUSE_S
                    and (len(clients.sent_after(undeployed)) >= CLIENTS or clients.stopped())
                ),
                30,
                "requests sent and answered after the undeploy while the gateway was paused",
            )
            during_pause = DeploymentInstance.objects.get(pk=placement.pk)
        finally:
            os.kill(gateway.process.pid, signal.SIGCONT)
        resumed = time.time()
        clients.join()
    finally:
        clients.deadline = 0  # nothing new once the test failed early
    answers = sorted(clients.answers)
    statuses = [status for _, _, status in answers]
    # Every request the gateway accepted while it still routed the model answered 200; then its 404.
    assert set(statuses) == {200, 404}, answers
    # (Sent a moment before the gateway resumed: HAProxy surely had them before the gateway's sync.)
    sent_then = [status for sent, _, status in answers if sent < resumed - 0.25]
    assert sent_then and set(sent_then) == {200}, answers
    assert statuses.count(404) == CLIENTS, answers  # one per client: each stops at its first
    assert len(clients.sent_after(undeployed)) > CLIENTS  # some answered 200 after the undeploy
    # Meanwhile the replica stayed loaded: told to unload, still serving.
    assert during_pause.unload and during_pause.state == PlacementState.READY, during_pause.state

    wait_for(
        lambda: Deployment.objects.get(pk=deployment.pk).state == DeploymentState.UNDEPLOYED,
        60,
        f"the deployment to be UNDEPLOYED\n{gateway.output()[-2000:]}\n{agent.output()[-2000:]}",
    )
    drained = deployment.events.get(kind="drained")
    unloaded = deployment.events.get(kind="unloaded")
    assert "no request in flight at the gateway" in drained.message, drained.message
    assert drained.created_at <= unloaded.created_at
    # Confirmed only once the last request sent to the replica had its answer (HAProxy's session ends as the
    # answer leaves; the client reads it a moment later).
    last_answer = max(answered for _, answered, status in answers if status == 200)
    assert drained.created_at.timestamp() >= last_answer - 0.75, (drained.created_at, last_answer)
    assert gateway.infer("vision__slow", secret)[0] == 404
    print(
        f"undeploy drain live: {statuses.count(200)} requests answered 200, "
        f"{len(clients.sent_after(undeployed))} sent after the undeploy; then {statuses.count(404)} x 404"
    )
