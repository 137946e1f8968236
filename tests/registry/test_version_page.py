"""The version page: what the version is, how it was made, where it serves, and the maintainer's actions."""

from __future__ import annotations

import pytest
from django.utils import timezone

from apps.audit.models import AuditEvent
from apps.conversions.models import ConversionJob, JobState
from apps.monitoring.models import ModelMetrics
from apps.registry.models import ModelVersion
from tests.registry.builders import serve

pytestmark = pytest.mark.django_db

PAGE = "/teams/vision/models/classifier/versions/"


@pytest.fixture
def web(client, maintainer):
    client.force_login(maintainer)
    return client


def test_version_page_shows_signature_config_sizes_job_and_figures(web, v1, instance):
    v1.sha256 = "ab" * 32
    v1.size_bytes = 3 * 1024 * 1024
    v1.config_text = 'name: "vision__classifier"\nmax_batch_size: 8\n'
    v1.save()
    started = timezone.now()
    job = ConversionJob.objects.create(
        version=v1,
        state=JobState.SUCCEEDED,
        command=["atc", "--model=model.onnx", "--framework=5"],
        started_at=started,
        finished_at=started + timezone.timedelta(seconds=125),
    )
    ModelMetrics.objects.create(
        bucket=timezone.now(), team=v1.model.team, model=v1.model, version=v1, instance=instance,
        success=9, failure=1, inferences=12, request_us=50_000,
    )  # fmt: skip
    html = web.get(f"{PAGE}1/").content.decode()
    assert "<code>input</code>" in html and "FP32" in html and "[-1, 3, 224, 224]" in html
    assert "max_batch_size: 8" in html
    assert "3 MiB" in html and "7 bytes" in html  # uploaded size, and the served directory on disk
    assert "ab" * 32 in html
    assert f'href="/teams/vision/conversions/{job.pk}/"' in html and "2 min 5 s" in html
    assert "atc --model=model.onnx --framework=5" in html
    assert '>10</span><span class="stat-label">requests' in html and "5.0 ms" in html
    assert 'id="deploy-version"' in html and 'id="not-serving"' in html


def test_model_page_links_each_version_to_its_page(web, v1):
    html = web.get("/teams/vision/models/classifier/").content.decode()
    assert f'href="{PAGE}1/" class="version-link"' in html


def test_version_page_says_where_it_serves(web, owner, v1, instance):
    deployment = serve(owner, v1, instance)
    html = web.get(f"{PAGE}1/").content.decode()
    assert f'href="/teams/vision/deployments/{deployment.pk}/">Deployment #{deployment.pk}</a>' in html
    assert "serves it" in html and str(instance) in html


def test_archive_refused_while_serving_links_the_deployment(web, owner, v1, instance):
    deployment = serve(owner, v1, instance)
    response = web.post(f"{PAGE}1/", {"op": "archive"}, follow=True)
    html = response.content.decode()
    assert "cannot be archived while it is in use" in html
    assert (
        f'<a href="/teams/vision/deployments/{deployment.pk}/">deployment #{deployment.pk} serves it' in html
    )
    v1.refresh_from_db()
    assert not v1.is_archived()


def test_archive_restore_notes_and_delete_from_the_page(web, v1, v2, django_capture_on_commit_callbacks):
    web.post(f"{PAGE}2/", {"op": "archive"})
    assert ModelVersion.objects.get(pk=v2.pk).is_archived()
    assert "Archived" in web.get(f"{PAGE}2/").content.decode()
    assert '<option value="2"' not in web.get("/teams/vision/deployments/new/").content.decode()
    web.post(f"{PAGE}2/", {"op": "unarchive"})
    assert not ModelVersion.objects.get(pk=v2.pk).is_archived()
    response = web.post(f"{PAGE}2/", {"op": "notes", "note": "Faster on 310P", "tags": "prod, INT8"})
    assert response.status_code == 302
    assert ModelVersion.objects.filter(pk=v2.pk, note="Faster on 310P", tags=["prod", "int8"]).exists()
    bad = web.post(f"{PAGE}2/", {"op": "notes", "note": "", "tags": "no spaces allowed"})
    assert bad.status_code == 400 and "is not a tag" in bad.content.decode()
    with django_capture_on_commit_callbacks(execute=True):
        response = web.post(f"{PAGE}2/", {"op": "delete"})
    assert response["Location"] == "/teams/vision/models/classifier/"
    assert not ModelVersion.objects.filter(pk=v2.pk).exists() and not v2.storage_dir().exists()
    assert AuditEvent.objects.filter(action="version.deleted").count() == 1


def test_viewer_reads_the_page_without_actions(client, viewer, v1):
    client.force_login(viewer)
    html = client.get(f"{PAGE}1/").content.decode()
    assert "Signature" in html and 'id="archive"' not in html and 'id="deploy-version"' not in html
    assert client.post(f"{PAGE}1/", {"op": "delete"}).status_code == 403
    assert ModelVersion.objects.filter(pk=v1.pk).exists()


def test_outsider_gets_404_for_the_version_page(client, outsider, v1):
    client.force_login(outsider)
    assert client.get(f"{PAGE}1/").status_code == 404
    assert client.post(f"{PAGE}1/", {"op": "delete"}).status_code == 404
