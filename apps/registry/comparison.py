"""What differs between two versions of one model, as far as the registry knows: the signature tensor by
tensor, the served ``config.pbtxt`` as a unified diff, and the files (format, sizes, sha256).

Plain data for the comparison API and page (``apps.monitoring.comparison`` adds how each was converted and how
each served). Config text is a tenant's: it is returned as data, never as markup - the page escapes it.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from apps.registry.models import ModelVersion

TENSOR_FIELDS = ("dtype", "shape", "format")
MAX_DIFF_LINES = 2000


def _tensors(signature: dict, kind: str) -> dict[str, dict]:
    batched = bool(signature.get("batched"))
    out = {}
    for tensor in signature.get(kind) or []:
        dims = [int(d) for d in tensor.get("dims", [])]
        out[str(tensor.get("name", ""))] = {
            "dtype": str(tensor.get("dtype", "")),
            "shape": ([-1] if batched else []) + dims,
            "format": str(tensor.get("format") or ""),
        }
    return out


def signature_diff(a: ModelVersion, b: ModelVersion) -> dict:
    """Inputs and outputs side by side, in ``a``'s order then the tensors only ``b`` has.

    Each row: ``{"kind", "name", "a", "b", "changed"}`` where ``a``/``b`` are ``{"dtype", "shape", "format"}``
    or None (the version has no such tensor) and ``changed`` names the fields that differ (all of them when
    one side is missing)."""
    rows = []
    for kind in ("inputs", "outputs"):
        left, right = _tensors(a.signature or {}, kind), _tensors(b.signature or {}, kind)
        for name in [*left, *(n for n in right if n not in left)]:
            x, y = left.get(name), right.get(name)
            changed = (
                list(TENSOR_FIELDS) if x is None or y is None else [f for f in TENSOR_FIELDS if x[f] != y[f]]
            )
            rows.append({"kind": kind[:-1], "name": name, "a": x, "b": y, "changed": changed})
    return {
        "batched": {
            "a": bool((a.signature or {}).get("batched")),
            "b": bool((b.signature or {}).get("batched")),
        },
        "tensors": rows,
        "identical": not any(row["changed"] for row in rows) and bool(rows),
        "known": bool(a.signature) and bool(b.signature),
    }


def config_diff(a: ModelVersion, b: ModelVersion) -> dict:
    """The unified diff of the two served configs: ``lines`` of ``{"op": "+"|"-"|" "|"@", "text"}``."""
    left, right = (a.config_text or "").splitlines(), (b.config_text or "").splitlines()
    lines = []
    for line in difflib.unified_diff(
        left,
        right,
        fromfile=f"v{a.number}/config.pbtxt",
        tofile=f"v{b.number}/config.pbtxt",
        lineterm="",
        n=3,
    ):
        if line.startswith(("---", "+++")):
            continue
        op = "@" if line.startswith("@@") else line[:1] or " "
        lines.append({"op": op, "text": line if op == "@" else line[1:]})
    return {
        "identical": left == right,
        "lines": lines[:MAX_DIFF_LINES],
        "truncated": len(lines) > MAX_DIFF_LINES,
        "added": sum(1 for line in lines if line["op"] == "+"),
        "removed": sum(1 for line in lines if line["op"] == "-"),
    }


def servable_size(version: ModelVersion) -> int | None:
    """Bytes of the converted model directory (what an instance loads), None when it is not on this machine."""
    path: Path = version.servable_dir()
    if not path.is_dir():
        return None
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def file_facts(version: ModelVersion) -> dict:
    return {
        "number": version.number,
        "state": version.state,
        "archived": version.is_archived(),
        "source_format": version.source_format,
        "source_format_label": version.get_source_format_display() if version.source_format else "",
        "source_filename": version.source_filename,
        "size_bytes": version.size_bytes,
        "servable_bytes": servable_size(version),
        "sha256": version.sha256,
        "toolchain": version.toolchain,
        "created_at": version.created_at,
        "tags": list(version.tags or []),
    }
