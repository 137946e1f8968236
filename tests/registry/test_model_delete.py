"""Deleting a model that was deployed: refused with 409 (API) or a message naming the deployments (page) while
one is live, undeploying included; once every deployment has ended the model goes with its versions, files
and the history of those deployments (placements, events, rollouts, analyses), audited, never half done."""

# ruff: noqa: F811 - the fixtures imported below are test arguments
from __future__ import annotations

import pytest
from django.utils import timezone

from apps.audit.models import AuditEvent
from apps.deployments import reports, rollouts
from apps.deployments import services as deployments
from apps.deployments.models import (
    Deployment,
    DeploymentEvent,
    DeploymentInstance,
    DeploymentState,
    Rollout,
    RolloutAnalysis,
)
from apps.registry import services as registry
from apps.registry.models import ModelVersion, RegisteredModel
from tests.registry.builders import serve, with_files
from tests.support.models import make_version

pytestmark = pytest.mark.django_db

API = "/api/v1/teams/vision/models/classifier/"
PAGE = "/teams/vision/models/classifier/"


@pytest.fixture
def v1(classifier, artifact_root):
    # The classifier (tests/registry's own ``model`` fixture is another model).
    return with_files(make_version(classifier, 1))


@pytest.fixture
def v2(classifier, artifact_root):
    return with_files(make_version(classifier, 2))


def undeployed(owner, deployment: Deployment) -> Deployment:
    """Undeploy, and the agent reports the instance unloaded."""
    deployments.undeploy(actor=owner, deployment=deployment)
    placement = deployment.placements.get()
    assert reports.placement_unloaded(placement.pk, placement.generation, "unloaded")
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.UNDEPLOYED
    return deployment


def assert_kept(model, *versions_):
    assert RegisteredModel.objects.filter(pk=model.pk).exists()
    for version in versions_:
        assert ModelVersion.objects.filter(pk=version.pk).exists() and version.servable_dir().is_dir()
    assert not AuditEvent.objects.filter(action="model.deleted").exists()


def test_a_live_deployment_refuses_the_api_delete_with_409_naming_it(owner, v1, instance, maintainer_client):
    deployment = serve(owner, v1, instance)
    response = maintainer_client.delete(API)
    assert response.status_code == 409, response.content
    body = response.json()
    assert body["error"] == "in_use"
    assert body["message"] == (
        f"Classifier cannot be deleted while it is deployed: deployment #{deployment.pk} (serving). "
        "Undeploy it first."
    )
    assert_kept(v1.model, v1)
    assert Deployment.objects.get(pk=deployment.pk).state == DeploymentState.SERVING


def test_an_undeploy_in_flight_still_refuses_the_delete(owner, v1, instance, maintainer_client):
    deployment = serve(owner, v1, instance)
    deployments.undeploy(actor=owner, deployment=deployment)  # the agent has not unloaded it yet
    response = maintainer_client.delete(API)
    assert response.status_code == 409
    assert f"deployment #{deployment.pk} (undeploying)" in response.json()["message"]
    assert_kept(v1.model, v1)


def test_the_page_shows_the_refusal_with_a_link_to_the_deployment(client, owner, v1, instance):
    deployment = serve(owner, v1, instance)
    client.force_login(owner)
    response = client.post(PAGE, {"op": "delete"}, follow=True)
    assert response.status_code == 200
    assert response.redirect_chain == [(PAGE, 302)]
    page = response.content.decode()
    assert "Classifier cannot be deleted while it is deployed" in page
    assert f'href="/teams/vision/deployments/{deployment.pk}/"' in page
    assert_kept(v1.model, v1)


def test_once_every_deployment_ended_the_model_goes_with_their_history(
    owner, v1, v2, instance, maintainer_client, artifact_root, django_capture_on_commit_callbacks
):
    model = v1.model
    first = serve(owner, v1, instance)
    rollout = rollouts.start_rollout(actor=owner, deployment=first, canary=v2)
    RolloutAnalysis.objects.create(
        rollout=rollout,
        checked_at=timezone.now(),
        window_start=timezone.now(),
        weight=10,
        passed=True,
    )
    rollouts.abort(actor=owner, rollout=rollout)
    first = undeployed(owner, first)
    second = undeployed(owner, serve(owner, v2, instance))
    storage = registry.model_storage_dir(model)
    assert storage.is_dir()
    with django_capture_on_commit_callbacks(execute=True):
        response = maintainer_client.delete(API)
    assert response.status_code == 204, response.content
    assert not RegisteredModel.objects.filter(pk=model.pk).exists()
    assert not ModelVersion.objects.filter(model_id=model.pk).exists()
    assert not storage.exists()
    history = {first.pk, second.pk}
    assert not Deployment.objects.filter(pk__in=history).exists()
    assert not DeploymentInstance.objects.filter(deployment_id__in=history).exists()
    assert not DeploymentEvent.objects.filter(deployment_id__in=history).exists()
    assert not Rollout.objects.filter(pk=rollout.pk).exists()
    assert not RolloutAnalysis.objects.filter(rollout_id=rollout.pk).exists()
    event = AuditEvent.objects.get(action="model.deleted")
    assert event.details == {"slug": "classifier", "versions": 2, "deployments": [first.pk, second.pk]}
    # The audit log keeps what the deployments did.
    assert AuditEvent.objects.filter(action="deployment.undeploy", target_id=str(first.pk)).exists()
    assert AuditEvent.objects.filter(action="rollout.aborted", target_id=str(first.pk)).exists()


def test_the_page_deletes_a_model_whose_deployments_ended(client, owner, v1, instance):
    undeployed(owner, serve(owner, v1, instance))
    client.force_login(owner)
    response = client.post(PAGE, {"op": "delete"})
    assert response.status_code == 302 and response["Location"] == "/teams/vision/models/"
    assert not RegisteredModel.objects.filter(slug="classifier").exists()
    assert not Deployment.objects.exists()


def test_a_failed_delete_keeps_the_history_rows_and_files(owner, v1, instance, monkeypatch):
    deployment = undeployed(owner, serve(owner, v1, instance))

    def explode(*args, **kwargs):
        raise RuntimeError("database went away")

    monkeypatch.setattr(RegisteredModel, "delete", explode)
    with pytest.raises(RuntimeError):
        registry.delete_model(actor=owner, model=v1.model)
    assert Deployment.objects.filter(pk=deployment.pk).exists()
    assert DeploymentEvent.objects.filter(deployment=deployment).exists()
    assert_kept(v1.model, v1)


def test_the_delete_confirmation_quotes_the_model_name_for_javascript(client, owner, classifier):
    model = classifier
    model.name = "O'Brien');alert(1);('"
    model.save()
    client.force_login(owner)
    page = client.get(PAGE).content.decode()
    # The quote cannot end the string: the name stays text inside the confirm's JavaScript.
    assert "confirm('Delete O\\u0027Brien\\u0027)\\u003Balert(1)\\u003B(\\u0027 and all its versions" in page
