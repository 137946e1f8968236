"""Deploying an ensemble needs its steps served on the same instances; its steps' deployments cannot be
undeployed, switched or rolled out under it (409 naming the ensembles). No agent, no Triton: placements are
moved by hand as in test_state_machine."""

from __future__ import annotations

import pytest

from apps.deployments import services
from apps.deployments.agent_api import desired_state_of
from apps.deployments.models import DeploymentState
from apps.registry import ensembles
from hostagent.protocol import check_desired_state
from tests.deployments.helpers import serving
from tests.registry.ensemble_builders import ensemble_model, ready_step, seed_spec, seed_steps
from tests.registry.uploads import models_url
from tests.support.models import add_instance

pytestmark = pytest.mark.django_db


@pytest.fixture
def pipeline(owner, team, artifact_root):
    steps = seed_steps(owner, team)
    model = ensemble_model(owner, team)
    version = ensembles.compose_ensemble(actor=owner, model=model, spec=seed_spec())
    return steps, version


def test_deploying_an_ensemble_needs_every_step_served_on_its_instances(owner, shared_host, pipeline):
    steps, version = pipeline
    a, b = add_instance(shared_host, "cpu-0", 18100), add_instance(shared_host, "cpu-1", 18110)
    serving(owner, steps["preprocess"], [a])
    serving(owner, steps["resnet50"], [a, b])
    with pytest.raises(services.ValidationError) as refused:
        services.deploy_version(actor=owner, model=version.model, version=version, instances=[a])
    text = " ".join(refused.value.messages)
    assert "step[2] (postprocess v1) is not served on" in text and "deploy postprocess version 1" in text
    serving(owner, steps["postprocess"], [a])
    with pytest.raises(
        services.ValidationError, match=r"step\[0\] \(preprocess v1\) is not served on .*cpu-1"
    ):
        services.deploy_version(actor=owner, model=version.model, version=version, instances=[a, b])
    deployment = serving(owner, version, [a])
    assert deployment.state == DeploymentState.SERVING
    state = check_desired_state(desired_state_of(shared_host))
    entry = state["versions"][str(version.pk)]
    assert entry["steps"] == ["vision__preprocess", "vision__resnet50", "vision__postprocess"]


def test_a_step_an_ensemble_uses_cannot_be_undeployed_or_switched_409(
    owner, owner_client, shared_host, pipeline
):
    steps, version = pipeline
    a = add_instance(shared_host, "cpu-0", 18100)
    step_deployments = {slug: serving(owner, v, [a]) for slug, v in steps.items()}
    serving(owner, version, [a])
    resnet = step_deployments["resnet50"]
    response = owner_client.post(f"/api/v1/teams/vision/deployments/{resnet.pk}/undeploy/")
    assert response.status_code == 409, response.json()
    assert "classify (calls resnet50 v1)" in response.json()["message"]
    ready_step(steps["resnet50"].model)  # v2
    response = owner_client.post(
        f"/api/v1/teams/vision/deployments/{resnet.pk}/switch/", {"version": 2}, format="json"
    )
    assert response.status_code == 409, response.json()
    assert "cannot be switched while ensembles depend on it" in response.json()["message"]
    resnet.refresh_from_db()
    assert resnet.state == DeploymentState.SERVING and resnet.active_version == steps["resnet50"]


def test_the_version_serving_is_what_a_step_without_a_version_pins(
    owner, owner_client, shared_host, pipeline
):
    steps, _ = pipeline
    a = add_instance(shared_host, "cpu-0", 18100)
    newer = ready_step(steps["preprocess"].model)  # v2, READY but the deployment serves v1
    serving(owner, steps["preprocess"], [a])
    response = owner_client.post(f"{models_url()}classify/ensemble-versions/", seed_spec(), format="json")
    assert response.status_code == 201, response.json()
    assert response.json()["pipeline"][0]["version"] == 1 != newer.number
