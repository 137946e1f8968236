"""Hostile uploads: each is refused with a 400 naming the entry, and nothing is written anywhere."""

import tarfile
import uuid
import zipfile

import pytest

from apps.registry.models import ModelVersion, UploadSession, UploadState, VersionState
from tests.registry import builders
from tests.registry.uploads import upload

pytestmark = pytest.mark.django_db

OUTSIDE_ABSOLUTE = f"/tmp/registry-escape-{uuid.uuid4().hex}"


def _escaping_onnx_zip(tmp_path) -> bytes:
    path = builders.onnx_with_external_data(tmp_path / "src", location="../../../../etc/passwd")
    return builders.zip_bytes(
        {"net.onnx": path.read_bytes(), "weights.bin": (path.parent / "weights.bin").read_bytes()}
    )


def _absolute_onnx_location_zip(tmp_path) -> bytes:
    path = builders.onnx_with_external_data(tmp_path / "src", location="/etc/passwd")
    return builders.zip_bytes({"net.onnx": path.read_bytes()})


CASES = {
    "zip-slip": (
        "evil.zip",
        lambda tmp: builders.zip_bytes({"ok.txt": b"1", "../../evil.txt": b"pwned"}),
        "../../evil.txt",
    ),
    "tar-slip": (
        "evil.tar.gz",
        lambda tmp: builders.tar_gz_bytes([builders.tar_file("a/../../evil.txt", b"x")]),
        "a/../../evil.txt",
    ),
    "absolute path": (
        "evil.tar.gz",
        lambda tmp: builders.tar_gz_bytes([builders.tar_file(OUTSIDE_ABSOLUTE, b"x")]),
        OUTSIDE_ABSOLUTE,
    ),
    "zip absolute path": (
        "evil.zip",
        lambda tmp: builders.zip_bytes({"/etc/cron.d/evil": b"x"}),
        "/etc/cron.d/evil",
    ),
    "tar symlink": (
        "evil.tar.gz",
        lambda tmp: builders.tar_gz_bytes(
            [builders.tar_special("link", tarfile.SYMTYPE, "/etc"), builders.tar_file("link/passwd", b"x")]
        ),
        "link",
    ),
    "zip symlink": ("evil.zip", lambda tmp: builders.zip_symlink("model.onnx", "/etc/passwd"), "model.onnx"),
    "hardlink": (
        "evil.tar.gz",
        lambda tmp: builders.tar_gz_bytes(
            [builders.tar_special("model.onnx", tarfile.LNKTYPE, "/etc/passwd")]
        ),
        "model.onnx",
    ),
    "device": (
        "evil.tar.gz",
        lambda tmp: builders.tar_gz_bytes([builders.tar_special("null", tarfile.CHRTYPE)]),
        "null",
    ),
    "fifo": (
        "evil.tar.gz",
        lambda tmp: builders.tar_gz_bytes([builders.tar_special("pipe", tarfile.FIFOTYPE)]),
        "pipe",
    ),
    "bomb": (
        "bomb.zip",
        lambda tmp: builders.zip_bytes(
            {"model.onnx": builders.onnx_bytes(), "weights.bin": b"\0" * (64 * 1024**2)}
        ),
        "weights.bin",
    ),
    "10,000 members": (
        "many.zip",
        lambda tmp: builders.zip_bytes({f"f{i}.bin": b"" for i in range(10_000)}, zipfile.ZIP_STORED),
        "f2000.bin",
    ),
    "duplicate member": ("dup.zip", lambda tmp: _duplicate_zip(), "model.onnx"),
    "onnx external data escaping": ("net.zip", _escaping_onnx_zip, "../../../../etc/passwd"),
    "onnx external data absolute": ("net.zip", _absolute_onnx_location_zip, "/etc/passwd"),
    "pickled state dict .pt": ("net.pt", lambda tmp: builders.state_dict_zip_bytes(), "archive/data.pkl"),
    "legacy pickle .pt": ("net.pt", lambda tmp: builders.legacy_pickle_bytes(), "net.pt"),
}


def _duplicate_zip() -> bytes:
    import io

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr("model.onnx", builders.onnx_bytes())
        with pytest.warns(UserWarning):
            zf.writestr("model.onnx", b"\x08second")
    return buffer.getvalue()


@pytest.mark.parametrize("case", list(CASES))
def test_malicious_upload_is_rejected_and_leaves_nothing(owner_client, model, artifact_root, tmp_path, case):
    filename, make, entry = CASES[case]
    data = make(tmp_path)
    before = {p for p in (tmp_path / "sandbox").rglob("*")}
    response = upload(owner_client, filename, data, chunks=2)

    assert response.status_code == 400, response.json()
    message = response.json()["message"]
    assert entry in message, message
    # Nothing written outside ARTIFACT_ROOT, and no files (part, temp dirs, partial trees) inside it.
    after = {p for p in (tmp_path / "sandbox").rglob("*")}
    assert {p for p in after - before if not p.is_relative_to(artifact_root)} == set()
    assert [p for p in artifact_root.rglob("*") if p.is_file() or p.name.startswith(".")] == []
    assert not (tmp_path / "evil.txt").exists() and not (tmp_path / "sandbox" / "evil.txt").exists()
    import os

    assert not os.path.exists(OUTSIDE_ABSOLUTE)
    version = ModelVersion.objects.get()
    assert version.state == VersionState.FAILED
    assert entry in version.error
    assert UploadSession.objects.get().state == UploadState.ABORTED


def test_pickled_state_dict_message_says_to_export(owner_client, model):
    response = upload(owner_client, "net.pt", builders.state_dict_zip_bytes())
    assert "torch.jit.save" in response.json()["message"]
    assert "torch.onnx.export" in response.json()["message"]


def test_total_unpacked_size_limit(owner_client, model, artifact_root, settings):
    import os

    settings.UPLOAD_ARCHIVE_MAX_UNPACKED_BYTES = 1024**2
    archive = builders.zip_bytes(
        {"model.onnx": builders.onnx_bytes(), "weights.bin": os.urandom(2 * 1024**2)}
    )
    response = upload(owner_client, "big.zip", archive)
    assert response.status_code == 400
    assert "unpacks to more than 1048576 bytes" in response.json()["message"]
    assert "weights.bin" in response.json()["message"]
    assert [p for p in artifact_root.rglob("*") if p.is_file()] == []


def test_onnx_external_data_missing_file(owner_client, model, tmp_path):
    path = builders.onnx_with_external_data(tmp_path / "src")
    response = upload(owner_client, "net.zip", builders.zip_bytes({"net.onnx": path.read_bytes()}))
    assert response.status_code == 400
    assert "weights.bin" in response.json()["message"] and "missing" in response.json()["message"]


def test_large_onnx_is_inspected_in_a_child_process(owner_client, model, monkeypatch, tmp_path):
    from apps.registry import formats

    monkeypatch.setattr(formats, "ONNX_IN_PROCESS_MAX_BYTES", 10)
    response = upload(owner_client, "net.zip", _escaping_onnx_zip(tmp_path))
    assert response.status_code == 400
    assert "../../../../etc/passwd" in response.json()["message"]
    assert upload(owner_client, "ok.onnx", builders.onnx_bytes()).status_code == 200
