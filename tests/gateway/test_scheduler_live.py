"""Deploy by intent with real host agents, tritonservers and the gateway: two replicas spread over two hosts of
a pool, a host drained and a host killed under gateway load - no failed request, the replicas placed again on
the remaining capacity. The beat's tick (``healing.tick``) is driven by the test, as the beat would run it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from apps.deployments import healing
from apps.deployments.models import Deployment, DeploymentInstance, DeploymentState, PlacementState
from apps.fleet import pools
from apps.fleet.models import Host, InstanceState, Pool, TritonInstance
from apps.registry.models import RegisteredModel
from tests.conftest import wait_for
from tests.support.servers import Load, requires_haproxy, server_status

pytestmark = [pytest.mark.triton, requires_haproxy, pytest.mark.django_db(transaction=True)]

GRACE_S = 5


@pytest.fixture(autouse=True)
def _no_rate_limit(team):
    team.quota_requests_per_second = 1_000_000
    team.save()


def ticking(predicate):
    """A wait_for predicate that runs the beat's scheduler tick before each look."""

    def run():
        healing.tick()
        return predicate()

    return run


def serving_on(deployment: Deployment) -> dict[str, str]:
    """host name -> placement state, for the replicas that count (not retired, not unloaded)."""
    rows = deployment.placements.filter(retiring_reason="").exclude(state=PlacementState.UNLOADED)
    return {p.instance.host.name: p.state for p in rows.select_related("instance__host")}


def test_replicas_spread_drain_and_host_loss_under_gateway_load(
    owner_client, owner, team, start_agent, make_scaler_version, start_gateway, make_token, artifact_root,
    settings,
):  # fmt: skip
    settings.SCHEDULER_HOST_GRACE_S = GRACE_S
    Pool.objects.create(name="cpu", memory_budget_mb=2048)
    # Three hosts of the pool, each with its own host directory (as on three machines), heartbeats well
    # inside the grace so a busy machine never looks lost.
    agents, instances = {}, {}
    for name in ("host-a", "host-b", "host-c"):
        agents[name] = start_agent(
            name, labels={"pool": "cpu"}, AGENT_HEARTBEAT_INTERVAL="0.5",
            FLEET_ROOT=Path(artifact_root).parent / f"fleet-{name}",
        )  # fmt: skip
    for name, agent in agents.items():  # started together, they come up together
        instances[name] = wait_for(
            lambda n=name: TritonInstance.objects.filter(host__name=n, state=InstanceState.READY).first(),
            120,
            f"the instance of {name} to be READY\n{agent.output()}",
        )
    assert set(Host.objects.filter(pool__name="cpu").values_list("name", flat=True)) == set(agents)

    model = RegisteredModel.objects.create(team=team, name="Scaler", slug="scaler", created_by=owner)
    version = make_scaler_version(model, 2.0)
    response = owner_client.post(
        "/api/v1/teams/vision/deployments/",
        {"model": "scaler", "version": 1, "replicas": 2, "pool": "cpu"},
        format="json",
    )
    assert response.status_code == 201, response.json()
    deployment = Deployment.objects.get(pk=response.json()["id"])
    wait_for(
        lambda: Deployment.objects.filter(pk=deployment.pk, state=DeploymentState.SERVING).exists(),
        120,
        f"the deployment to be SERVING\n{agents['host-a'].output()}",
    )
    first = serving_on(deployment)
    assert len(first) == 2 and set(first.values()) == {PlacementState.READY}, first  # one per host

    gateway = start_gateway()
    _, secret = make_token(name="load")
    backend = f"d{deployment.pk}"
    for name in first:
        wait_for(
            lambda n=name: server_status(gateway, backend, instances[n].api_key) == "UP",
            15,
            f"{name} in rotation",
        )
    wait_for(lambda: gateway.infer("vision__scaler", secret)[0] == 200, 10, "the token to be known")

    with Load(gateway, "vision__scaler", secret, threads=3, max_seconds=240) as load:
        load.wait_for_requests(200)

        # Drain one host: its replica moves to the host without one (READY there first), then unloads.
        drained = sorted(first)[1]
        spare = next(name for name in agents if name not in first)
        pools.set_cordon(actor=owner, host=Host.objects.get(name=drained), cordoned=True, drain=True)
        wait_for(
            ticking(lambda: serving_on(deployment).get(spare) == PlacementState.READY),
            120,
            f"the replica to move to {spare}",
        )
        old = DeploymentInstance.objects.get(deployment=deployment, instance=instances[drained])
        wait_for(
            ticking(lambda: DeploymentInstance.objects.get(pk=old.pk).state == PlacementState.UNLOADED),
            60,
            f"the drained replica to unload from {drained}",
        )
        assert set(serving_on(deployment)) == {spare, *first} - {drained}
        load.wait_for_requests(200)
        pools.set_cordon(actor=owner, host=Host.objects.get(name=drained), cordoned=False)

        # Lose a host: its agent and its Triton die at once. The gateway routes around it at once; after the
        # grace the scheduler places the replica on the remaining capacity (the uncordoned host).
        lost = next(name for name in serving_on(deployment) if name != spare)
        pid = TritonInstance.objects.get(pk=instances[lost].pk).pid
        os.killpg(agents[lost].process.pid, signal.SIGKILL)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for(
            ticking(lambda: serving_on(deployment).get(drained) == PlacementState.READY),
            GRACE_S + 15,
            f"the lost replica to be replaced on {drained}",
        )
        replaced_s = time.monotonic() - killed_at
        load.wait_for_requests(200)

    assert load.failures == [], load.failures[:5]
    assert load.statuses[200] >= 600
    assert set(serving_on(deployment)) == {spare, drained}
    kinds = list(deployment.events.values_list("kind", flat=True))
    assert "replica_lost" in kinds and "placed" in kinds and "replica_removed" in kinds
    lost_event = deployment.events.filter(kind="replica_lost", message__contains=lost).first()
    assert lost_event is not None and "no heartbeat" in lost_event.message
    # The first load measured what the version takes; the scheduler reserves that from now on.
    version.refresh_from_db()
    print(
        f"scheduler live: {load.total} requests, statuses {dict(load.statuses)}, "
        f"replaced in {replaced_s:.1f}s, footprint {version.footprint_mb} MiB"
    )
    assert version.footprint_mb is not None and 1 <= version.footprint_mb < 2048, version.footprint_mb
