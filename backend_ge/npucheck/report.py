"""The result of each ``npu-check`` step, the table printed at the end and the JSON report."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from backend_ge.files import atomic_write

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"

# Exit codes: everything passed / a step failed or was skipped / the host lacks a prerequisite.
EXIT_OK, EXIT_FAILED, EXIT_MISSING = 0, 1, 2


@dataclass
class StepResult:
    """One row of the table: ``summary`` is its one-line detail, ``data`` goes into the JSON report."""

    step: str
    status: str
    seconds: float = 0.0
    summary: str = ""
    data: dict = field(default_factory=dict)


def overall_exit_code(results: Sequence[StepResult]) -> int:
    return EXIT_OK if results and all(r.status == PASS for r in results) else EXIT_FAILED


def render_table(results: Sequence[StepResult]) -> str:
    """One table: STEP | RESULT | TIME | DETAIL, then a verdict line."""
    width = max([len("STEP"), *(len(r.step) for r in results)])
    lines = [f"{'STEP':<{width}}  RESULT  {'TIME':>8}  DETAIL"]
    for r in results:
        lines.append(f"{r.step:<{width}}  {r.status:<6}  {r.seconds:>7.1f}s  {r.summary}")
    failed = sum(r.status == FAIL for r in results)
    skipped = sum(r.status == SKIP for r in results)
    if overall_exit_code(results) == EXIT_OK:
        lines.append(f"npu-check: PASS ({len(results)} of {len(results)} steps passed)")
    else:
        lines.append(f"npu-check: FAIL ({failed} failed, {skipped} skipped, {len(results)} steps)")
    return "\n".join(lines)


def write_json(path: str | os.PathLike, report: dict) -> Path:
    """Write the report atomically (a reader never sees half a file)."""
    return atomic_write(path, json.dumps(report, indent=2, default=str) + "\n")


def steps_json(results: Sequence[StepResult]) -> list[dict]:
    return [asdict(r) for r in results]
