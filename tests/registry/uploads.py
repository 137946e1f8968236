"""Uploads through the API (open, send in chunks, complete) and a view of what landed in the artifact store."""

from __future__ import annotations

import hashlib
from pathlib import Path

CHUNK_TYPE = "application/offset+octet-stream"


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
