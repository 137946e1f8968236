"""The upload page in headless Chromium: a real file through the resumable XHR upload, a chunk whose
connection fails on the way, resume from the server's offset, then the conversion job page."""

import hashlib

import pytest

from apps.registry import services
from apps.registry.models import ModelVersion, SourceFormat
from tests.conftest import SCREENSHOTS, requires_chromium
from tests.registry import builders

pytestmark = [pytest.mark.browser, requires_chromium]


def test_upload_page_resumes_after_a_network_error(
    page, live_server, owner, team, settings, tmp_path, monkeypatch
):
    settings.ARTIFACT_ROOT = tmp_path / "artifacts"
    monkeypatch.setattr("apps.conversions.services.enqueue_conversion", lambda job_id: None)
    services.create_model(actor=owner, team=team, name="Embedder", slug="embedder")
    model_file = tmp_path / "embedder.onnx"
    data = builders.onnx_model(width=256, out=512).SerializeToString()  # ~0.5 MiB: several 64 KiB chunks
    model_file.write_bytes(data)

    page.goto(f"{live_server.url}/login/")
    page.fill("input[name=username]", "olivia")
    page.fill("input[name=password]", "correct horse battery staple")
    page.click("button[type=submit]")
    page.goto(f"{live_server.url}/teams/vision/models/embedder/upload/")

    failed = []

    def fail_third_chunk_once(route):
        if (
            route.request.method == "PATCH"
            and route.request.headers.get("upload-offset") == str(2 * 65536)
            and not failed
        ):
            failed.append(route.request.url)
            route.abort("connectionreset")
        else:
            route.continue_()

    page.route("**/api/v1/teams/vision/uploads/**", fail_third_chunk_once)
    page.evaluate("document.getElementById('upload-form').dataset.chunkBytes = '65536'")
    page.set_input_files("#file-input", str(model_file))
    assert "embedder.onnx" in page.locator("#file-name").inner_text()
    page.fill("input[name=max_batch_size]", "16")
    page.fill("input[name=preferred_batch_sizes]", "4,8")
    page.screenshot(path=str(SCREENSHOTS / "upload-page.png"), full_page=True)
    page.click("#upload-button")
    page.wait_for_url("**/teams/vision/conversions/*/", timeout=30_000)
    page.screenshot(path=str(SCREENSHOTS / "upload-done.png"), full_page=True)

    assert failed, "the simulated network error never happened"
    version = ModelVersion.objects.get(model__slug="embedder")
    assert version.sha256 == hashlib.sha256(data).hexdigest()
    assert version.source_format == SourceFormat.ONNX
    assert version.serving_options["max_batch_size"] == 16
    assert version.serving_options["preferred_batch_sizes"] == [4, 8]
    job = version.conversion_jobs.get()
    assert page.url.endswith(f"/teams/vision/conversions/{job.pk}/")


def test_upload_page_shows_field_errors(page, live_server, owner, team, settings, tmp_path):
    settings.ARTIFACT_ROOT = tmp_path / "artifacts"
    services.create_model(actor=owner, team=team, name="Embedder", slug="embedder")
    bad = tmp_path / "weights.h5"
    bad.write_bytes(b"not a model")
    page.goto(f"{live_server.url}/login/")
    page.fill("input[name=username]", "olivia")
    page.fill("input[name=password]", "correct horse battery staple")
    page.click("button[type=submit]")
    page.goto(f"{live_server.url}/teams/vision/models/embedder/upload/")
    page.set_input_files("#file-input", str(bad))
    page.click("#upload-button")
    page.wait_for_selector("#upload-error:not([hidden])")
    assert (
        ".h5" in page.locator('[data-field="filename"]').inner_text()
        or "weights.h5" in page.locator('[data-field="filename"]').inner_text()
    )
    assert not ModelVersion.objects.exists()
