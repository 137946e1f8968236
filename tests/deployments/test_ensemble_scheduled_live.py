"""The seed's ensemble deployed by replicas, with two real host agents (each its tritonserver) in one pool
and HAProxy: its steps deployed by replicas land where the scheduler puts them, the ensemble asks for 2
replicas spread over the hosts, and each replica goes to a host together with a replica of every step it
lacks there; called through the gateway, every answer is the pipeline's top-5."""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from apps.deployments import scheduler
from apps.deployments.models import Deployment, DeploymentState, PlacementState
from apps.fleet.models import InstanceState, Pool, TritonInstance
from tests.conftest import wait_for
from tests.deployments.ensemble_live import BUILDERS, converted_step, infer
from tests.registry.ensemble_builders import ensemble_model, seed_spec

pytestmark = [
    pytest.mark.triton,
    pytest.mark.servers,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed"),
]


def by_replicas(client, slug: str, replicas: int) -> Deployment:
    response = client.post(
        "/api/v1/teams/vision/deployments/",
        {"model": slug, "version": 1, "replicas": replicas, "pool": "cpu"},
        format="json",
    )
    assert response.status_code == 201, response.json()
    return Deployment.objects.get(pk=response.json()["id"])


def hosts_serving(deployment: Deployment) -> dict[str, str]:
    """host name -> placement state of the replicas that count."""
    rows = scheduler.counted(Deployment.objects.get(pk=deployment.pk)).select_related("instance__host")
    return {p.instance.host.name: p.state for p in rows}


def successes(instance: TritonInstance, model: str) -> int:
    """Inferences the instance's Triton answered for ``model`` (its statistics API)."""
    request = urllib.request.Request(
        f"{instance.endpoint_url()}/v2/models/{model}/stats", headers=instance.key_headers()
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        stats = json.loads(response.read())
    return sum(m["inference_stats"]["success"]["count"] for m in stats["model_stats"])


def describe(*deployments) -> str:
    lines = []
    for d in deployments:
        d = Deployment.objects.get(pk=d.pk)
        lines.append(f"{d.model.slug}: {d.state} replicas={d.replicas} pending={d.pending_reason!r}")
        for p in d.placements.select_related("instance__host"):
            lines.append(f"  {p.instance}: {p.state} served={p.served_version_id} {p.last_error[:200]}")
        for event in d.events.order_by("-pk")[:4]:
            lines.append(f"  event {event.kind}: {event.message[:200]}")
    return "\n".join(lines)


@pytest.mark.timeout(900)
def test_the_seed_ensemble_deployed_by_replicas_takes_its_steps_along_and_answers_through_the_gateway(
    owner, team, owner_client, start_agent, start_gateway, make_token, tmp_path, artifact_root
):
    team.quota_requests_per_second = 1_000_000
    team.save()
    Pool.objects.create(name="cpu", memory_budget_mb=8192)
    agents = {
        name: start_agent(
            name, labels={"pool": "cpu"}, FLEET_ROOT=Path(artifact_root).parent / f"fleet-{name}"
        )
        for name in ("host-a", "host-b")
    }
    for name, agent in agents.items():
        wait_for(
            lambda n=name: TritonInstance.objects.filter(host__name=n, state=InstanceState.READY).exists(),
            180,
            f"the instance of {name} to be READY\n{agent.output()}",
        )
    steps = {}
    for slug in BUILDERS:
        converted_step(owner, team, slug, tmp_path)
        steps[slug] = by_replicas(owner_client, slug, 1)
    wait_for(
        lambda: all(list(hosts_serving(d).values()) == [PlacementState.READY] for d in steps.values()),
        300,
        "the steps to serve",
    )
    # Placed one by one on the least loaded host: no host has all three steps.
    step_hosts = {slug: next(iter(hosts_serving(d))) for slug, d in steps.items()}
    assert set(step_hosts.values()) == {"host-a", "host-b"}, step_hosts
    ensemble_model(owner, team)
    composed = owner_client.post(
        "/api/v1/teams/vision/models/classify/ensemble-versions/", seed_spec(), format="json"
    )
    assert composed.status_code == 201, composed.json()
    ensemble = by_replicas(owner_client, "classify", 2)

    def everything_serves() -> bool:
        every = [ensemble, *steps.values()]
        return all(
            Deployment.objects.get(pk=d.pk).state == DeploymentState.SERVING
            and hosts_serving(d) == {"host-a": PlacementState.READY, "host-b": PlacementState.READY}
            for d in every
        )

    try:
        wait_for(everything_serves, 420, "the ensemble and its steps to serve on both hosts", interval=1)
    except AssertionError as exc:
        logs = "\n".join(a.output()[-1500:] for a in agents.values())
        raise AssertionError(f"{exc}\n{describe(ensemble, *steps.values())}\n{logs}") from None
    for slug, d in steps.items():
        d = Deployment.objects.get(pk=d.pk)
        assert d.replicas == 2, slug  # a replica added where the ensemble's went without it
        assert d.events.filter(
            kind="placed", message__contains="with a replica of ensemble classify"
        ).exists()
    placed = list(Deployment.objects.get(pk=ensemble.pk).events.filter(kind="placed"))
    assert len(placed) == 2 and all("need_mb" in e.details and e.details["alternatives"] for e in placed)

    _, token = make_token(name="ensemble")
    gateway = start_gateway()
    wait_for(lambda: gateway.get("/v2/models/vision__classify/ready", token)[0] == 200, 30, "the route")
    image = np.random.default_rng(26).integers(0, 256, (1, 224, 224, 3), dtype=np.uint8)
    first = infer(gateway, "vision__classify", token, "raw_image", image, "UINT8")
    assert first["predictions"].shape == (1, 5) and first["scores"].shape == (1, 5)
    # The gateway balances over both replicas: each answers, the same top-5.
    for _ in range(10):
        again = infer(gateway, "vision__classify", token, "raw_image", image, "UINT8")
        np.testing.assert_array_equal(again["predictions"], first["predictions"])
    answered = {
        i.host.name: successes(i, "vision__classify")
        for i in TritonInstance.objects.filter(host__pool__name="cpu").select_related("host")
    }
    assert sorted(answered) == ["host-a", "host-b"] and all(answered.values()), answered
    pre = infer(gateway, "vision__preprocess", token, "input", image, "UINT8")["output"]
    logits = infer(gateway, "vision__resnet50", token, "input", pre.astype(np.float32), "FP32")["output"]
    top = infer(gateway, "vision__postprocess", token, "input", logits.astype(np.float32), "FP32")
    np.testing.assert_array_equal(first["predictions"], top["output"])
