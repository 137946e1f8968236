"""Scale to zero over gRPC and eviction under memory pressure, with a real host agent, tritonserver and the
gateway. Two scale-to-zero models share one instance whose memory budget holds one of them:

* gRPC (tritonclient.grpc) calls sent at once to the sleeping model are all held at the gateway and answered
  after one activation;
* an HTTP request for the other, sleeping, model is held while the idle, least recently used replica of the
  first is evicted, unloaded, and the second placed and loaded in its room - answered 200.

The autoscaler's beat is not run here (the first model would go to sleep on its own): its evaluations are
driven where the test needs them; the scheduler's tick runs while a request waits, as beat runs it."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from apps.deployments.models import Deployment, PlacementState
from apps.fleet.models import Pool
from apps.registry.models import ModelVersion
from tests.conftest import wait_for
from tests.support.servers import (
    asleep_and_unloaded,
    requires_haproxy,
    serve_in_pool,
    ticking,
    timed_infer,
    while_the_scheduler_ticks,
)

pytestmark = [pytest.mark.triton, requires_haproxy, pytest.mark.django_db(transaction=True)]

URL = "/api/v1/teams/vision/deployments/"
FOOTPRINT_MB = 100


@pytest.fixture(autouse=True)
def _no_rate_limit(team):
    team.quota_requests_per_second = 1_000_000
    team.save()


def loaded(deployment: Deployment) -> int:
    rows = deployment.placements.filter(retiring_reason="", state=PlacementState.READY)
    return rows.count()


def grpc_infer(url: str, model: str, token: str, out: list) -> None:
    client = grpcclient.InferenceServerClient(url)
    item = grpcclient.InferInput("input", [1, 4], "FP32")
    item.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
    started = time.monotonic()
    try:
        result = client.infer(model, [item], headers={"authorization": f"Bearer {token}"}, client_timeout=90)
        out.append(("ok", time.monotonic() - started, result.as_numpy("output").tolist()))
    except Exception as exc:  # noqa: BLE001 - the failure is the test's report
        out.append(("failed", time.monotonic() - started, str(exc)[:300]))
    finally:
        client.close()


def test_grpc_first_calls_are_held_and_a_cold_model_evicts_the_idle_one(
    owner_client, owner, team, start_agent, make_scaler_version, start_gateway, make_token, artifact_root,
    gateway_env, settings,
):  # fmt: skip
    pool, agent, deployments = serve_in_pool(
        owner_client, owner, team, start_agent, make_scaler_version, artifact_root, 4096,
        {"alpha": 2.0, "beta": 3.0},
    )  # fmt: skip
    # From now on the instance's budget holds one of the two.
    ModelVersion.objects.filter(model__team=team).update(footprint_mb=FOOTPRINT_MB)
    Pool.objects.filter(pk=pool.pk).update(memory_budget_mb=FOOTPRINT_MB + FOOTPRINT_MB // 2)
    gateway = start_gateway()
    settings.GATEWAY_METRICS_URL = f"http://{gateway_env['GATEWAY_STATS_BIND']}/metrics"
    _, secret = make_token(name="s2z")
    policy = {"min_replicas": 0, "max_replicas": 1, "scale_down_window_s": 0, "idle_period_s": 2}
    for pk in deployments.values():
        response = owner_client.post(f"{URL}{pk}/autoscaling/", policy, format="json")
        assert response.status_code == 200, response.json()

    wait_for(
        ticking(lambda: all(asleep_and_unloaded(pk) for pk in deployments.values())),
        90,
        "both idle deployments to sleep and unload",
    )

    # gRPC: three calls at once for the sleeping alpha - held, one activation, all answered.
    results: list = []
    calls = [
        threading.Thread(target=grpc_infer, args=(gateway.grpc_url, "vision__alpha", secret, results))
        for _ in range(3)
    ]
    for call in calls:
        call.start()
    for call in calls:
        call.join(120)
    assert [status for status, _, _ in results] == ["ok"] * 3, results
    assert all(output == [[2.0, 2.0, 2.0, 2.0]] for _, _, output in results), results
    alpha = Deployment.objects.get(pk=deployments["alpha"])
    assert alpha.replicas == 1 and loaded(alpha) == 1
    assert alpha.events.filter(kind="woken").count() == 1
    grpc_slowest = max(seconds for _, seconds, _ in results)

    # alpha idles past its idle period (the autoscaler is not run, so it stays loaded): beta's first request
    # must evict it to load in its room.
    def alpha_idle_for_its_period() -> bool:
        last = (Deployment.objects.get(pk=deployments["alpha"]).scaling_memory or {}).get("last_traffic_at")
        return last is not None and time.time() - last >= policy["idle_period_s"]

    wait_for(alpha_idle_for_its_period, policy["idle_period_s"] + 30, "alpha to be idle for its idle period")
    # The scheduler's beat places beta once alpha's memory is freed.
    started = time.monotonic()
    answered = while_the_scheduler_ticks(lambda: timed_infer(gateway, "vision__beta", secret))
    cold_s = time.monotonic() - started
    assert answered and answered[0][0] == 200, (answered, agent.output()[-3000:])
    alpha = Deployment.objects.get(pk=deployments["alpha"])
    beta = Deployment.objects.get(pk=deployments["beta"])
    evicted = alpha.events.get(kind="evicted")
    assert "evicted to make room for beta in cpu" in evicted.message, evicted.message
    assert alpha.replicas == 0 and alpha.asleep_since is not None
    assert beta.replicas == 1 and loaded(beta) == 1 and beta.events.filter(kind="woken").count() == 1
    wait_for(lambda: asleep_and_unloaded(alpha.pk), 30, "alpha's replica to be unloaded")
    print(
        f"scale to zero live: 3 gRPC first calls answered, slowest {grpc_slowest:.2f} s; "
        f"beta after evicting alpha answered in {cold_s:.2f} s"
    )
