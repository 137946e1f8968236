"""A version's note and tags, archive and restore, delete: refused while it serves or is rolled out,
audited, files removed only once the row is gone; roles and tenancy on the API."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError

from apps.audit.models import AuditEvent
from apps.deployments import reports
from apps.deployments import services as deployments
from apps.deployments.models import Deployment, DeploymentState
from apps.registry import versions
from apps.registry.models import ModelVersion, RegisteredModel
from tests.registry.builders import serve
from tests.support.models import make_version

pytestmark = pytest.mark.django_db

URL = "/api/v1/teams/vision/models/classifier/versions/"


def test_archived_version_is_not_latest_nor_deployable_but_kept(owner, classifier, v1, v2, maintainer_client):
    assert classifier.latest_version() == v2
    response = maintainer_client.post(f"{URL}2/archive/")
    assert response.status_code == 200, response.json()
    assert response.json()["archived_at"]
    assert classifier.latest_version() == v1
    assert ModelVersion.objects.latest_ready_by_model([classifier.pk]) == {classifier.pk: v1}
    v2.refresh_from_db()
    assert v2.is_archived() and not v2.is_servable() and v2.servable_dir().is_dir()
    assert AuditEvent.objects.filter(action="version.archived", target_id=str(v2.pk)).exists()
    assert [v["number"] for v in maintainer_client.get(URL, {"archived": "true"}).json()["results"]] == [2]
    assert [v["number"] for v in maintainer_client.get(URL, {"archived": "false"}).json()["results"]] == [1]
    restored = maintainer_client.post(f"{URL}2/unarchive/")
    assert restored.json()["archived_at"] is None and classifier.latest_version() == v2


def test_archive_refused_with_409_while_the_version_serves(owner, v1, instance, maintainer_client):
    deployment = serve(owner, v1, instance)
    response = maintainer_client.post(f"{URL}1/archive/")
    assert response.status_code == 409
    body = response.json()
    assert body["error"] == "in_use"
    assert f"deployment #{deployment.pk} serves it" in body["message"]
    v1.refresh_from_db()
    assert not v1.is_archived()
    assert not AuditEvent.objects.filter(action="version.archived").exists()


def test_delete_refused_while_the_version_is_a_switch_target(owner, v1, v2, instance, maintainer_client):
    deployment = serve(owner, v1, instance)
    deployments.switch_version(actor=owner, deployment=deployment, version=v2)
    response = maintainer_client.delete(f"{URL}2/")
    assert response.status_code == 409
    assert f"deployment #{deployment.pk} is rolling it out" in response.json()["message"]
    assert ModelVersion.objects.filter(pk=v2.pk).exists() and v2.servable_dir().is_dir()


def test_delete_removes_row_and_files_and_is_audited(
    v1, v2, maintainer_client, artifact_root, django_capture_on_commit_callbacks
):
    storage = v2.storage_dir()
    with django_capture_on_commit_callbacks(execute=True):
        response = maintainer_client.delete(f"{URL}2/")
    assert response.status_code == 204
    assert not ModelVersion.objects.filter(pk=v2.pk).exists()
    assert not storage.exists()
    assert not any(p.name.startswith(".deleted-") for p in storage.parent.iterdir())  # no leftovers
    assert v1.servable_dir().is_dir()  # the other version's files are untouched
    event = AuditEvent.objects.get(action="version.deleted")
    assert event.details["version"] == 2 and event.details["sha256"] == v2.sha256


def test_delete_after_undeploy_releases_the_history_and_keeps_the_deployment(
    owner, v1, instance, maintainer_client
):
    deployment = serve(owner, v1, instance)
    deployments.undeploy(actor=owner, deployment=deployment)
    placement = deployment.placements.get()
    reports.placement_unloaded(placement.pk, placement.generation, "unloaded")
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.UNDEPLOYED
    response = maintainer_client.delete(f"{URL}1/")
    assert response.status_code == 204, response.json()
    deployment.refresh_from_db()
    assert deployment.active_version is None and Deployment.objects.filter(pk=deployment.pk).exists()


def test_a_failed_delete_keeps_the_files(v1, monkeypatch):
    def explode(*args, **kwargs):
        raise RuntimeError("database went away")

    monkeypatch.setattr(ModelVersion, "delete", explode)
    with pytest.raises(RuntimeError):
        versions.delete_version(actor=None, version=v1)
    assert v1.servable_dir().is_dir() and ModelVersion.objects.filter(pk=v1.pk).exists()
    assert not AuditEvent.objects.filter(action="version.deleted").exists()  # rolled back with the row


def test_delete_refused_while_converting(classifier, maintainer_client, artifact_root):
    make_version(classifier, 1, state="CONVERTING")
    response = maintainer_client.delete(f"{URL}1/")
    assert response.status_code == 409 and "while it is converting" in response.json()["message"]


def test_note_and_tags_are_edited_by_maintainers_and_audited(v1, maintainer_client):
    response = maintainer_client.patch(
        f"{URL}1/", {"note": "Retrained on May data.", "tags": ["Prod", "int8", "prod"]}, format="json"
    )
    assert response.status_code == 200, response.json()
    assert response.json()["note"] == "Retrained on May data."
    assert response.json()["tags"] == ["prod", "int8"]
    event = AuditEvent.objects.get(action="version.updated")
    assert event.details["tags"] == {"from": [], "to": ["prod", "int8"]}


@pytest.mark.parametrize("tags", [["has space"], ["../etc"], [""], ["x" * 33], [f"t{i}" for i in range(11)]])
def test_hostile_or_too_many_tags_are_400(v1, maintainer_client, tags):
    response = maintainer_client.patch(f"{URL}1/", {"tags": tags}, format="json")
    assert response.status_code == 400
    assert response.json()["fields"]["tags"]
    v1.refresh_from_db()
    assert v1.tags == []


def test_viewer_reads_but_cannot_change_archive_or_delete(v1, viewer_client):
    assert viewer_client.get(f"{URL}1/").json()["tags"] == []
    assert viewer_client.patch(f"{URL}1/", {"note": "x"}, format="json").status_code == 403
    assert viewer_client.post(f"{URL}1/archive/").status_code == 403
    assert viewer_client.delete(f"{URL}1/").status_code == 403
    assert ModelVersion.objects.filter(pk=v1.pk, archived_at__isnull=True, note="").exists()


def test_outsider_gets_404_for_every_version_action(v1, outsider_client):
    assert outsider_client.get(f"{URL}1/").status_code == 404
    assert outsider_client.patch(f"{URL}1/", {"note": "x"}, format="json").status_code == 404
    assert outsider_client.post(f"{URL}1/archive/").status_code == 404
    assert outsider_client.delete(f"{URL}1/").status_code == 404
    assert ModelVersion.objects.filter(pk=v1.pk).exists() and v1.servable_dir().is_dir()


def test_deploy_choices_skip_archived_versions(owner, classifier, v1, v2, instance):
    v2 = versions.archive_version(actor=owner, version=v2)
    with pytest.raises(Exception, match="archived; restore it"):
        deployments.deploy_version(actor=owner, model=classifier, version=v2, instances=[instance])
    assert list(RegisteredModel.objects.get(pk=classifier.pk).versions.ready()) == [v1]


def test_a_version_archived_meanwhile_is_refused_by_deploy_and_switch(owner, classifier, v1, v2, instance):
    stale = ModelVersion.objects.get(pk=v2.pk)  # read before the archive, as a form or a request would have
    versions.archive_version(actor=owner, version=v2)
    with pytest.raises(ValidationError, match="archived; restore it"):
        deployments.deploy_version(actor=owner, model=classifier, version=stale, instances=[instance])
    deployment = serve(owner, v1, instance)
    with pytest.raises(ValidationError, match="archived; restore it"):
        deployments.switch_version(actor=owner, deployment=deployment, version=stale)
    assert Deployment.objects.get(pk=deployment.pk).target_version is None
