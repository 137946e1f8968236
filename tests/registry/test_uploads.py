import hashlib
import io
import tarfile
import zipfile

import pytest

from apps.audit.models import AuditEvent
from apps.conversions.models import ConversionJob
from apps.registry.models import ModelVersion, SourceFormat, UploadSession, VersionState
from tests.registry import builders
from tests.registry.uploads import files_under, models_url, send, start, upload

pytestmark = pytest.mark.django_db


def test_upload_in_chunks_installs_source_and_queues_conversion(
    maintainer_client, model, artifact_root, django_capture_on_commit_callbacks, monkeypatch
):
    enqueued = []
    monkeypatch.setattr("apps.conversions.services.enqueue_conversion", enqueued.append)
    data = builders.onnx_bytes()
    with django_capture_on_commit_callbacks(execute=True):
        response = upload(
            maintainer_client,
            "resnet.onnx",
            data,
            chunks=4,
            serving_options={"max_batch_size": 16, "preferred_batch_sizes": [4, 8]},
            conversion_options={"precision_mode": "allow_fp32_to_fp16"},
        )
    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["number"] == 1
    assert body["state"] == VersionState.CONVERTING
    assert body["source_format"] == SourceFormat.ONNX
    assert body["sha256"] == hashlib.sha256(data).hexdigest()
    version = ModelVersion.objects.get(model=model, number=1)
    assert (version.source_dir() / "model.onnx").read_bytes() == data
    assert version.serving_options["max_batch_size"] == 16
    assert version.serving_options["preferred_batch_sizes"] == [4, 8]
    job = ConversionJob.objects.get(version=version)
    assert job.options["precision_mode"] == "allow_fp32_to_fp16"
    assert job.options["soc_version"] == "Ascend310P3"  # the team default
    assert enqueued == [job.pk]
    assert body["latest_job"]["id"] == job.pk
    # the part file is consumed: only the version's files remain
    assert files_under(artifact_root) == [str(version.source_dir().relative_to(artifact_root) / "model.onnx")]
    assert AuditEvent.objects.filter(action="upload.completed", details__sha256=body["sha256"]).exists()


def test_version_numbers_increase(owner_client, model):
    data = builders.onnx_bytes()
    for expected in (1, 2):
        response = start(owner_client, "m.onnx", data)
        assert response.json()["version"] == expected
    listing = owner_client.get(f"{models_url()}resnet50/versions/").json()["results"]
    assert [v["number"] for v in listing] == [2, 1]
    assert all(v["state"] == "UPLOADING" for v in listing)


class DroppingStream:
    """The request body as a WSGI server delivers it when the client vanishes: an OSError mid-body."""

    def __init__(self, stream, after: int) -> None:
        self.stream, self.left = stream, after

    def read(self, size: int) -> bytes:
        if self.left <= 0:
            raise OSError("connection reset by peer")
        piece = self.stream.read(min(size, self.left))
        self.left -= len(piece)
        return piece


def test_resume_after_a_dropped_connection(owner_client, model, monkeypatch):
    from apps.registry import services

    data = builders.onnx_bytes()
    url = start(owner_client, "m.onnx", data).json()["url"]
    half = len(data) // 2
    real = services.receive_chunk

    def dropping(*, stream, **kwargs):
        return real(stream=DroppingStream(stream, half), **kwargs)

    monkeypatch.setattr(services, "receive_chunk", dropping)
    dropped = send(owner_client, url, 0, data)
    assert dropped.status_code == 400
    assert dropped.json()["error"] == "incomplete"
    assert dropped.json()["offset"] == half
    monkeypatch.setattr(services, "receive_chunk", real)
    status = owner_client.head(url)
    assert status.status_code == 200
    assert status["Upload-Offset"] == str(half)
    assert owner_client.get(url).json()["offset"] == half
    assert send(owner_client, url, half, data[half:]).status_code == 200
    done = owner_client.post(f"{url}complete/", {}, format="json")
    assert done.status_code == 200, done.json()
    assert done.json()["sha256"] == hashlib.sha256(data).hexdigest()


def test_offset_mismatch_is_409_with_server_offset(owner_client, model):
    data = builders.onnx_bytes()
    url = start(owner_client, "m.onnx", data).json()["url"]
    assert send(owner_client, url, 0, data[:10]).status_code == 200
    response = send(owner_client, url, 5, data[5:20])
    assert response.status_code == 409
    assert response.json()["error"] == "offset_mismatch"
    assert response.json()["offset"] == 10
    assert response["Upload-Offset"] == "10"
    assert UploadSession.objects.get().received_bytes == 10


def test_missing_offset_header_is_400(owner_client, model):
    url = start(owner_client, "m.onnx", builders.onnx_bytes()).json()["url"]
    response = owner_client.generic("PATCH", url, b"abc", content_type="application/offset+octet-stream")
    assert response.status_code == 400
    assert "Upload-Offset" in response.json()["message"]


def test_chunk_past_declared_size_is_413(owner_client, model):
    url = start(owner_client, "m.onnx", b"\x08" * 10).json()["url"]
    response = send(owner_client, url, 0, b"\x08" * 11)
    assert response.status_code == 413
    assert UploadSession.objects.get().received_bytes == 0


def test_sha256_mismatch_is_400_and_nothing_is_kept(owner_client, model, artifact_root):
    data = builders.onnx_bytes()
    response = upload(owner_client, "m.onnx", data, sha256="0" * 64)
    assert response.status_code == 400
    assert "sha256 mismatch" in response.json()["message"]
    assert files_under(artifact_root) == []
    version = ModelVersion.objects.get()
    assert version.state == VersionState.FAILED
    assert "sha256 mismatch" in version.error
    assert not ConversionJob.objects.exists()


def test_sha256_may_be_given_at_completion(owner_client, model):
    data = builders.onnx_bytes()
    url = start(owner_client, "m.onnx", data, sha256=None).json()["url"]
    send(owner_client, url, 0, data)
    response = owner_client.post(f"{url}complete/", {"sha256": "f" * 64}, format="json")
    assert response.status_code == 400
    assert response.json()["fields"]["sha256"]


def test_over_the_size_limit_is_413_with_the_limit(owner_client, model, settings):
    settings.UPLOAD_MAX_BYTES = 1000
    response = start(owner_client, "m.onnx", b"x" * 1001)
    assert response.status_code == 413
    assert response.json()["limit"] == 1000
    assert "1000 bytes" in response.json()["message"]
    assert not ModelVersion.objects.exists()


def test_default_limit_is_8_gib_in_the_message(owner_client, model):
    response = owner_client.post(
        f"{models_url()}resnet50/uploads/", {"filename": "m.onnx", "size": 9 * 1024**3}, format="json"
    )
    assert response.status_code == 413
    assert "8 GiB" in response.json()["message"]


def test_unknown_extension_is_400(owner_client, model):
    response = start(owner_client, "model.h5", b"abc")
    assert response.status_code == 400
    assert ".h5" in response.json()["fields"]["filename"][0] or "model.h5" in response.json()["message"]


def test_bad_serving_option_is_400_field_error(owner_client, model):
    response = start(
        owner_client, "m.onnx", b"abc", serving_options={"max_batch_size": 4, "preferred_batch_sizes": [8]}
    )
    assert response.status_code == 400
    assert "exceed" in response.json()["fields"]["preferred_batch_sizes"][0]


def test_completing_early_is_400_with_offset(owner_client, model):
    data = builders.onnx_bytes()
    url = start(owner_client, "m.onnx", data).json()["url"]
    send(owner_client, url, 0, data[:7])
    response = owner_client.post(f"{url}complete/", {}, format="json")
    assert response.status_code == 400
    assert "from offset 7" in response.json()["message"]


def test_complete_is_idempotent(owner_client, model):
    data = builders.onnx_bytes()
    first = upload(owner_client, "m.onnx", data)
    url = UploadSession.objects.get().pk
    again = owner_client.post(f"/api/v1/teams/vision/uploads/{url}/complete/", {}, format="json")
    assert again.status_code == 200
    assert again.json()["number"] == first.json()["number"]
    assert ConversionJob.objects.count() == 1


def test_abort_deletes_version_and_bytes(owner_client, model, artifact_root):
    data = builders.onnx_bytes()
    url = start(owner_client, "m.onnx", data).json()["url"]
    send(owner_client, url, 0, data[:10])
    assert owner_client.delete(url).status_code == 204
    assert not ModelVersion.objects.exists()
    assert files_under(artifact_root) == []
    assert AuditEvent.objects.filter(action="upload.aborted").exists()


# --- formats ------------------------------------------------------------------------------------


def _onnx_archive(tmp_path, kind: str) -> bytes:
    path = builders.onnx_with_external_data(tmp_path / "src")
    files = {f"bundle/{p.name}": p.read_bytes() for p in path.parent.iterdir()}
    if kind == "zip":
        return builders.zip_bytes(files)
    return builders.tar_gz_bytes([builders.tar_file(n, d) for n, d in files.items()])


@pytest.mark.parametrize(
    ("filename", "make", "fmt", "installed"),
    [
        ("net.onnx", lambda tmp: builders.onnx_bytes(), SourceFormat.ONNX, ["model.onnx"]),
        (
            "net.zip",
            lambda tmp: _onnx_archive(tmp, "zip"),
            SourceFormat.ONNX_ARCHIVE,
            ["model.onnx", "weights.bin"],
        ),
        (
            "net.tar.gz",
            lambda tmp: _onnx_archive(tmp, "tar"),
            SourceFormat.ONNX_ARCHIVE,
            ["model.onnx", "weights.bin"],
        ),
        ("frozen.pb", lambda tmp: builders.graphdef_bytes(), SourceFormat.TENSORFLOW, ["model.pb"]),
        ("net.pt", lambda tmp: builders.torchscript_bytes(), SourceFormat.TORCHSCRIPT, ["model.pt"]),
        ("net.om", lambda tmp: builders.om_bytes(), SourceFormat.OM, ["model.om"]),
        (
            "mlp.zip",
            lambda tmp: builders.zip_bytes(
                {"mlp/config.pbtxt": builders.SEED_CONFIG.encode(), "mlp/1/model.onnx": builders.onnx_bytes()}
            ),
            SourceFormat.TRITON_REPOSITORY,
            ["1/model.onnx", "config.pbtxt"],
        ),
    ],
)
def test_every_format_is_accepted(owner_client, model, tmp_path, filename, make, fmt, installed):
    response = upload(owner_client, filename, make(tmp_path))
    assert response.status_code == 200, response.json()
    assert response.json()["source_format"] == fmt
    version = ModelVersion.objects.get()
    assert files_under(version.source_dir()) == installed


def test_seed_style_triton_config_is_normalized(owner_client, model):
    archive = builders.zip_bytes(
        {"config.pbtxt": builders.SEED_CONFIG.encode(), "1/model.onnx": builders.onnx_bytes()}
    )
    assert upload(owner_client, "mlp.zip", archive).status_code == 200
    text = (ModelVersion.objects.get().source_dir() / "config.pbtxt").read_text()
    assert 'backend: "ge"' in text and "graph_executor" not in text
    assert "EXECUTOR_TYPE" in text


def test_lone_om_with_config(owner_client, model):
    response = upload(owner_client, "net.om", builders.om_bytes(), config_text=builders.SEED_CONFIG)
    assert response.status_code == 200, response.json()
    assert 'backend: "ge"' in (ModelVersion.objects.get().source_dir() / "config.pbtxt").read_text()


def test_config_for_om_is_validated_at_start(owner_client, model):
    response = start(
        owner_client, "net.om", builders.om_bytes(), config_text='name: "x" backend: "ge" bogus: 1'
    )
    assert response.status_code == 400
    assert "bogus" in response.json()["fields"]["config_text"][0]


@pytest.mark.parametrize(
    ("filename", "data", "needle"),
    [
        ("net.onnx", b"this is not onnx", "not an ONNX model"),
        ("net.pb", b"PK\x03\x04junk", "not a TensorFlow frozen graph"),
        ("net.om", b"tiny", "too small"),
    ],
)
def test_wrong_content_for_the_extension_is_400(owner_client, model, artifact_root, filename, data, needle):
    response = upload(owner_client, filename, data, chunks=1)
    assert response.status_code == 400
    assert needle in response.json()["message"]
    assert files_under(artifact_root) == []


# --- downloads and tenancy ----------------------------------------------------------------------


def test_artifact_download_streams_a_zip_of_the_source(viewer_client, owner_client, model):
    data = builders.onnx_bytes()
    upload(owner_client, "m.onnx", data)
    response = viewer_client.get(f"{models_url()}resnet50/versions/1/artifact/")
    assert response.status_code == 200
    assert response["Content-Type"] == "application/zip"
    assert "vision__resnet50-v1-source.zip" in response["Content-Disposition"]
    archive = zipfile.ZipFile(io.BytesIO(b"".join(response.streaming_content)))
    assert archive.read("model.onnx") == data
    missing = viewer_client.get(f"{models_url()}resnet50/versions/1/artifact/", {"kind": "model"})
    assert missing.status_code == 400
    assert "no model files" in missing.json()["message"]


def test_artifact_download_of_servable_model(viewer_client, owner_client, model):
    upload(owner_client, "m.onnx", builders.onnx_bytes())
    servable = ModelVersion.objects.get().servable_dir()
    (servable / "1").mkdir(parents=True)
    (servable / "1" / "model.onnx").write_bytes(b"compiled")
    (servable / "config.pbtxt").write_text('name: "vision__resnet50"\n')
    response = viewer_client.get(f"{models_url()}resnet50/versions/1/artifact/")
    archive = zipfile.ZipFile(io.BytesIO(b"".join(response.streaming_content)))
    assert sorted(archive.namelist()) == ["1/model.onnx", "config.pbtxt"]


def test_outsider_gets_404_for_versions_uploads_and_artifacts(outsider_client, owner_client, model):
    data = builders.onnx_bytes()
    url = start(owner_client, "m.onnx", data).json()["url"]
    base = f"{models_url()}resnet50/versions/1/"
    for response in (
        outsider_client.get(base),
        outsider_client.get(f"{base}artifact/"),
        outsider_client.get(url),
        outsider_client.head(url),
        send(outsider_client, url, 0, data),
        outsider_client.post(f"{url}complete/", {}, format="json"),
        outsider_client.delete(url),
        # even through the outsider's own team, another team's upload id is unknown
        outsider_client.get(url.replace("/vision/", "/speech/")),
    ):
        assert response.status_code == 404
    assert UploadSession.objects.get().received_bytes == 0


def test_viewer_gets_403_on_upload_writes(viewer_client, owner_client, model):
    data = builders.onnx_bytes()
    url = start(owner_client, "m.onnx", data).json()["url"]
    assert viewer_client.get(url).status_code == 200
    assert send(viewer_client, url, 0, data).status_code == 403
    assert viewer_client.post(f"{url}complete/", {}, format="json").status_code == 403
    assert viewer_client.delete(url).status_code == 403
    assert UploadSession.objects.get().received_bytes == 0


def test_tar_helper_builds_what_it_says():
    raw = builders.tar_gz_bytes([builders.tar_file("a/b.txt", b"hi")])
    with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
        assert tf.getnames() == ["a/b.txt"]
