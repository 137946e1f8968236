"""Uploads that smuggle a path, a backend, an environment, a process count or another team's model in through a
Triton model directory: each is refused with a 400 naming the field or file, and nothing is stored."""

from __future__ import annotations

import io
import tarfile

import pytest

from apps.registry.models import ModelVersion, UploadSession, UploadState, VersionState
from tests.registry import builders
from tests.registry.hostile_configs import CASES, instances
from tests.registry.uploads import start, upload

pytestmark = pytest.mark.django_db

# An upload's own config in the platform's spelling (the seed's spelling drops DEVICE_ID on normalization).
GE_CONFIG = builders.SEED_CONFIG.replace('platform: "graph_executor"', 'backend: "ge"')


def triton_dir(config: str, extra: dict[str, bytes] | None = None) -> bytes:
    files = {"m/config.pbtxt": config.encode(), "m/1/model.onnx": builders.onnx_bytes()}
    files.update({f"m/{name}": data for name, data in (extra or {}).items()})
    return builders.zip_bytes(files)


def assert_nothing_stored(artifact_root, entry: str) -> None:
    assert [p for p in artifact_root.rglob("*") if p.is_file() or p.is_symlink()] == []
    version = ModelVersion.objects.get()
    assert version.state == VersionState.FAILED and entry in version.error
    assert not version.source_dir().exists()
    assert UploadSession.objects.get().state == UploadState.ABORTED


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_config_in_a_triton_directory_is_refused(owner_client, model, artifact_root, case):
    change, field = CASES[case]
    response = upload(owner_client, "m.zip", triton_dir(change(GE_CONFIG)))
    assert response.status_code == 400, response.json()
    message = response.json()["message"]
    assert f"{field}:" in message and "config.pbtxt" in message, message
    assert_nothing_stored(artifact_root, field)


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_config_with_a_lone_om_is_refused_at_start(owner_client, model, artifact_root, case):
    change, field = CASES[case]
    response = start(owner_client, "net.om", builders.om_bytes(), config_text=change(GE_CONFIG))
    assert response.status_code == 400, response.json()
    messages = response.json()["fields"]["config_text"]
    assert any(m.startswith(f"{field}:") for m in messages), messages
    assert not ModelVersion.objects.exists() and not UploadSession.objects.exists()
    assert [p for p in artifact_root.rglob("*") if p.is_file()] == []


EXTRA_FILES = {
    "python environment script": {"bin/activate": b"#!/bin/sh\nid > /tmp/pwned\n"},
    "shared library": {"1/libtriton_python.so": b"\x7fELF" + b"\0" * 60},
    "second model version": {"2/model.onnx": builders.onnx_bytes()},
    "second model file": {"1/other.onnx": builders.onnx_bytes()},
    "python model": {"1/model.py": b"import os\nos.system('id')\n"},
    "label file": {"labels.txt": b"cat\ndog\n"},
}


@pytest.mark.parametrize("case", sorted(EXTRA_FILES))
def test_extra_file_in_a_triton_directory_is_refused_by_name(owner_client, model, artifact_root, case):
    extra = EXTRA_FILES[case]
    response = upload(owner_client, "m.zip", triton_dir(GE_CONFIG, extra))
    assert response.status_code == 400, response.json()
    name = next(iter(extra))
    assert f"'{name}'" in response.json()["message"], response.json()
    assert_nothing_stored(artifact_root, name)


def test_symlink_in_a_triton_directory_is_refused(owner_client, model, artifact_root):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tf:
        for name, data in (("m/config.pbtxt", GE_CONFIG.encode()), ("m/1/model.onnx", builders.onnx_bytes())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("m/1/weights.bin")
        link.type, link.linkname = tarfile.SYMTYPE, "../../../../../artifacts/teams/1"
        tf.addfile(link)
    response = upload(owner_client, "m.tar.gz", buffer.getvalue())
    assert response.status_code == 400
    assert "1/weights.bin" in response.json()["message"]
    assert_nothing_stored(artifact_root, "1/weights.bin")


def test_unreferenced_file_beside_an_onnx_archive_is_refused(owner_client, model, artifact_root, tmp_path):
    path = builders.onnx_with_external_data(tmp_path / "src")
    archive = builders.zip_bytes(
        {
            "net.onnx": path.read_bytes(),
            "weights.bin": (path.parent / "weights.bin").read_bytes(),
            "bin/activate": b"#!/bin/sh\n",
        }
    )
    response = upload(owner_client, "net.zip", archive)
    assert response.status_code == 400 and "'bin/activate'" in response.json()["message"]
    assert_nothing_stored(artifact_root, "bin/activate")


def test_external_data_the_model_references_is_kept(owner_client, model, tmp_path):
    path = builders.onnx_with_external_data(tmp_path / "src")
    archive = builders.zip_bytes(
        {
            "m/config.pbtxt": b'backend: "ge"\n',
            "m/1/model.onnx": path.read_bytes(),
            "m/1/weights.bin": (path.parent / "weights.bin").read_bytes(),
        }
    )
    response = upload(owner_client, "m.zip", archive)
    assert response.status_code == 200, response.json()
    source = ModelVersion.objects.get().source_dir()
    assert sorted(p.relative_to(source).as_posix() for p in source.rglob("*") if p.is_file()) == [
        "1/model.onnx",
        "1/weights.bin",
        "config.pbtxt",
    ]


def test_stored_config_holds_only_tenant_fields(owner_client, model):
    response = upload(owner_client, "m.zip", triton_dir(builders.SEED_CONFIG))
    assert response.status_code == 200, response.json()
    text = (ModelVersion.objects.get().source_dir() / "config.pbtxt").read_text()
    assert 'backend: "ge"' in text and "EXECUTOR_TYPE" in text
    assert "version_policy" not in text and "default_model_filename" not in text


@pytest.mark.parametrize("count, accepted", [(3, False), (2, True), (1, True)])
def test_instance_count_is_bounded_by_the_teams_quota(owner_client, model, artifact_root, count, accepted):
    model.team.quota_model_instances = 2
    model.team.save(update_fields=["quota_model_instances"])
    config = instances(f"instance_group {{ count: {count} kind: KIND_CPU }}")(GE_CONFIG)
    response = upload(owner_client, "m.zip", triton_dir(config))
    if accepted:
        assert response.status_code == 200, response.json()
        text = (ModelVersion.objects.get().source_dir() / "config.pbtxt").read_text()
        assert f"count: {count}" in text
        return
    assert response.status_code == 400, response.json()
    message = response.json()["message"]
    assert (
        "instance_group[0].count:" in message and "the team's limit (quota_model_instances) is 2" in message
    )
    assert_nothing_stored(artifact_root, "instance_group[0].count")


def test_lone_om_config_and_serving_options_are_bounded_by_the_teams_quota(owner_client, model):
    model.team.quota_model_instances = 2
    model.team.save(update_fields=["quota_model_instances"])
    config = instances("instance_group [{ count: 1 }, { count: 2 }]")(GE_CONFIG)
    response = start(owner_client, "net.om", builders.om_bytes(), config_text=config)
    assert response.status_code == 400, response.json()
    messages = response.json()["fields"]["config_text"]
    assert any(m.startswith("instance_group[1].count:") and "team's limit" in m for m in messages), messages
    response = start(owner_client, "net.onnx", builders.onnx_bytes(), serving_options={"instance_count": 3})
    assert response.status_code == 400 and "instance_count" in response.json()["fields"], response.json()
    assert not ModelVersion.objects.exists()
