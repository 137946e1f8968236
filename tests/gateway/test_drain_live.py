"""Drain, then unload (``apps.deployments.draining``), with a real host agent, tritonserver and the gateway: a
replica put to sleep stays loaded - and answers the requests HAProxy still sends it - until the gateway has
taken it out of rotation and confirmed that nothing is in flight; only then does its agent unload it.

The gateway command is paused (SIGSTOP; HAProxy itself runs on) so that HAProxy keeps routing to the replica
after the platform decided to unload it - the window in which, when the agent heard of an unload first, a
request met an instance whose model was being unloaded ("version 1 is not at ready state")."""

from __future__ import annotations

import os
import signal
import time

import pytest

from apps.deployments import autoscaling
from apps.deployments.models import DeploymentInstance, PlacementState
from apps.registry.models import RegisteredModel
from tests.conftest import wait_for
from tests.support.servers import deploy_to_pool, pool_hosts, requires_haproxy

pytestmark = [pytest.mark.triton, requires_haproxy, pytest.mark.django_db(transaction=True)]

URL = "/api/v1/teams/vision/deployments/"
WINDOW_S = (
    3.0  # requests through the paused gateway after the decision: an agent told at once unloads within it
)


@pytest.fixture(autouse=True)
def _no_rate_limit(team):
    team.quota_requests_per_second = 1_000_000
    team.save()


def test_a_replica_put_to_sleep_is_unloaded_only_after_the_gateway_drained_it(
    owner_client, owner, team, start_agent, make_scaler_version, start_gateway, make_token, artifact_root,
):  # fmt: skip
    _, agents = pool_hosts(start_agent, artifact_root, 2048)
    agent = agents["host-a"]
    model = RegisteredModel.objects.create(team=team, name="Scaler", slug="scaler", created_by=owner)
    make_scaler_version(model, 2.0)
    deployment = deploy_to_pool(owner_client, "vision", "scaler", agent=agent)
    policy = {"min_replicas": 0, "max_replicas": 1, "scale_down_window_s": 0, "idle_period_s": 60}
    assert owner_client.post(f"{URL}{deployment.pk}/autoscaling/", policy, format="json").status_code == 200
    gateway = start_gateway()
    _, secret = make_token(name="drain")
    wait_for(lambda: gateway.infer("vision__scaler", secret)[0] == 200, 15, "the model through the gateway")
    placement = DeploymentInstance.objects.get(deployment=deployment)
    wait_for(
        lambda: DeploymentInstance.objects.get(pk=placement.pk).routed, 15, "the gateway to mark it routed"
    )

    os.kill(gateway.process.pid, signal.SIGSTOP)
    try:
        autoscaling.sleep(actor=owner, deployment=deployment)
        decided = time.monotonic()
        answers = []
        while time.monotonic() - decided < WINDOW_S and len(answers) < 200:
            answers.append(gateway.infer("vision__scaler", secret)[0])
        row = DeploymentInstance.objects.get(pk=placement.pk)
        assert row.unload and row.state == PlacementState.READY, (row.state, agent.output()[-2000:])
    finally:
        os.kill(gateway.process.pid, signal.SIGCONT)
    # Every request HAProxy still sent it was answered: the replica was not unloaded under them.
    assert answers and set(answers) == {200}, answers
    assert not deployment.events.filter(kind="unloaded").exists()

    # The gateway syncs: out of rotation, nothing in flight, confirmed - then its agent unloads it.
    wait_for(
        lambda: DeploymentInstance.objects.get(pk=placement.pk).state == PlacementState.UNLOADED,
        30,
        f"the drained replica to be unloaded\n{gateway.output()}\n{agent.output()[-2000:]}",
    )
    drained = deployment.events.get(kind="drained")
    unloaded = deployment.events.get(kind="unloaded")
    assert (
        "no request in flight at the gateway" in drained.message and drained.created_at <= unloaded.created_at
    )
    row = DeploymentInstance.objects.get(pk=placement.pk)
    assert not row.routed and row.draining_since is None
    print(
        f"drain live: {len(answers)} requests answered 200 while the paused gateway still routed the replica"
    )
