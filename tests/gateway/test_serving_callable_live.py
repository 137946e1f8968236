"""SERVING means callable: with a real host agent, tritonserver and the gateway, a client that polls the API
every 100 ms and calls the model the moment it says SERVING gets 200 the first time - for five models
deployed one after another, and after a version switch; ``GET /v2/models`` lists what the caller's team
can call. The figures (from the agent's "ready" report to
the API's SERVING) are printed for the benchmarks page."""

from __future__ import annotations

import statistics

import pytest

from apps.deployments.models import Deployment, DeploymentEvent
from apps.registry.models import RegisteredModel
from apps.teams import services
from tests.conftest import wait_for
from tests.support.models import output_of
from tests.support.servers import poll_api_until_serving, pool_hosts, requires_haproxy

pytestmark = [
    pytest.mark.triton,
    pytest.mark.servers,
    requires_haproxy,
    pytest.mark.django_db(transaction=True),
]

BASE = "/api/v1/teams/vision/deployments/"
POLL_S = 0.1


@pytest.fixture(autouse=True)
def _no_rate_limit(team):
    team.quota_requests_per_second = 1_000_000
    team.save()


def ready_reported_at(pk: int, kind: str) -> float:
    """When the platform recorded the agent's report that Triton serves the version (the settle's event)."""
    event = DeploymentEvent.objects.filter(deployment_id=pk, kind=kind).order_by("-pk").first()
    assert event is not None, f"no {kind} event for deployment {pk}"
    return event.created_at.timestamp()


def test_each_model_called_the_moment_the_api_says_serving_answers_200_and_so_does_a_switch(
    owner_client, owner, team, outsider, other_team, start_agent, make_scaler_version, start_gateway,
    make_token, artifact_root,
):  # fmt: skip
    pool_hosts(start_agent, artifact_root, budget_mb=4096)
    _, token = make_token(name="smoke")
    gateway = start_gateway()
    gaps = []
    for n in range(5):
        slug = f"m{n}"
        model = RegisteredModel.objects.create(team=team, name=slug, slug=slug, created_by=owner)
        make_scaler_version(model, float(n + 2))
        response = owner_client.post(
            BASE, {"model": slug, "version": 1, "replicas": 1, "pool": "cpu"}, format="json"
        )
        assert response.status_code == 201, response.json()
        pk = response.json()["id"]
        body, serving_at = poll_api_until_serving(owner_client, "vision", pk, 1)
        status, answer = gateway.infer(f"vision__{slug}", token)
        assert status == 200, (slug, status, answer, gateway.output())
        assert output_of(answer) == [1.0 * (n + 2), 2.0 * (n + 2), 3.0 * (n + 2), 4.0 * (n + 2)]
        assert body["waiting_for"] == ""
        gaps.append(serving_at - ready_reported_at(pk, "deployed"))

    # GET /v2/models: the team's callable models, as called; another team's token sees none of them.
    status, index = gateway.get("/v2/models", token)
    assert status == 200, index
    assert index == {
        "models": [{"name": f"vision__m{n}", "versions": ["1"], "state": "READY"} for n in range(5)]
    }
    _, outsider_token = services.create_token(actor=outsider, team=other_team, name="probe")
    wait_for(lambda: gateway.get("/v2/models", outsider_token)[0] == 200, 15, "the outsider's token")
    assert gateway.get("/v2/models", outsider_token) == (200, {"models": []})
    assert gateway.get("/v2/models")[0] == 401
    assert gateway.request("POST", "/v2/models", token, b"{}")[0] == 404

    # A switch: SERVING v2 is v2 answering, at once.
    deployment = Deployment.objects.get(model__slug="m0")
    make_scaler_version(deployment.model, 10.0)
    response = owner_client.post(f"{BASE}{deployment.pk}/switch/", {"version": 2}, format="json")
    assert response.status_code == 200, response.json()
    assert response.json()["state"] == "SWITCHING"
    _, serving_at = poll_api_until_serving(owner_client, "vision", deployment.pk, 2)
    status, answer = gateway.infer("vision__m0", token)
    assert status == 200 and output_of(answer) == [10.0, 20.0, 30.0, 40.0], (status, answer)
    gaps.append(serving_at - ready_reported_at(deployment.pk, "switched"))
    print(
        f"\nready reported -> API SERVING (polled every {POLL_S * 1000:.0f} ms): "
        f"median {statistics.median(gaps) * 1000:.0f} ms, max {max(gaps) * 1000:.0f} ms over {len(gaps)}"
    )
