"""Conversion jobs and version configs through the API and the pages: tenancy, roles, field errors, polling."""

from __future__ import annotations

from unittest import mock

import pytest
from django.test import Client
from django.urls import reverse

from apps.conversions import runner, services
from apps.conversions.models import ConversionJob, JobState
from apps.registry.models import VersionState
from tests.conversions.helpers import config_url, converted

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def no_atc(monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")


@pytest.fixture
def ready(make_version, mlp_bytes, owner, no_atc):
    return converted(make_version, {"model.onnx": mlp_bytes}, owner)


@pytest.fixture
def failed(make_version, owner, no_atc):
    return converted(make_version, {"model.onnx": b"garbage"}, owner, fail=True)


def jobs_url(*rest) -> str:
    return "/api/v1/teams/vision/conversion-jobs/" + "".join(f"{r}/" for r in rest)


def test_jobs_list_filters_and_detail_carries_the_log(ready, viewer_client):
    version, job = ready
    listing = viewer_client.get(jobs_url(), {"state": "SUCCEEDED", "model": version.model.slug})
    assert listing.status_code == 200
    assert [j["id"] for j in listing.json()["results"]] == [job.pk]
    assert "log" not in listing.json()["results"][0]
    assert viewer_client.get(jobs_url(), {"state": "FAILED"}).json()["results"] == []
    assert viewer_client.get(jobs_url(), {"version": version.pk + 1000}).json()["results"] == []
    detail = viewer_client.get(jobs_url(job.pk)).json()
    assert detail["state"] == "SUCCEEDED" and detail["version_state"] == "READY" and "READY" in detail["log"]


def test_outsider_gets_404_for_jobs_and_configs(ready, outsider_client):
    version, job = ready
    assert outsider_client.get(jobs_url()).status_code == 404
    assert outsider_client.get(jobs_url(job.pk)).status_code == 404
    assert outsider_client.post(jobs_url(job.pk, "rerun")).status_code == 404
    assert outsider_client.get(config_url(version)).status_code == 404
    assert outsider_client.put(config_url(version), {"config_text": "x"}, format="json").status_code == 404
    assert outsider_client.get(f"/api/v1/teams/speech/conversion-jobs/{job.pk}/").status_code == 404


def test_viewer_gets_403_on_rerun_and_config_update(failed, ready, viewer_client):
    _, failed_job = failed
    version, _ = ready
    response = viewer_client.post(jobs_url(failed_job.pk, "rerun"))
    assert response.status_code == 403 and "maintainer" in response.json()["message"]
    assert viewer_client.get(config_url(version)).status_code == 200
    response = viewer_client.put(config_url(version), {"config_text": version.config_text}, format="json")
    assert response.status_code == 403
    assert ConversionJob.objects.filter(version=failed_job.version).count() == 1


def test_maintainer_reruns_a_failed_conversion(failed, ready, maintainer_client):
    version, job = failed
    with mock.patch("apps.conversions.services.enqueue_conversion") as enqueue:
        response = maintainer_client.post(
            jobs_url(job.pk, "rerun"), {"precision_mode": "force_fp16"}, format="json"
        )
    assert response.status_code == 201, response.json()
    new = response.json()
    enqueue.assert_called_once_with(new["id"])
    assert (
        new["id"] != job.pk and new["state"] == "QUEUED" and new["options"]["precision_mode"] == "force_fp16"
    )
    version.refresh_from_db()
    assert version.state == VersionState.CONVERTING
    _, ready_job = ready
    refused = maintainer_client.post(jobs_url(ready_job.pk, "rerun"))
    assert refused.status_code == 400 and "READY" in refused.json()["message"]


def test_config_put_returns_field_errors_and_saves_a_valid_config(ready, maintainer_client):
    version, _ = ready
    bad = version.config_text.replace("data_type: TYPE_FP32", "data_type: TYPE_INT8", 1)
    response = maintainer_client.put(config_url(version), {"config_text": bad}, format="json")
    assert response.status_code == 400
    body = response.json()
    assert body["error"] == "invalid" and "input[0].data_type" in body["fields"]
    good = version.config_text.replace(
        "max_queue_delay_microseconds: 100", "max_queue_delay_microseconds: 250"
    )
    response = maintainer_client.put(config_url(version), {"config_text": good}, format="json")
    assert (
        response.status_code == 200 and "max_queue_delay_microseconds: 250" in response.json()["config_text"]
    )
    assert (version.servable_dir() / "config.pbtxt").read_text() == response.json()["config_text"]


def login(user) -> Client:
    client = Client()
    client.force_login(user)  # client.login() has no request, which the sign-in throttle (django-axes) needs
    return client


def test_job_page_polls_while_running_and_stops_when_finished(make_version, mlp_bytes, owner, viewer, no_atc):
    version = make_version({"model.onnx": mlp_bytes})
    with mock.patch("apps.conversions.services.enqueue_conversion"):
        job = services.start_conversion(actor=owner, version=version)
    client = login(viewer)
    page = client.get(reverse("conversion-job", args=["vision", job.pk]))
    assert page.status_code == 200
    assert b'hx-trigger="load delay:0.5s, every 2s"' in page.content
    progress_url = reverse("conversion-job-progress", args=["vision", job.pk])
    assert progress_url.encode() in page.content
    runner.execute_job(job.pk)
    partial = client.get(progress_url)
    assert partial.status_code == 200
    assert b"hx-trigger" not in partial.content and b'data-state="SUCCEEDED"' in partial.content
    assert b"<html" not in partial.content and b"READY" in partial.content


def test_failed_job_page_shows_the_error_and_reruns_for_maintainers(failed, maintainer, viewer):
    version, job = failed
    url = reverse("conversion-job", args=["vision", job.pk])
    viewer_page = login(viewer).get(url)
    assert b"is not a valid ONNX model" in viewer_page.content and b'id="rerun"' not in viewer_page.content
    assert login(viewer).post(url).status_code == 403
    client = login(maintainer)
    assert b'id="rerun"' in client.get(url).content
    with mock.patch("apps.conversions.services.enqueue_conversion"):
        response = client.post(url)
    new_job = ConversionJob.objects.filter(version=version).exclude(pk=job.pk).get()
    assert response.status_code == 302 and response.url == reverse(
        "conversion-job", args=["vision", new_job.pk]
    )
    assert new_job.state == JobState.QUEUED


def test_outsider_gets_404_for_job_and_config_pages(ready, outsider):
    version, job = ready
    client = login(outsider)
    assert client.get(reverse("conversion-job", args=["vision", job.pk])).status_code == 404
    assert client.get(reverse("conversion-job-progress", args=["vision", job.pk])).status_code == 404
    config = reverse("version-config-edit", args=["vision", version.model.slug, version.number])
    assert client.get(config).status_code == 404


def test_config_editor_shows_errors_with_the_field_path_and_saves(ready, maintainer, viewer):
    version, _ = ready
    url = reverse("version-config-edit", args=["vision", version.model.slug, version.number])
    assert b"readonly" in login(viewer).get(url).content
    client = login(maintainer)
    bad = version.config_text.replace("dims: 16", "dims: 3")
    response = client.post(url, {"config_text": bad})
    assert response.status_code == 400
    html = response.content.decode()
    assert '<code class="field-path">input[0].dims</code>' in html and "do not match the model" in html
    assert "dims: 3" in html  # the user's text is kept for fixing
    version.refresh_from_db()
    assert "dims: 16" in version.config_text
    good = version.config_text.replace("count: 1", "count: 2")
    response = client.post(url, {"config_text": good})
    assert response.status_code == 302
    version.refresh_from_db()
    assert "count: 2" in version.config_text
