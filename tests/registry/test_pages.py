import pytest

from apps.registry import services
from apps.registry.models import RegisteredModel
from tests.registry import builders
from tests.registry.uploads import upload

pytestmark = pytest.mark.django_db


@pytest.fixture
def owner_web(client, owner):
    client.force_login(owner)
    return client


@pytest.fixture
def viewer_web(client, viewer, owner):
    client.force_login(viewer)
    return client


def test_models_page_empty_state_and_nav_link(owner_web, team):
    html = owner_web.get("/teams/vision/models/").content.decode()
    assert "No models yet" in html
    assert 'href="/teams/vision/models/new/"' in html
    assert '<a href="/teams/vision/models/" aria-current="page">Models</a>' in html


def test_models_page_lists_and_searches(owner_web, owner, team, model):
    services.create_model(actor=owner, team=team, name="Speech", slug="asr")
    html = owner_web.get("/teams/vision/models/").content.decode()
    assert 'data-model="resnet50"' in html and 'data-model="asr"' in html
    partial = owner_web.get("/teams/vision/models/", {"q": "spe"}, HTTP_HX_REQUEST="true").content.decode()
    assert 'data-model="asr"' in partial and 'data-model="resnet50"' not in partial
    assert "<html" not in partial
    assert "No model matches" in owner_web.get("/teams/vision/models/", {"q": "zzz"}).content.decode()


def test_create_model_page_redirects_to_upload(owner_web, team, artifact_root):
    response = owner_web.post("/teams/vision/models/new/", {"name": "Det Net", "task_type": "detection"})
    assert response.status_code == 302
    assert response["Location"] == "/teams/vision/models/det-net/upload/"
    assert RegisteredModel.objects.get(slug="det-net").task_type == "detection"


def test_create_model_duplicate_slug_shows_field_error(owner_web, model):
    response = owner_web.post(
        "/teams/vision/models/new/", {"name": "x", "slug": "resnet50", "task_type": "other"}
    )
    assert response.status_code == 400
    assert "already has a model" in response.content.decode()


def test_model_detail_shows_versions_with_badges_and_job_link(owner_web, owner_client, model):
    upload(owner_client, "m.onnx", builders.onnx_bytes())
    upload(owner_client, "bad.pt", builders.state_dict_zip_bytes())
    html = owner_web.get("/teams/vision/models/resnet50/").content.decode()
    assert 'data-version="2"' in html and 'data-version="1"' in html
    assert 'class="badge state-converting"' in html
    assert 'class="badge state-failed"' in html
    assert "torch.jit.save" in html  # the rejection reason is shown on the failed version
    job = model.versions.get(number=1).conversion_jobs.get()
    assert f'href="/teams/vision/conversions/{job.pk}/"' in html


def test_upload_page_has_dropzone_progress_and_options(owner_web, model):
    html = owner_web.get("/teams/vision/models/resnet50/upload/").content.decode()
    assert 'id="drop-zone"' in html and "<progress" in html
    assert 'data-create-url="/api/v1/teams/vision/models/resnet50/uploads/"' in html
    assert "frontend/upload.js" in html
    for name in (
        "max_batch_size",
        "preferred_batch_sizes",
        "max_queue_delay_us",
        "instance_count",
    ):
        assert f'name="{name}"' in html
    assert 'value="Ascend310P3"' in html
    # The form's defaults and bounds are the platform's (backend_ge), not numbers of its own.
    assert 'name="max_batch_size" min="0" max="1024" value="8"' in html
    assert 'name="instance_count" min="1" max="8" value="1"' in html


def test_viewer_sees_models_but_cannot_upload_or_create(viewer_web, model):
    html = viewer_web.get("/teams/vision/models/resnet50/").content.decode()
    assert "Upload a version" not in html and "Delete model" not in html
    assert viewer_web.get("/teams/vision/models/resnet50/upload/").status_code == 403
    assert viewer_web.get("/teams/vision/models/new/").status_code == 403
    assert viewer_web.post("/teams/vision/models/resnet50/", {"op": "delete"}).status_code == 403
    assert RegisteredModel.objects.filter(pk=model.pk).exists()


def test_outsider_gets_404_for_model_pages(client, outsider, model):
    client.force_login(outsider)
    for url in (
        "/teams/vision/models/",
        "/teams/vision/models/resnet50/",
        "/teams/vision/models/resnet50/upload/",
    ):
        assert client.get(url).status_code == 404
    client.force_login(outsider)
    # the outsider's own team has no such model either
    assert client.get("/teams/speech/models/resnet50/").status_code == 404


def test_delete_model_from_page(owner_web, model):
    response = owner_web.post("/teams/vision/models/resnet50/", {"op": "delete"})
    assert response["Location"] == "/teams/vision/models/"
    assert not RegisteredModel.objects.filter(pk=model.pk).exists()
