"""The conversion job page in headless Chromium while a real Celery worker converts: the htmx-polled log and
progress bar advance to READY, then polling stops. Screenshot under var/screenshots/."""

from __future__ import annotations

import pytest
from django.db import transaction

from apps.conversions import services
from apps.conversions.models import ConversionJob
from tests.conftest import PASSWORD, SCREENSHOTS, requires_chromium

pytestmark = [
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    requires_chromium,
]


def test_job_page_shows_live_progress_until_ready(
    page,
    live_server,
    start_worker,
    make_version,
    mlp_bytes,
    owner,
    fake_atc,
):
    fake_atc("success_yolox", FAKE_ATC_SLEEP=2, FAKE_ATC_LINE_DELAY=0.4)
    start_worker()
    version = make_version({"model.onnx": mlp_bytes})
    page.goto(f"{live_server.url}/login/")
    page.fill("input[name=username]", owner.username)
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_selector(".stats")
    with transaction.atomic():
        job = services.start_conversion(
            actor=owner, version=version, options={"precision_mode": "force_fp16"}
        )

    page.goto(f"{live_server.url}/teams/vision/conversions/{job.pk}/")
    # While atc streams its output, the polled partial shows the log growing and the bar moving.
    page.wait_for_selector("#job-progress[data-state=RUNNING]", timeout=60_000)
    page.wait_for_function(
        "document.querySelector('#job-log').textContent.includes('ATC start working')", timeout=30_000
    )
    mid = int(page.inner_text("#job-progress-value"))
    page.screenshot(path=str(SCREENSHOTS / "conversion-job-running.png"), full_page=True)
    page.wait_for_selector("#job-progress[data-state=SUCCEEDED]", timeout=90_000)
    assert page.inner_text("#version-state") == "READY"
    assert int(page.inner_text("#job-progress-value")) == 100 > mid
    assert "ATC run success, welcome to the next use." in page.inner_text("#job-log")
    assert page.get_attribute("#job-progress", "hx-trigger") is None  # finished: polling stopped
    page.screenshot(path=str(SCREENSHOTS / "conversion-job-ready.png"), full_page=True)

    # No more requests for the partial once it has finished.
    requests = []
    page.on("request", lambda r: requests.append(r.url) if "/progress/" in r.url else None)
    # Nothing may happen: a page still polling asks every 2 s (progress.html's hx-trigger), so one period and
    # a margin for the request is the shortest wait that would see it.
    page.wait_for_timeout(2_500)
    assert requests == []

    page.click("text=View / edit config")
    page.wait_for_selector("#config_text")
    assert "max_batch_size: 8" in page.input_value("#config_text")
    assert ConversionJob.objects.filter(version=version).count() == 1


def test_upload_through_the_page_converts_to_ready(
    page,
    live_server,
    start_worker,
    mlp_bytes,
    owner,
    team,
    tmp_path,
    monkeypatch,
):
    """The whole path a user takes: drag a model onto the upload page, the page lands on the conversion job,
    a real worker converts it (no atc here: the ONNX path), and the job page follows it to READY."""
    from apps.registry import services as registry_services
    from apps.registry.models import ModelVersion

    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no atc on this worker: the ONNX path
    worker = start_worker(PATH="/usr/bin:/bin")
    registry_services.create_model(actor=owner, team=team, name="Tiny MLP", slug="tiny-mlp")
    model_file = tmp_path / "tiny.onnx"
    model_file.write_bytes(mlp_bytes)

    page.goto(f"{live_server.url}/login/")
    page.fill("input[name=username]", owner.username)
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.goto(f"{live_server.url}/teams/vision/models/tiny-mlp/upload/")
    page.set_input_files("#file-input", str(model_file))
    page.click("#upload-button")
    page.wait_for_url("**/teams/vision/conversions/*/", timeout=60_000)
    page.wait_for_selector("#job-progress[data-state=SUCCEEDED]", timeout=90_000)
    assert page.inner_text("#version-state") == "READY", worker.output()
    assert int(page.inner_text("#job-progress-value")) == 100
    page.screenshot(path=str(SCREENSHOTS / "upload-converted-ready.png"), full_page=True)
    version = ModelVersion.objects.get(model__slug="tiny-mlp")
    assert version.state == "READY" and version.toolchain == "onnx"
    assert (version.servable_dir() / "1" / "model.onnx").is_file()
