"""Materialize an instance's Triton model repository from the platform's artifacts.

A served model directory is ``<repository>/<team>--<model>/`` holding ``config.pbtxt`` and one numbered
directory per served platform version (Triton version == platform version number). It is always written
whole in a temp directory beside it and renamed into place, so Triton never reads a half-written model.
Model files are hard-linked from ARTIFACT_ROOT when it is on the same filesystem (no copy for multi-GB
models), copied otherwise, and downloaded with sha256 verification when the agent runs on another machine.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path

from backend_ge import config as ge_config


class RepositoryError(RuntimeError):
    """A model directory could not be written."""


def link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed: fall back to a copy
        shutil.copy2(src, dst)


def served_config_text(config_text: str, triton_name: str, versions: list[int]) -> str:
    """The version's generated config, renamed for Triton and pinned to exactly the served versions.

    An explicit version policy lets a switch load the new version beside the old one, and unload the old one
    by pinning only the new one, while the model name clients call never changes.
    """
    cfg = ge_config.parse_config(config_text)
    cfg.name = triton_name
    cfg.version_policy.Clear()
    cfg.version_policy.specific.versions.extend(sorted(versions))
    return ge_config.render_config(cfg)


def _replace_dir(tmp: Path, target: Path) -> None:
    old = None
    if target.exists():
        old = target.with_name(f".old-{target.name}-{uuid.uuid4().hex[:8]}")
        os.rename(target, old)
    os.rename(tmp, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def materialize_model(
    repository: Path, triton_name: str, versions: Mapping[int, Path], config_text: str
) -> Path:
    """Write ``<repository>/<triton_name>`` serving ``versions`` ({number: servable dir}) atomically.

    Each servable dir is a Triton model directory as the conversion job published it: ``config.pbtxt`` and
    ``1/model.*``; its ``1/`` becomes ``<number>/`` here.
    """
    if not versions:
        raise RepositoryError(f"{triton_name}: nothing to serve")
    repository.mkdir(parents=True, exist_ok=True)
    tmp = repository / f".tmp-{triton_name}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        for number, servable in versions.items():
            files_dir = Path(servable) / "1"
            if not files_dir.is_dir():
                raise RepositoryError(
                    f"{triton_name} v{number}: {files_dir} is missing (was the version converted?)"
                )
            version_dir = tmp / str(number)
            version_dir.mkdir()
            for entry in files_dir.rglob("*"):
                target = version_dir / entry.relative_to(files_dir)
                if entry.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    link_or_copy(entry, target)
        (tmp / "config.pbtxt").write_text(served_config_text(config_text, triton_name, list(versions)))
        _replace_dir(tmp, repository / triton_name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return repository / triton_name


def remove_model(repository: Path, triton_name: str) -> None:
    target = repository / triton_name
    if target.exists():
        trash = target.with_name(f".old-{triton_name}-{uuid.uuid4().hex[:8]}")
        os.rename(target, trash)
        shutil.rmtree(trash, ignore_errors=True)


def file_manifest(servable: Path) -> list[dict]:
    """Every file of a servable directory with its size and sha256: what a remote agent downloads."""
    entries = []
    for path in sorted(p for p in servable.rglob("*") if p.is_file()):
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        entries.append(
            {
                "path": path.relative_to(servable).as_posix(),
                "size": path.stat().st_size,
                "sha256": digest.hexdigest(),
            }
        )
    return entries
