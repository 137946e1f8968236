"""Recognise and validate an uploaded model, and lay it out in the version's source directory.

The layout the conversion job reads (``source/`` of a version):

========================  ================================================================
``onnx``                  ``model.onnx``
``onnx_archive``          ``model.onnx`` + its external-data files (locations checked)
``tensorflow``            ``model.pb``
``torchscript``           ``model.pt`` (zip checked, never unpickled)
``om``                    ``model.om``
``triton_repository``     ``config.pbtxt`` (rebuilt from the fields a tenant may set) + ``1/model.<ext>``
                          (+ the external data ``1/model.onnx`` references, inside ``1/``)
========================  ================================================================

An archive holds the model and nothing else: any other file (a script, a shared library, a second model,
a symbolic link) is refused by name. Every check only reads headers and structure: nothing is unpickled or
executed, and external ONNX data is never loaded.
"""

from __future__ import annotations

import os
import shutil
import uuid
import zipfile
from pathlib import Path, PurePosixPath

from apps.registry.archives import ArchiveRejected, Limits, extract_archive, unwrap_single_directory
from apps.registry.models import SourceFormat
from apps.registry.onnx_check import OnnxRejected, check_onnx, check_onnx_in_child
from apps.registry.options import UPLOADED_CONFIG_NAME
from backend_ge import config as gc
from backend_ge import naming
from backend_ge.served_config import MAX_INSTANCE_COUNT, TEAM_INSTANCE_LIMIT, build_served_config

ARCHIVE = "archive"
# Name ending -> what the upload claims to be; archives are resolved after extraction.
EXTENSIONS: dict[str, str] = {
    ".onnx": SourceFormat.ONNX,
    ".pb": SourceFormat.TENSORFLOW,
    ".pt": SourceFormat.TORCHSCRIPT,
    ".pth": SourceFormat.TORCHSCRIPT,
    ".torchscript": SourceFormat.TORCHSCRIPT,
    ".om": SourceFormat.OM,
    ".zip": ARCHIVE,
    ".tar.gz": ARCHIVE,
    ".tgz": ARCHIVE,
    ".tar": ARCHIVE,
}
MODEL_FILE = {
    SourceFormat.ONNX: "model.onnx",
    SourceFormat.TENSORFLOW: "model.pb",
    SourceFormat.TORCHSCRIPT: "model.pt",
    SourceFormat.OM: "model.om",
}
_INNER_SUFFIX_FORMAT = {
    ".onnx": SourceFormat.ONNX,
    ".pb": SourceFormat.TENSORFLOW,
    ".pt": SourceFormat.TORCHSCRIPT,
    ".om": SourceFormat.OM,
}
# Graphs larger than this are parsed in a child process so the web worker's memory stays flat.
ONNX_IN_PROCESS_MAX_BYTES = 64 * 1024**2


class FormatRejected(ArchiveRejected):
    """The upload is not a model the platform accepts; ``entry`` names the file at fault."""


def claimed_format(filename: str) -> str:
    """The format a file name announces, or ValueError listing what is accepted."""
    lower = filename.lower()
    for suffix in sorted(EXTENSIONS, key=len, reverse=True):
        if lower.endswith(suffix) and len(lower) > len(suffix):
            return EXTENSIONS[suffix]
    accepted = ", ".join(EXTENSIONS)
    raise ValueError(f"'{filename}' has no supported extension; upload one of: {accepted}.")


def _onnx(path: Path, root: Path, shown: str) -> list[str]:
    """Check an ONNX graph; returns its external-data files relative to ``root``."""
    try:
        if path.stat().st_size > ONNX_IN_PROCESS_MAX_BYTES:
            return check_onnx_in_child(path, root, shown)
        return check_onnx(path, root, shown)
    except OnnxRejected as exc:
        raise FormatRejected(str(exc), exc.entry) from None


def check_only_model_files(source: Path, allowed: set[str], what: str) -> None:
    """Refuse every entry of an unpacked upload that is not one of ``allowed`` (POSIX paths relative to
    ``source``) or a directory holding one: scripts, libraries, second models and links never get stored.
    Links are named first, then files, then directories that hold nothing allowed."""
    parents = {str(parent) for name in allowed for parent in PurePosixPath(name).parents} - {"."}
    links, files, dirs = [], [], []
    for directory, dirnames, filenames in os.walk(source, followlinks=False):
        for name in dirnames + filenames:
            path = Path(directory) / name
            shown = path.relative_to(source).as_posix()
            if path.is_symlink():
                links.append(shown)
            elif path.is_dir():
                dirs.append(shown)
            else:
                files.append(shown)
    if links:
        shown = sorted(links)[0]
        raise FormatRejected(f"'{shown}' is a symbolic link; upload regular files only", shown)
    for shown in sorted(n for n in files if n not in allowed) + sorted(n for n in dirs if n not in parents):
        raise FormatRejected(f"'{shown}' is not part of the model: {what}; remove it and upload again", shown)


def check_torchscript(path: Path, shown: str) -> None:
    """Accept what ``torch.jit.save`` writes: a zip with ``<name>/code/`` and ``<name>/data.pkl`` or
    ``constants.pkl``. Pickles (``torch.save``) are refused by structure alone - never unpickled."""
    advice = (
        "export the model with torch.jit.save(torch.jit.script(model), ...) or torch.onnx.export and "
        "upload that; pickles are never loaded by the platform"
    )
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as fh:
            head = fh.read(2)
        if head[:1] == b"\x80":
            raise FormatRejected(
                f"'{shown}' is a legacy pickle (torch.save), not TorchScript: {advice}", shown
            )
        raise FormatRejected(f"'{shown}' is not a TorchScript archive: {advice}", shown)
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
    except zipfile.BadZipFile as exc:
        raise FormatRejected(f"'{shown}' is a damaged zip: {exc}", shown) from None
    parts = [PurePosixPath(n).parts for n in names]
    has_code = any(len(p) >= 3 and p[1] == "code" for p in parts)
    pickles = [
        n for n, p in zip(names, parts, strict=True) if len(p) == 2 and p[1] in ("data.pkl", "constants.pkl")
    ]
    if has_code and pickles:
        return
    if pickles:
        raise FormatRejected(
            f"'{shown}' is a pickled state dict (torch.save; '{pickles[0]}' without code/), not TorchScript: {advice}",
            pickles[0],
        )
    raise FormatRejected(f"'{shown}' is a zip but not a TorchScript archive: {advice}", shown)


def check_tensorflow(path: Path, shown: str) -> None:
    with open(path, "rb") as fh:
        head = fh.read(4)
    # A frozen GraphDef is serialized field by field: the first is `node` (field 1, length-delimited).
    if not head or head[0] != 0x0A or head.startswith(b"PK"):
        raise FormatRejected(
            f"'{shown}' is not a TensorFlow frozen graph (GraphDef .pb); SavedModel directories are not supported",
            shown,
        )


def check_om(path: Path, shown: str) -> None:
    if path.stat().st_size < 256:
        raise FormatRejected(f"'{shown}' is too small to be an Ascend offline model (.om)", shown)
    if zipfile.is_zipfile(path):
        raise FormatRejected(f"'{shown}' is a zip archive, not an Ascend offline model (.om)", shown)


def check_model_file(fmt: str, path: Path, root: Path, shown: str) -> None:
    if fmt == SourceFormat.ONNX:
        _onnx(path, root, shown)
    elif fmt == SourceFormat.TORCHSCRIPT:
        check_torchscript(path, shown)
    elif fmt == SourceFormat.TENSORFLOW:
        check_tensorflow(path, shown)
    elif fmt == SourceFormat.OM:
        check_om(path, shown)


def _check_triton_dir(source: Path, max_instances: int = MAX_INSTANCE_COUNT) -> None:
    candidates = (
        sorted(p for p in (source / "1").glob("model.*") if p.is_file()) if (source / "1").is_dir() else []
    )
    models = [p for p in candidates if p.suffix in _INNER_SUFFIX_FORMAT]
    if len(models) != 1:
        raise FormatRejected(
            "a Triton model directory needs config.pbtxt and exactly one 1/model.onnx, 1/model.om, "
            "1/model.pb or 1/model.pt",
            "1/",
        )
    model = models[0]
    fmt = _INNER_SUFFIX_FORMAT[model.suffix]
    allowed = {"config.pbtxt", f"1/{model.name}"}
    # Links would not survive the checks below; refuse them before anything reads through one.
    check_only_model_files(source, allowed | _every_regular_file(source), _TRITON_LAYOUT)
    if fmt == SourceFormat.ONNX:
        # External data must sit in the version directory, beside the graph that reads it.
        allowed |= {f"1/{name}" for name in _onnx(model, source / "1", f"1/{model.name}")}
    else:
        check_model_file(fmt, model, source, f"1/{model.name}")
    check_only_model_files(source, allowed, _TRITON_LAYOUT)
    try:
        text = (source / "config.pbtxt").read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise FormatRejected("config.pbtxt is not UTF-8 text", "config.pbtxt") from None
    try:
        # The name is the platform's (team--model): the conversion job sets it.
        cfg = build_served_config(
            text,
            name=UPLOADED_CONFIG_NAME,
            max_instance_count=max_instances,
            instance_limit=TEAM_INSTANCE_LIMIT,
            require_io=fmt == SourceFormat.OM,
        )
    except gc.ConfigError as exc:
        raise FormatRejected(f"config.pbtxt: {exc}", "config.pbtxt") from None
    (source / "config.pbtxt").write_text(gc.render_config(cfg), encoding="utf-8")


_TRITON_LAYOUT = (
    "a Triton model directory holds config.pbtxt and 1/model.<ext> (with the external data an ONNX model "
    "references) only"
)
_ONNX_LAYOUT = "an ONNX archive holds one .onnx file and the external data it references only"


def _every_regular_file(source: Path) -> set[str]:
    return {
        (Path(d) / f).relative_to(source).as_posix()
        for d, _, files in os.walk(source, followlinks=False)
        for f in files
        if not (Path(d) / f).is_symlink()
    }


def _is_ensemble_dir(source: Path) -> bool:
    """platform "ensemble" and no model file: a directory with a model file is a model's, whose checks
    refuse an ensemble config field by field."""
    if any(p.suffix in _INNER_SUFFIX_FORMAT for p in source.glob("*/model.*")):
        return False
    try:
        text = (source / "config.pbtxt").read_text(encoding="utf-8")
        return gc.parse_config(text).platform == gc.ENSEMBLE_PLATFORM
    except (UnicodeDecodeError, gc.ConfigError, OSError):
        return False  # the model directory's checks name what is wrong


def _any_step_name(name: str) -> bool:
    return naming.is_slug(name) or naming.is_triton_model_name(name)


def _check_ensemble_dir(source: Path) -> None:
    """config.pbtxt and empty numbered version folders, nothing else; the config's structure checked here
    (its steps and wiring against the team's models when the upload completes: apps.registry.ensembles)."""
    for directory, dirnames, filenames in os.walk(source, followlinks=False):
        for name in dirnames + filenames:
            path = Path(directory) / name
            shown = path.relative_to(source).as_posix()
            if path.is_symlink():
                raise FormatRejected(f"'{shown}' is a symbolic link; upload regular files only", shown)
            if shown == "config.pbtxt" or (path.is_dir() and shown.isdigit()):
                continue
            raise FormatRejected(
                f"'{shown}' is not part of an ensemble: {_ENSEMBLE_LAYOUT}; remove it and upload again", shown
            )
    text = (source / "config.pbtxt").read_text(encoding="utf-8")
    try:
        cfg = build_served_config(text, name=UPLOADED_CONFIG_NAME, allowed_models=_any_step_name)
    except gc.ConfigError as exc:
        raise FormatRejected(f"config.pbtxt: {exc}", "config.pbtxt") from None
    (source / "config.pbtxt").write_text(gc.render_config(cfg), encoding="utf-8")


_ENSEMBLE_LAYOUT = "a Triton ensemble directory holds config.pbtxt and an empty version folder (1/) only"


def _resolve_archive(source: Path, max_instances: int) -> str:
    if (source / "config.pbtxt").is_file() and _is_ensemble_dir(source):
        _check_ensemble_dir(source)
        return SourceFormat.ENSEMBLE
    if (source / "config.pbtxt").is_file():
        _check_triton_dir(source, max_instances)
        return SourceFormat.TRITON_REPOSITORY
    top = [p for p in source.iterdir() if p.is_file() and p.suffix.lower() == ".onnx"]
    if len(top) != 1:
        nested = next((p for p in source.rglob("*.onnx")), None)
        hint = f" (found '{nested.relative_to(source)}' in a subfolder)" if nested and not top else ""
        raise FormatRejected(
            "an archive must hold exactly one .onnx file at its top level with its external data, or a "
            f"Triton model directory (config.pbtxt + 1/model.*){hint}",
            top[1].name if len(top) > 1 else "",
        )
    check_only_model_files(source, _every_regular_file(source), _ONNX_LAYOUT)
    if top[0].name != "model.onnx":
        # External-data locations are relative to the folder, not the file, so renaming is safe.
        top[0].rename(source / "model.onnx")
    external = _onnx(source / "model.onnx", source, top[0].name)
    check_only_model_files(source, {"model.onnx", *external}, _ONNX_LAYOUT)
    return SourceFormat.ONNX_ARCHIVE


def install_source(
    upload: Path,
    claimed: str,
    source: Path,
    shown: str,
    limits: Limits,
    max_instances: int = MAX_INSTANCE_COUNT,
) -> str:
    """Move (or extract) the finished upload into ``source`` and validate it; returns the SourceFormat.

    Raises :class:`ArchiveRejected` (or FormatRejected) naming the entry; ``source`` is then removed.
    ``upload`` is consumed either way. ``max_instances`` bounds a Triton directory's instance counts (the
    team's quota).
    """
    source.parent.mkdir(parents=True, exist_ok=True)
    try:
        if claimed != ARCHIVE:
            source.mkdir()
            target = source / MODEL_FILE[claimed]
            os.replace(upload, target)
            check_model_file(claimed, target, source, shown)
            return claimed
        unpacked = source.parent / f".unpacked-{uuid.uuid4().hex}"
        try:
            extract_archive(upload, unpacked, limits)
            os.replace(unwrap_single_directory(unpacked), source)
        finally:
            shutil.rmtree(unpacked, ignore_errors=True)
        return _resolve_archive(source, max_instances)
    except BaseException:
        shutil.rmtree(source, ignore_errors=True)
        raise
    finally:
        upload.unlink(missing_ok=True)
