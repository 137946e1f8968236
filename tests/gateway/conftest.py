"""Gateway tests use the shared fixtures (``tests/support/plugin.py``): the real `manage.py gateway`
(HAProxy, one per test module) in front of real host agents and tritonservers; the helpers (a model small
enough to call thousands of times, a bounded load generator) are in ``tests/support``."""

from __future__ import annotations

import pytest

from apps.deployments.models import Deployment, DeploymentInstance, DeploymentState, PlacementState
from apps.registry.models import RegisteredModel
from tests.support.models import add_instance, make_version
from tests.support.servers import deploy, ready_instance


@pytest.fixture
def two_teams_on_a_shared_instance(
    owner_client, outsider_client, outsider, other_team, team, owner, start_agent, make_scaler_version
):
    _, instance = ready_instance(start_agent, "shared-a")
    vision = RegisteredModel.objects.create(team=team, name="Scaler", slug="scaler", created_by=owner)
    speech = RegisteredModel.objects.create(
        team=other_team, name="Scaler", slug="scaler", created_by=outsider
    )
    make_scaler_version(vision, 2.0)
    make_scaler_version(speech, 3.0)
    deploy(owner_client, "vision", "scaler", 1, [instance])
    deploy(outsider_client, "speech", "scaler", 1, [instance])
    return instance


@pytest.fixture
def down_deployment(team, owner, shared_host, model):
    version = make_version(model, 1)
    instance = add_instance(shared_host, port=1)  # nothing listens on port 1: the server is DOWN
    deployment = Deployment.objects.create(
        team=team, model=model, active_version=version, state=DeploymentState.SERVING, created_by=owner
    )
    DeploymentInstance.objects.create(
        deployment=deployment, instance=instance, served_version=version, state=PlacementState.READY
    )
    return deployment
