"""Agents on other machines fetch converted models from the platform: a manifest with sha256 per file, then
each file, verified before it is used. Authenticated with the agent key (settings.AGENT_KEY)."""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from pathlib import Path

import requests
from django.conf import settings

from apps.fleet.repository import RepositoryError
from apps.registry.models import ModelVersion

AGENT_KEY_HEADER = "X-Agent-Key"


class ArtifactDownloadError(RepositoryError):
    """The version's files could not be fetched from the platform."""


def _reason(response: requests.Response) -> str:
    """The platform's own explanation (its API error shape), else the start of the body."""
    try:
        return str(response.json()["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


def download_servable(version: ModelVersion, cache_root: Path) -> Path:
    """Download the version's servable directory into ``cache_root/<version id>``, verifying every file."""
    target = cache_root / str(version.pk)
    if (target / "config.pbtxt").is_file():
        return target
    if not settings.PLATFORM_URL or not settings.AGENT_KEY:
        raise ArtifactDownloadError(
            f"{version}: its files are not on this machine and PLATFORM_URL/AGENT_KEY are not set to download them"
        )
    base = f"{settings.PLATFORM_URL.rstrip('/')}/api/v1/agent/versions/{version.pk}"
    headers = {AGENT_KEY_HEADER: settings.AGENT_KEY}
    response = requests.get(f"{base}/manifest", headers=headers, timeout=30)
    if response.status_code != 200:
        raise ArtifactDownloadError(
            f"{version}: the platform at {settings.PLATFORM_URL} refused the manifest request "
            f"(HTTP {response.status_code}): {_reason(response)}"
        )
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = cache_root / f".tmp-{version.pk}-{uuid.uuid4().hex[:8]}"
    try:
        for entry in response.json()["files"]:
            relative = Path(entry["path"])
            if relative.is_absolute() or ".." in relative.parts:
                raise ArtifactDownloadError(f"{version}: refusing manifest path {entry['path']!r}")
            destination = tmp / relative
            destination.parent.mkdir(parents=True, exist_ok=True)
            digest = hashlib.sha256()
            with requests.get(
                f"{base}/files/{relative.as_posix()}", headers=headers, stream=True, timeout=60
            ) as r:
                if r.status_code != 200:
                    raise ArtifactDownloadError(f"{version}: download of {relative} failed ({r.status_code})")
                with destination.open("wb") as handle:
                    for chunk in r.iter_content(1 << 20):
                        digest.update(chunk)
                        handle.write(chunk)
            if digest.hexdigest() != entry["sha256"]:
                raise ArtifactDownloadError(
                    f"{version}: {relative} does not match its sha256; download discarded"
                )
        if target.exists():
            shutil.rmtree(target)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
