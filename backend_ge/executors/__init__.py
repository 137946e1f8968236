"""Choose and build the executor for one model version directory.

``model.om`` (compiled by ATC) runs on the NPU through pyACL when the Ascend runtime is importable;
``model.onnx`` runs on the CPU through onnxruntime. The ``EXECUTOR`` parameter (or the seed's
``EXECUTOR_TYPE``) forces one of them; ``auto`` prefers the NPU.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from pathlib import Path

from backend_ge.executors.base import Executor, ExecutorError, TensorSpec

__all__ = [
    "EXECUTOR_NAMES",
    "Executor",
    "ExecutorError",
    "TensorSpec",
    "acl_available",
    "choose_executor",
    "create_executor",
    "select_device",
]

MODEL_FILES = {"acl": "model.om", "onnxruntime": "model.onnx"}
_KIND_BY_SUFFIX = {".om": "acl", ".onnx": "onnxruntime"}
# The seed's EXECUTOR_TYPE says "graph" (GE graph executor): on this backend that means "pick for me".
_ALIASES = {
    "auto": "auto",
    "": "auto",
    "graph": "auto",
    "ge": "auto",
    "acl": "acl",
    "npu": "acl",
    "onnxruntime": "onnxruntime",
    "ort": "onnxruntime",
    "cpu": "onnxruntime",
}
# Every value the EXECUTOR (or EXECUTOR_TYPE) parameter accepts, compared lower-case.
EXECUTOR_NAMES = frozenset(_ALIASES)


def acl_available() -> bool:
    """True when pyACL (``import acl``, shipped with CANN) can be imported on this host."""
    try:
        importlib.import_module("acl")
    except Exception:  # a half-installed CANN raises ImportError or OSError from its .so files
        return False
    return True


def parameter(params: Mapping[str, str], *names: str, default: str = "") -> str:
    """The first of ``names`` present in ``params`` (matched case-insensitively), else ``default``."""
    lowered = {k.lower(): v for k, v in params.items()}
    for name in names:
        value = lowered.get(name.lower())
        if value is not None and str(value).strip() != "":
            return str(value).strip()
    return default


def _executor_choice(params: Mapping[str, str]) -> str:
    raw = parameter(params, "EXECUTOR", "EXECUTOR_TYPE", default="auto")
    choice = _ALIASES.get(raw.lower())
    if choice is None:
        raise ExecutorError(f"EXECUTOR parameter {raw!r} is not one of auto, acl, onnxruntime")
    return choice


def select_device(params: Mapping[str, str], instance_index: int = 0) -> int:
    """NPU device for one model instance: ``DEVICE_ID``, or ``device_ids`` ("4,5") taken round-robin."""
    ids = parameter(params, "device_ids", "DEVICE_IDS")
    single = parameter(params, "DEVICE_ID")
    try:
        if ids:
            devices = [int(x) for x in ids.replace(";", ",").split(",") if x.strip()]
            if not devices:
                raise ValueError(ids)
            return devices[instance_index % len(devices)]
        return int(single) if single else 0
    except ValueError:
        raise ExecutorError(
            f"device parameter {ids or single!r} is not a device number or a list like '4,5'"
        ) from None


def choose_executor(
    version_dir: str | os.PathLike,
    params: Mapping[str, str] | None = None,
    *,
    model_filename: str = "",
    acl_importable: bool | None = None,
) -> tuple[str, Path]:
    """Return ``(kind, model_path)``, or raise ExecutorError naming the missing file or runtime."""
    params = params or {}
    version_dir = Path(version_dir)
    choice = _executor_choice(params)
    acl_ok = acl_available() if acl_importable is None else acl_importable
    no_runtime = (
        "the Ascend runtime (pyACL, `import acl`) is not importable on this host: install CANN and source "
        "its set_env.sh"
    )

    if model_filename:
        path = version_dir / model_filename
        kind = _KIND_BY_SUFFIX.get(path.suffix)
        if kind is None:
            raise ExecutorError(f"model file {model_filename!r}: the GE backend runs .om or .onnx files")
        if choice != "auto" and choice != kind:
            raise ExecutorError(f"EXECUTOR={choice} cannot run {model_filename}")
        candidates = {kind: path}
    else:
        candidates = {kind: version_dir / name for kind, name in MODEL_FILES.items()}
        if choice != "auto":
            candidates = {choice: candidates[choice]}

    present = {kind: path for kind, path in candidates.items() if path.is_file()}
    if not present:
        wanted = " or ".join(str(p.name) for p in candidates.values())
        raise ExecutorError(f"model file not found: {wanted} in {version_dir}")
    if "acl" in present and acl_ok:
        return "acl", present["acl"]
    if "onnxruntime" in present:
        return "onnxruntime", present["onnxruntime"]
    raise ExecutorError(f"{present['acl'].name} found in {version_dir} but {no_runtime}")


def create_executor(
    version_dir: str | os.PathLike,
    params: Mapping[str, str] | None = None,
    *,
    instance_index: int = 0,
    model_filename: str = "",
) -> Executor:
    """Build the executor for a version directory from the model config's parameters."""
    params = params or {}
    kind, path = choose_executor(version_dir, params, model_filename=model_filename)
    if kind == "acl":
        from backend_ge.executors.acl import AclExecutor

        return AclExecutor(path, device_id=select_device(params, instance_index))

    from backend_ge.executors.onnxruntime import OnnxRuntimeExecutor

    threads = parameter(params, "intra_op_thread_count", "INTRA_OP_THREADS", default="0")
    try:
        intra = int(threads)
    except ValueError:
        raise ExecutorError(f"intra_op_thread_count {threads!r} is not a number") from None
    return OnnxRuntimeExecutor(path, intra_op_threads=intra)
