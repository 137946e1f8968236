"""Registry fixtures: the folder's model (ResNet 50, the shared ``model`` is the classifier) and an upload
helper speaking the API; the private ARTIFACT_ROOT per test is the shared ``artifact_root``."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from apps.registry import services

CHUNK_TYPE = "application/offset+octet-stream"


@pytest.fixture
def model(owner, team, artifact_root):
    """ResNet 50 of team vision: what the upload tests upload to."""
    return services.create_model(actor=owner, team=team, name="ResNet 50", slug="resnet50")


def models_url(team="vision") -> str:
    return f"/api/v1/teams/{team}/models/"


def start(client, filename: str, data: bytes, *, sha256: str | None = "auto", model="resnet50", **extra):
    body = {"filename": filename, "size": len(data), **extra}
    if sha256 == "auto":
        body["sha256"] = hashlib.sha256(data).hexdigest()
    elif sha256:
        body["sha256"] = sha256
    return client.post(f"{models_url()}{model}/uploads/", body, format="json")


def send(client, url: str, offset: int, chunk: bytes):
    return client.generic("PATCH", url, chunk, content_type=CHUNK_TYPE, HTTP_UPLOAD_OFFSET=str(offset))


def upload(client, filename: str, data: bytes, *, chunks: int = 3, **extra):
    """Open, send in ``chunks`` pieces, complete; returns the completion response."""
    response = start(client, filename, data, **extra)
    assert response.status_code == 201, response.json()
    url = response.json()["url"]
    step = max(1, -(-len(data) // chunks))
    for offset in range(0, len(data), step):
        sent = send(client, url, offset, data[offset : offset + step])
        assert sent.status_code == 200, sent.json()
    return client.post(f"{url}complete/", {}, format="json")


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir())


@pytest.fixture
def v1(classifier, artifact_root):
    """Version 1 of the classifier, READY, with files."""
    from tests.registry.builders import with_files
    from tests.support.models import make_version

    return with_files(make_version(classifier, 1))


@pytest.fixture
def v2(classifier, artifact_root):
    """Version 2 of the classifier, READY, with files."""
    from tests.registry.builders import with_files
    from tests.support.models import make_version

    return with_files(make_version(classifier, 2))
