import pytest

from apps.audit.models import AuditEvent
from apps.registry.models import RegisteredModel
from tests.registry.uploads import models_url

pytestmark = pytest.mark.django_db


def test_maintainer_creates_model_with_derived_slug(maintainer_client, team, artifact_root):
    response = maintainer_client.post(models_url(), {"name": "BERT Base", "task_type": "nlp"}, format="json")
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["slug"] == "bert-base"
    assert body["triton_name"] == "vision__bert-base"
    assert body["version_count"] == 0 and body["latest_version"] is None
    assert AuditEvent.objects.filter(action="model.created", details__slug="bert-base").exists()


def test_duplicate_model_slug_in_team_is_400_field_error(owner_client, model):
    response = owner_client.post(models_url(), {"name": "Other", "slug": "resnet50"}, format="json")
    assert response.status_code == 400
    body = response.json()
    assert body["error"] == "invalid"
    assert "already has a model" in body["fields"]["slug"][0]


def test_same_slug_in_another_team_is_fine(outsider_client, model):
    response = outsider_client.post(models_url("speech"), {"name": "x", "slug": "resnet50"}, format="json")
    assert response.status_code == 201
    assert RegisteredModel.objects.filter(slug="resnet50").count() == 2


def test_invalid_slug_is_400(owner_client, team):
    response = owner_client.post(models_url(), {"name": "x", "slug": "Bad Slug"}, format="json")
    assert response.status_code == 400
    assert "lowercase" in response.json()["fields"]["slug"][0]


def test_list_search_and_detail(viewer_client, owner, team, model):
    from apps.registry import services

    services.create_model(actor=owner, team=team, name="Speech recognizer", slug="asr", description="whisper")
    response = viewer_client.get(models_url(), {"search": "whisper"})
    assert [m["slug"] for m in response.json()["results"]] == ["asr"]
    response = viewer_client.get(models_url())
    assert [m["slug"] for m in response.json()["results"]] == ["resnet50", "asr"]
    assert viewer_client.get(f"{models_url()}resnet50/").json()["name"] == "ResNet 50"


def test_edit_model_keeps_slug(maintainer_client, model):
    response = maintainer_client.patch(
        f"{models_url()}resnet50/", {"name": "ResNet-50 v1.5", "description": "ImageNet"}, format="json"
    )
    assert response.status_code == 200, response.json()
    model.refresh_from_db()
    assert (model.name, model.description, model.slug) == ("ResNet-50 v1.5", "ImageNet", "resnet50")
    event = AuditEvent.objects.get(action="model.updated")
    assert event.details["name"] == {"from": "ResNet 50", "to": "ResNet-50 v1.5"}


def test_viewer_cannot_create_edit_delete_or_upload(viewer_client, model):
    assert viewer_client.post(models_url(), {"name": "x"}, format="json").status_code == 403
    response = viewer_client.patch(f"{models_url()}resnet50/", {"name": "y"}, format="json")
    assert response.status_code == 403
    assert "maintainer" in response.json()["message"]
    assert viewer_client.delete(f"{models_url()}resnet50/").status_code == 403
    response = viewer_client.post(
        f"{models_url()}resnet50/uploads/", {"filename": "m.onnx", "size": 10}, format="json"
    )
    assert response.status_code == 403
    assert RegisteredModel.objects.get(pk=model.pk).name == "ResNet 50"


def test_outsider_gets_404_for_model_list_detail_and_versions(outsider_client, model):
    for url in (models_url(), f"{models_url()}resnet50/", f"{models_url()}resnet50/versions/"):
        response = outsider_client.get(url)
        assert response.status_code == 404, url
        assert response.json()["error"] == "not_found"
    assert outsider_client.delete(f"{models_url()}resnet50/").status_code == 404
    response = outsider_client.post(
        f"{models_url()}resnet50/uploads/", {"filename": "m.onnx", "size": 10}, format="json"
    )
    assert response.status_code == 404


def test_delete_model_removes_rows_and_files(
    owner_client, model, artifact_root, django_capture_on_commit_callbacks
):
    from tests.registry.builders import onnx_bytes
    from tests.registry.uploads import upload

    with django_capture_on_commit_callbacks(execute=False):
        assert upload(owner_client, "m.onnx", onnx_bytes()).status_code == 200
    storage = artifact_root / "teams" / str(model.team_id) / "models" / str(model.pk)
    assert (storage / "versions" / "1" / "source" / "model.onnx").is_file()
    with django_capture_on_commit_callbacks(execute=True):
        assert owner_client.delete(f"{models_url()}resnet50/").status_code == 204
    assert not RegisteredModel.objects.filter(pk=model.pk).exists()
    assert not storage.exists()
