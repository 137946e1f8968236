"""Autoscaling and scale to zero with real host agents, tritonservers and the gateway: a load scales a
deployment 1 -> 2 with no failed request, it comes back down and sleeps after its idle period (its replicas
unloaded), and then requests sent at once to the sleeping model are held at the gateway and all answered 200
after one activation. The autoscaler's evaluation (the beat's ``apps.gateway.tasks.autoscale``) is driven by
the test; the wake-up is the gateway command's own."""

from __future__ import annotations

import threading

import pytest

from apps.deployments.models import Deployment, DeploymentState, PlacementState
from apps.registry.models import RegisteredModel
from tests.conftest import wait_for
from tests.support.servers import Load, deploy_to_pool, pool_hosts, requires_haproxy, ticking, timed_infer

pytestmark = [pytest.mark.triton, requires_haproxy, pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def _no_rate_limit(team):
    team.quota_requests_per_second = 1_000_000
    team.save()


def replicas(deployment: Deployment) -> dict[str, str]:
    rows = deployment.placements.filter(retiring_reason="").exclude(state=PlacementState.UNLOADED)
    return {p.instance.host.name: p.state for p in rows.select_related("instance__host")}


def test_load_scales_up_then_down_to_zero_and_the_first_requests_are_held_and_answered(
    owner_client, owner, team, start_agent, make_scaler_version, start_gateway, make_token, artifact_root,
    gateway_env, settings,
):  # fmt: skip
    _, agents = pool_hosts(start_agent, artifact_root, 2048, ("host-a", "host-b"))
    model = RegisteredModel.objects.create(team=team, name="Scaler", slug="scaler", created_by=owner)
    make_scaler_version(model, 2.0)
    url = "/api/v1/teams/vision/deployments/"
    deployment = deploy_to_pool(owner_client, "vision", "scaler", agent=agents["host-a"])
    gateway = start_gateway()
    settings.GATEWAY_METRICS_URL = f"http://{gateway_env['GATEWAY_STATS_BIND']}/metrics"
    _, secret = make_token(name="load")
    wait_for(lambda: gateway.infer("vision__scaler", secret)[0] == 200, 15, "the model through the gateway")

    # Bad settings are a 400 naming the field; good ones are taken.
    bad = owner_client.post(
        f"{url}{deployment.pk}/autoscaling/", {"min_replicas": 3, "max_replicas": 2}, format="json"
    )
    assert bad.status_code == 400 and "max_replicas" in bad.json()["fields"], bad.json()
    # A fast model has few requests in flight at any instant: a small target makes 4 threads ask for 2.
    policy = {"min_replicas": 0, "max_replicas": 2, "target_in_flight": 0.1, "scale_down_window_s": 3,
              "idle_period_s": 5}  # fmt: skip
    response = owner_client.post(f"{url}{deployment.pk}/autoscaling/", policy, format="json")
    assert response.status_code == 200, response.json()
    assert response.json()["min_replicas"] == 0

    with Load(gateway, "vision__scaler", secret, threads=4, max_seconds=180) as load:
        wait_for(
            ticking(lambda: set(replicas(deployment).values()) == {PlacementState.READY}
                    and len(replicas(deployment)) == 2),
            120,
            "the load to scale the deployment to 2 READY replicas",
        )  # fmt: skip
        load.wait_for_requests(200)
    assert load.failures == [], load.failures[:5]
    up = deployment.events.filter(kind="autoscaled", message__startswith="1 -> 2").first()
    assert up is not None and "in flight per replica, target 0.1" in up.message, up

    # Idle: down after the window, then to zero after the idle period; its replicas unloaded.
    wait_for(
        ticking(lambda: Deployment.objects.get(pk=deployment.pk).replicas == 0
                and not deployment.placements.exclude(state=PlacementState.UNLOADED).exists()),
        90,
        "the idle deployment to scale to zero and unload",
    )  # fmt: skip
    asleep = Deployment.objects.get(pk=deployment.pk)
    assert asleep.asleep_since is not None and asleep.state == DeploymentState.SERVING
    assert deployment.events.filter(kind="autoscaled", message__contains="-> 0 replicas: no request").exists()

    # Three requests at once for the sleeping model: held, one activation, all answered.
    results: list = []
    threads = [
        threading.Thread(target=lambda: results.append(timed_infer(gateway, "vision__scaler", secret)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert [status for status, *_ in results] == [200, 200, 200], results
    woken = Deployment.objects.get(pk=deployment.pk)
    assert woken.asleep_since is None and woken.replicas == 1
    assert deployment.events.filter(kind="woken").count() == 1
    wait_for(
        lambda: Deployment.objects.get(pk=deployment.pk).last_cold_start_ms is not None,
        10,
        "the cold start to be recorded",
    )
    cold_ms = Deployment.objects.get(pk=deployment.pk).last_cold_start_ms
    slowest = max(seconds for _, _, seconds, _ in results)
    print(
        f"autoscaling live: load {load.total} requests; cold start {cold_ms} ms held, slowest client {slowest:.2f} s"
    )
    assert 0 < cold_ms <= slowest * 1000 + 100
