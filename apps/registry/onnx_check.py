"""Check an uploaded ONNX graph and where its external data points, without loading that data.

Run in-process for small graphs; ``python -m apps.registry.onnx_check <model> <root>`` runs the same check
in a child process so a large single-file model never inflates the web worker's memory. No Django here.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path, PurePosixPath

# Sent ahead of ONNX's protobuf: field 1 (ir_version) as a varint. Any valid ModelProto from onnx.save starts so.
_ONNX_FIRST_BYTE = 0x08


class OnnxRejected(ValueError):
    """The file is not a usable ONNX model; ``entry`` names the file or external-data location at fault."""

    def __init__(self, message: str, entry: str = "") -> None:
        self.entry = entry
        super().__init__(message)


def check_onnx(model_path: Path, root: Path, shown_name: str) -> list[str]:
    """Parse the graph (external data not loaded) and require every external-data location to be a
    file inside ``root``; raises :class:`OnnxRejected`. Returns the external-data files the graph reads,
    relative to ``root`` (POSIX paths), so a caller can refuse every other file."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors, uses_external_data

    with open(model_path, "rb") as fh:
        head = fh.read(1)
    if not head or head[0] != _ONNX_FIRST_BYTE:
        raise OnnxRejected(f"'{shown_name}' is not an ONNX model (no ModelProto header)", shown_name)
    try:
        model = onnx.load(str(model_path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError, RuntimeError, ... for garbage
        raise OnnxRejected(f"'{shown_name}' is not a readable ONNX model: {exc}", shown_name) from None
    if not model.graph.node and not model.graph.output:
        raise OnnxRejected(f"'{shown_name}' has an empty graph", shown_name)
    root_real = os.path.realpath(root)
    base = model_path.parent
    referenced: set[str] = set()
    for tensor in _get_all_tensors(model):
        if not uses_external_data(tensor):
            continue
        info = ExternalDataInfo(tensor)
        location = info.location or ""
        pure = PurePosixPath(location.replace("\\", "/"))
        if (
            not location
            or pure.is_absolute()
            or ".." in pure.parts
            or (len(location) > 1 and location[1] == ":")
        ):
            raise OnnxRejected(
                f"external data location '{location}' of tensor '{tensor.name}' points outside the model directory",
                location,
            )
        target = os.path.realpath(base / location)
        if os.path.commonpath([root_real, target]) != root_real:
            raise OnnxRejected(
                f"external data location '{location}' of tensor '{tensor.name}' points outside the model directory",
                location,
            )
        if not os.path.isfile(target):
            raise OnnxRejected(
                f"external data file '{location}' of tensor '{tensor.name}' is missing; upload it in the same "
                ".zip/.tar.gz as the .onnx file",
                location,
            )
        end = (info.offset or 0) + (info.length or 0)
        if end > os.path.getsize(target):
            raise OnnxRejected(
                f"tensor '{tensor.name}' reads past the end of external data file '{location}'", location
            )
        referenced.add(Path(os.path.relpath(target, root_real)).as_posix())
    return sorted(referenced)


def check_onnx_in_child(model_path: Path, root: Path, shown_name: str, timeout: float = 600) -> list[str]:
    """:func:`check_onnx` in a child Python, so parsing a multi-GB graph costs the caller no memory."""
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "apps.registry.onnx_check", str(model_path), str(root), shown_name],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=Path(__file__).resolve().parents[2],
        check=False,
    )
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise OnnxRejected(
            f"'{shown_name}' could not be inspected: {proc.stderr.strip()[-300:]}", shown_name
        ) from None
    if not result.get("ok"):
        raise OnnxRejected(result["message"], result.get("entry", shown_name))
    return list(result.get("external_data", []))


def _main(argv: list[str]) -> int:
    model, root, shown = argv
    try:
        external = check_onnx(Path(model), Path(root), shown)
    except OnnxRejected as exc:
        print(json.dumps({"ok": False, "message": str(exc), "entry": exc.entry}))
        return 0
    print(json.dumps({"ok": True, "external_data": external}))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
