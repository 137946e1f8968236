"""A model too big for any instance with a real host agent and tritonserver: it stays PENDING with its reason
(API and deployment page), and is placed and served as soon as capacity frees - the pool's memory budget grows,
or another deployment is undeployed - by the beat alone, no retry by anyone. The beat's tick
(``healing.tick``) is driven by the test, as the beat would run it."""

from __future__ import annotations

from pathlib import Path

import pytest

from apps.deployments import healing
from apps.deployments.models import Deployment, DeploymentState, PlacementState
from apps.fleet.models import InstanceState, Pool, TritonInstance
from apps.registry.models import RegisteredModel
from tests.conftest import wait_for
from tests.factories import UserFactory

pytestmark = [pytest.mark.triton, pytest.mark.servers, pytest.mark.django_db(transaction=True)]

BASE = "/api/v1/teams/vision/deployments/"


def ticking(predicate):
    def run():
        healing.tick()
        return predicate()

    return run


def sized(make_scaler_version, team, owner, slug: str, mb: int, scale: float):
    model = RegisteredModel.objects.create(team=team, name=slug, slug=slug, created_by=owner)
    version = make_scaler_version(model, scale)
    version.footprint_mb = mb  # as if measured at its first load: the scheduler reserves exactly this
    version.save(update_fields=["footprint_mb"])
    return version


def serving(deployment_id: int) -> bool:
    deployment = Deployment.objects.get(pk=deployment_id)
    placements = deployment.placements.exclude(state=PlacementState.UNLOADED)
    return (
        deployment.state == DeploymentState.SERVING and placements.filter(state=PlacementState.READY).exists()
    )


def test_too_big_stays_pending_with_its_reason_and_is_placed_when_capacity_frees(
    owner_client, owner, team, client, start_agent, make_scaler_version, artifact_root
):
    Pool.objects.create(name="cpu", memory_budget_mb=1000)
    agent = start_agent("host-p", labels={"pool": "cpu"}, AGENT_HEARTBEAT_INTERVAL="0.5",
                        FLEET_ROOT=Path(artifact_root).parent / "fleet-host-p")  # fmt: skip
    instance = wait_for(
        lambda: TritonInstance.objects.filter(host__name="host-p", state=InstanceState.READY).first(),
        120,
        f"the template instance to be READY\n{agent.output()}",
    )
    sized(make_scaler_version, team, owner, "hog", 700, 1.0)
    sized(make_scaler_version, team, owner, "big", 600, 2.0)
    sized(make_scaler_version, team, owner, "huge", 800, 3.0)

    def deploy(slug):
        response = owner_client.post(
            BASE, {"model": slug, "version": 1, "replicas": 1, "pool": "cpu"}, format="json"
        )
        assert response.status_code == 201, response.json()
        return response.json()["id"]

    hog = deploy("hog")
    wait_for(lambda: serving(hog), 120, f"hog to serve\n{agent.output()}")

    # 600 MiB asked, 300 MiB free: PENDING with the reason, in the API and on the page.
    big = deploy("big")
    body = owner_client.get(f"{BASE}{big}/").json()
    reason = (
        "1 of 1 replica(s) pending: no instance in cpu has 0.6 GiB free; the largest free is 0.3 GiB on "
        f"{instance}"
    )
    assert body["state"] == "PENDING" and body["pending_reason"] == reason, body
    client.force_login(owner)
    page = client.get(f"/teams/vision/deployments/{big}/").content.decode()
    assert 'id="pending-reason"' in page and reason in page
    healing.tick()  # nothing changed: still pending, no placement
    assert Deployment.objects.get(pk=big).state == DeploymentState.PENDING

    # Staff grow the pool's budget: the next ticks place it and the agent loads it - nobody retries.
    client.force_login(UserFactory(is_staff=True))
    answer = client.patch("/api/v1/pools/cpu/", {"memory_budget_mb": 1400}, content_type="application/json")
    assert answer.status_code == 200, answer.json()
    wait_for(ticking(lambda: serving(big)), 120, f"big to be placed and served\n{agent.output()}")
    body = owner_client.get(f"{BASE}{big}/").json()
    assert body["pending_reason"] == "" and body["state"] == "SERVING"

    # 800 MiB do not fit beside hog (700) and big (600) in 1400; once hog is undeployed and unloaded, they do.
    huge = deploy("huge")
    assert owner_client.get(f"{BASE}{huge}/").json()["state"] == "PENDING"
    assert owner_client.post(f"{BASE}{hog}/undeploy/").status_code in (200, 202)
    wait_for(ticking(lambda: serving(huge)), 120, f"huge to be placed when hog unloaded\n{agent.output()}")
    events = list(Deployment.objects.get(pk=huge).events.values_list("kind", flat=True))
    assert "unschedulable" in events and "placed" in events
