"""The deployment state machine as agents drive it through ``placement_finished`` - no agent, no Triton:
the placements are moved by hand the way ``hostagent.placement`` moves them."""

from __future__ import annotations

import pytest

from apps.deployments import services
from apps.deployments.models import DeploymentState, PlacementState
from tests.deployments.helpers import finish, serving
from tests.support.models import add_instance, make_version

pytestmark = pytest.mark.django_db


@pytest.fixture
def two_instances(shared_host):
    return add_instance(shared_host, "cpu-0", 18100), add_instance(shared_host, "cpu-1", 18110)


def test_deploy_is_serving_only_when_every_placement_is_ready(owner, version, two_instances):
    a, b = two_instances
    deployment = services.deploy_version(actor=owner, model=version.model, version=version, instances=[a, b])
    assert deployment.state == DeploymentState.DEPLOYING and deployment.target_version == version
    deployment = finish(deployment, a, state=PlacementState.READY, served_version=version)
    assert deployment.state == DeploymentState.DEPLOYING  # b still pending
    deployment = finish(deployment, b, state=PlacementState.READY, served_version=version)
    assert deployment.state == DeploymentState.SERVING
    assert deployment.active_version == version and deployment.target_version is None
    assert deployment.events.filter(kind="deployed").exists()


def test_a_failed_first_deploy_fails_the_deployment_with_the_instance_error(owner, version, two_instances):
    a, b = two_instances
    deployment = services.deploy_version(actor=owner, model=version.model, version=version, instances=[a, b])
    finish(deployment, a, state=PlacementState.READY, served_version=version)
    deployment = finish(deployment, b, state=PlacementState.FAILED, last_error="load failed: bad model")
    assert deployment.state == DeploymentState.FAILED and deployment.active_version is None
    assert f"{b}: load failed: bad model" in deployment.last_error
    assert deployment.events.filter(kind="deploy_failed").exists()


def test_a_failed_switch_keeps_the_old_version_serving_and_rolls_switched_instances_back(
    owner, model, version, two_instances, django_capture_on_commit_callbacks, monkeypatch
):
    a, b = two_instances
    deployment = serving(owner, version, two_instances)
    v2 = make_version(model, 2)
    deployment = services.switch_version(actor=owner, deployment=deployment, version=v2)
    assert deployment.state == DeploymentState.SWITCHING and deployment.target_version == v2
    # a switched; b failed its smoke test and still serves v1.
    finish(deployment, a, state=PlacementState.READY, served_version=v2)
    enqueued = []
    monkeypatch.setattr(services, "_enqueue", lambda placements: enqueued.extend(placements))
    with django_capture_on_commit_callbacks(execute=True):
        deployment = finish(deployment, b, state=PlacementState.FAILED, last_error="smoke inference failed")
    assert deployment.state == DeploymentState.SERVING
    assert deployment.active_version == version and deployment.target_version is None
    assert "smoke inference failed" in deployment.last_error
    states = dict(deployment.placements.values_list("instance_id", "state"))
    # The instance that switched goes back to v1 (its agent reloads it); the failed one kept v1 all along.
    assert states == {a.pk: PlacementState.PENDING, b.pk: PlacementState.READY}
    assert [p.instance_id for p in enqueued] == [a.pk]
    assert deployment.events.filter(kind="switch_failed", version=v2).exists()


def test_a_successful_switch_serves_the_new_version(owner, model, version, two_instances):
    a, b = two_instances
    deployment = serving(owner, version, two_instances)
    v2 = make_version(model, 2)
    services.switch_version(actor=owner, deployment=deployment, version=v2)
    finish(deployment, a, state=PlacementState.READY, served_version=v2)
    deployment = finish(deployment, b, state=PlacementState.READY, served_version=v2)
    assert deployment.state == DeploymentState.SERVING and deployment.active_version == v2
    assert deployment.events.filter(kind="switched").exists()


def test_undeploy_ends_undeployed_once_every_instance_unloaded(owner, version, two_instances):
    a, b = two_instances
    deployment = serving(owner, version, two_instances)
    deployment = services.undeploy(actor=owner, deployment=deployment)
    assert deployment.state == DeploymentState.UNDEPLOYING
    deployment = finish(deployment, a, state=PlacementState.UNLOADED, served_version=None)
    assert deployment.state == DeploymentState.UNDEPLOYING
    deployment = finish(deployment, b, state=PlacementState.UNLOADED, served_version=None)
    assert deployment.state == DeploymentState.UNDEPLOYED
    # The model can be deployed again afterwards.
    again = services.deploy_version(actor=owner, model=version.model, version=version, instances=[a])
    assert again.pk != deployment.pk and again.state == DeploymentState.DEPLOYING
