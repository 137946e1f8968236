"""Agent reports carry the generation of the decision they applied: a stale one is dropped, and a placement
whose model Triton lost takes the deployment out of SERVING until it is back. No agent, no Triton: the reports
are made the way ``hostagent.placement`` makes them."""

from __future__ import annotations

import pytest

from apps.deployments import reports, services
from apps.deployments.models import Deployment, DeploymentInstance, DeploymentState, PlacementState
from tests.support.models import add_instance, make_version

pytestmark = pytest.mark.django_db


@pytest.fixture
def no_tasks(monkeypatch):
    sent = []
    monkeypatch.setattr(services, "_enqueue", lambda placements: sent.extend(placements))
    return sent


def placement_of(deployment: Deployment) -> DeploymentInstance:
    return DeploymentInstance.objects.get(deployment=deployment)


def serving(owner, version, instance) -> Deployment:
    deployment = services.deploy_version(
        actor=owner, model=version.model, version=version, instances=[instance]
    )
    placement = placement_of(deployment)
    assert reports.placement_loaded(placement.pk, placement.generation, version)
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.SERVING
    return deployment


def test_every_decision_bumps_the_generation_and_the_task_carries_it(
    owner, model, version, instance, no_tasks, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        deployment = services.deploy_version(actor=owner, model=model, version=version, instances=[instance])
    assert placement_of(deployment).generation == 1 and placement_of(deployment).applied_generation == 0
    reports.placement_loaded(placement_of(deployment).pk, 1, version)
    assert placement_of(deployment).is_applied()
    with django_capture_on_commit_callbacks(execute=True):
        services.switch_version(actor=owner, deployment=deployment, version=make_version(model, 2))
    assert placement_of(deployment).generation == 2 and not placement_of(deployment).is_applied()
    with django_capture_on_commit_callbacks(execute=True):
        services.undeploy(actor=owner, deployment=deployment)
    assert placement_of(deployment).generation == 3
    assert [p.generation for p in no_tasks] == [1, 2, 3]


def test_a_load_reported_for_an_older_generation_is_dropped(owner, model, version, instance, no_tasks):
    """The deploy's load finishes after the user undeployed: it must not mark the placement READY."""
    deployment = services.deploy_version(actor=owner, model=model, version=version, instances=[instance])
    assert reports.placement_started(placement_of(deployment).pk, 1)
    services.undeploy(actor=owner, deployment=deployment)
    assert not reports.placement_loaded(placement_of(deployment).pk, 1, version)
    placement = placement_of(deployment)
    assert placement.state == PlacementState.LOADING and placement.served_version is None
    assert not deployment.events.filter(kind="serving").exists()
    assert Deployment.objects.get(pk=deployment.pk).state == DeploymentState.UNDEPLOYING
    # The undeploy's own report (generation 2) is taken.
    assert reports.placement_unloaded(placement.pk, 2, "unloaded")
    assert Deployment.objects.get(pk=deployment.pk).state == DeploymentState.UNDEPLOYED


def test_a_stale_deploy_result_does_not_fail_a_newer_switch(owner, model, version, instance, no_tasks):
    deployment = serving(owner, version, instance)
    v2 = make_version(model, 2)
    services.switch_version(actor=owner, deployment=deployment, version=v2)
    # A late report of the deploy (generation 1) - e.g. a redelivered task - changes nothing.
    assert not reports.placement_failed(
        placement_of(deployment).pk, 1, "late", version=version, still_serving=None
    )
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.SWITCHING and deployment.target_version == v2
    assert reports.placement_loaded(placement_of(deployment).pk, 2, v2)
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.SERVING and deployment.active_version == v2


def test_a_lost_model_takes_the_deployment_out_of_serving_until_it_is_reloaded(
    owner, version, instance, no_tasks
):
    deployment = serving(owner, version, instance)
    placement = placement_of(deployment)
    reason = f"{version} was not ready on {instance} (Triton does not have it loaded); reloading it"
    assert reports.placement_lost(placement.pk, placement.generation, reason, reloading=True)
    deployment.refresh_from_db()
    assert placement_of(deployment).state == PlacementState.LOADING
    assert deployment.state == DeploymentState.DEPLOYING and deployment.active_version == version
    assert reason in deployment.last_error
    assert reports.placement_loaded(placement.pk, placement.generation, version, kind="reloaded")
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.SERVING and deployment.last_error == ""
    kinds = list(deployment.events.order_by("id").values_list("kind", flat=True))
    assert kinds[-4:] == ["reloading", "not_serving", "reloaded", "serving"]


def test_a_model_that_cannot_be_reloaded_fails_the_deployment_with_the_reason(
    owner, version, instance, no_tasks
):
    deployment = serving(owner, version, instance)
    placement = placement_of(deployment)
    failure = f"reloading {version} on {instance} failed: model file missing"
    assert reports.placement_lost(placement.pk, placement.generation, failure, reloading=False)
    # The same failure reported again (every reconcile during the retry back-off) writes nothing.
    assert not reports.placement_lost(placement.pk, placement.generation, failure, reloading=False)
    deployment.refresh_from_db()
    assert placement_of(deployment).state == PlacementState.FAILED
    assert deployment.state == DeploymentState.FAILED and failure in deployment.last_error
    assert deployment.events.filter(kind="lost").count() == 1


def test_one_lost_instance_of_two_keeps_the_deployment_serving(owner, version, shared_host, no_tasks):
    a, b = add_instance(shared_host, "cpu-0", 18100), add_instance(shared_host, "cpu-1", 18110)
    deployment = services.deploy_version(actor=owner, model=version.model, version=version, instances=[a, b])
    for placement in deployment.placements.all():
        reports.placement_loaded(placement.pk, placement.generation, version)
    lost = deployment.placements.get(instance=b)
    assert reports.placement_lost(lost.pk, lost.generation, f"{b} is STARTING", reloading=False)
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.SERVING
    assert deployment.placements.get(instance=b).state == PlacementState.FAILED


def test_a_lost_report_for_a_decision_not_yet_applied_is_ignored(owner, model, version, instance, no_tasks):
    """Work in flight reports for itself; reconcile's check must not overwrite it."""
    deployment = serving(owner, version, instance)
    services.switch_version(actor=owner, deployment=deployment, version=make_version(model, 2))
    placement = placement_of(deployment)
    assert not reports.placement_lost(placement.pk, placement.generation, "gone", reloading=True)
    assert placement_of(deployment).state == PlacementState.PENDING


def test_the_api_and_the_page_show_a_lost_model(owner, owner_client, client, version, instance, no_tasks):
    deployment = serving(owner, version, instance)
    placement = placement_of(deployment)
    failure = f"reloading {version} on {instance} failed: model file missing"
    reports.placement_lost(placement.pk, placement.generation, failure, reloading=False)

    body = owner_client.get(f"/api/v1/teams/vision/deployments/{deployment.pk}/").json()
    assert body["state"] == DeploymentState.FAILED and failure in body["last_error"]
    assert body["placements"][0]["state"] == PlacementState.FAILED
    assert body["placements"][0]["last_error"] == failure
    assert "not_serving" in [e["kind"] for e in body["events"]]

    client.force_login(owner)
    html = client.get(f"/teams/vision/deployments/{deployment.pk}/").content.decode()
    assert 'data-state="FAILED"' in html and failure in html and "not_serving" in html
