"""Materialize an instance's Triton model repository from the platform's artifacts.

A served model directory is ``<repository>/<team>--<model>/`` holding ``config.pbtxt`` and one numbered
directory per served platform version (Triton version == platform version number). It is always written
whole in a temp directory beside it and renamed into place, so Triton never reads a half-written model.
Model files are hard-linked from ARTIFACT_ROOT when it is on the same filesystem (no copy for multi-GB
models), copied otherwise, and downloaded with sha256 verification when the agent runs on another machine.

Only what is placed gets in: the version's model file(s) (``model.om``/``model.onnx``, regular files, never
through a symbolic link) and a ``config.pbtxt`` rebuilt here from the fields a tenant may set - a defence in
depth behind the registry's checks: a config with any other field is refused and nothing is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from backend_ge import config as ge_config
from backend_ge.executors import MODEL_FILES
from backend_ge.served_config import HOST_INSTANCE_LIMIT, MAX_INSTANCE_COUNT, build_served_config


class RepositoryError(RuntimeError):
    """A model directory could not be written."""


def link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:  # another filesystem, or links not allowed: fall back to a copy
        shutil.copy2(src, dst, follow_symlinks=False)
    if dst.is_symlink():  # the source was swapped for a link after it was checked
        dst.unlink()
        raise RepositoryError(f"{src} became a symbolic link; refused")
    # Readable by the instance's server, which runs as another user (the repository's group). A hard link
    # shares its mode with the artifact store's file: that is safe because ARTIFACT_ROOT itself is 0700.
    os.chmod(dst, 0o644)


def _is_regular_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def servable_model_files(servable: Path) -> list[Path]:
    """The model file(s) of a servable directory (``1/model.om``, ``1/model.onnx``), relative to it.

    The conversion job writes these names and inlines ONNX external data, so nothing else is served.
    A symbolic link anywhere on the way is refused: the repository must not lead anywhere else.
    """
    files_dir = Path(servable) / "1"
    for path in (Path(servable), files_dir):
        if path.is_symlink():
            raise RepositoryError(f"{path} is a symbolic link; refused")
    if not files_dir.is_dir():
        raise RepositoryError(f"{files_dir} is missing (was the version converted?)")
    found = []
    for name in sorted(set(MODEL_FILES.values())):
        path = files_dir / name
        if path.is_symlink():
            raise RepositoryError(f"{path} is a symbolic link; refused")
        if _is_regular_file(path):
            found.append(Path("1") / name)
    if not found:
        raise RepositoryError(f"{files_dir} holds no {' or '.join(sorted(set(MODEL_FILES.values())))}")
    return found


def served_config_text(
    config_text: str,
    triton_name: str,
    versions: list[int],
    *,
    device_ids: Sequence[int] = (),
    max_instance_count: int = MAX_INSTANCE_COUNT,
    instance_limit: str = HOST_INSTANCE_LIMIT,
    steps: Sequence[str] = (),
) -> str:
    """The config Triton reads: rebuilt from the fields a tenant may set, renamed for Triton, pinned to exactly
    the served versions, and given the placing instance's devices. Raises RepositoryError for a config with a
    field a tenant may not set (the registry refuses those; this is the host's own check).

    An explicit version policy lets a switch load the new version beside the old one, and unload the old one
    by pinning only the new one, while the model name clients call never changes.
    """
    try:
        cfg = build_served_config(
            config_text,
            name=triton_name,
            max_instance_count=max_instance_count,
            instance_limit=instance_limit,
            # An ensemble may call only the steps the platform placed with it (each of the same team).
            allowed_models=frozenset(steps) if steps else None,
        )
    except ge_config.ConfigError as exc:
        raise RepositoryError(f"{triton_name}: refusing its config: {exc}") from None
    cfg.version_policy.specific.versions.extend(sorted(versions))
    if cfg.platform == ge_config.ENSEMBLE_PLATFORM:
        return ge_config.render_config(cfg)  # Triton schedules it: no devices
    if device_ids:
        cfg.parameters["DEVICE_ID"].string_value = str(device_ids[0])
        cfg.parameters["device_ids"].string_value = ",".join(str(int(d)) for d in device_ids)
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
    repository: Path,
    triton_name: str,
    versions: Mapping[int, Path],
    config_text: str,
    *,
    device_ids: Sequence[int] = (),
    max_instance_count: int = MAX_INSTANCE_COUNT,
    instance_limit: str = HOST_INSTANCE_LIMIT,
    steps: Sequence[str] = (),
) -> Path:
    """Write ``<repository>/<triton_name>`` serving ``versions`` ({number: servable dir}) atomically.

    Each servable dir is a Triton model directory as the conversion job published it: ``config.pbtxt`` and
    ``1/model.*``; only its model file(s) become ``<number>/model.*`` here, and the config is rebuilt from
    ``config_text`` (see :func:`served_config_text`). An ensemble (``steps``: the models it may call) gets
    empty version folders. Nothing is written when the config or a file is refused.
    """
    if not versions:
        raise RepositoryError(f"{triton_name}: nothing to serve")
    config = served_config_text(
        config_text,
        triton_name,
        list(versions),
        device_ids=device_ids,
        max_instance_count=max_instance_count,
        instance_limit=instance_limit,
        steps=steps,
    )
    files = {}
    for number, servable in versions.items():
        if steps:  # an ensemble: an empty version folder, no model file
            files[number] = (Path(servable), [])
            continue
        try:
            files[number] = (Path(servable), servable_model_files(Path(servable)))
        except RepositoryError as exc:
            raise RepositoryError(f"{triton_name} v{number}: {exc}") from None
    repository.mkdir(parents=True, exist_ok=True)
    tmp = repository / f".tmp-{triton_name}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        for number, (servable, relative_files) in files.items():
            version_dir = tmp / str(number)
            version_dir.mkdir()
            for relative in relative_files:
                link_or_copy(servable / relative, version_dir / relative.name)
        (tmp / "config.pbtxt").write_text(config)
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
    """The files of a servable directory a remote agent downloads (``config.pbtxt`` and the model file(s)),
    each with its size and sha256."""
    paths = [servable / "config.pbtxt"] if _is_regular_file(servable / "config.pbtxt") else []
    # Listed as it is when the model is missing: the agent's materialize_model names what is wrong.
    with contextlib.suppress(RepositoryError):
        paths += [servable / f for f in servable_model_files(servable)]
    entries = []
    for path in paths:
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
