"""Step 2: compile the example models with ATC, showing each exact command, its time and, on failure,
ATC's own error code with the hint the project knows for it (``convert.ATC_HINTS``)."""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from pathlib import Path

import onnx

from backend_ge import config as gc
from backend_ge import convert
from backend_ge.npucheck.models import PRECISION_MODE, CheckModel
from backend_ge.npucheck.report import FAIL, PASS, StepResult

ATC_TAIL_LINES = 30  # ATC's output shown on a failure (all of it goes into the JSON report)


def write_source(model: CheckModel, directory: Path) -> tuple[Path, gc.ModelSignature]:
    """``<directory>/<name>.onnx`` (ATC's input and onnxruntime's reference) and its signature."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{model.name}.onnx"
    proto = model.build()
    onnx.save_model(proto, path)
    return path, gc.signature_from_onnx(proto)


def atc_options(model: CheckModel, source: Path, signature: gc.ModelSignature, output: Path, soc: str):
    return convert.AtcOptions(
        model=str(source),
        output=str(output),
        soc_version=soc,
        framework=convert.FRAMEWORKS["onnx"],
        input_shape={t.name: [-1, *t.dims] for t in signature.inputs},
        dynamic_batch_size=model.gears,
        input_format=model.input_format,
        precision_mode=PRECISION_MODE,
    )


def compile_model(
    model: CheckModel,
    source: Path,
    signature: gc.ModelSignature,
    output: Path,
    *,
    soc_version: str,
    atc: str,
    timeout: float,
    cwd: Path,
    say: Callable[[str], None],
) -> StepResult:
    """Run ATC for one model in ``cwd`` (ATC leaves ``kernel_meta``/``fusion_result.json`` in its working
    directory); the .om lands at ``<output>.om``."""
    step = f"compile {model.name}"
    output.parent.mkdir(parents=True, exist_ok=True)
    try:
        command = convert.build_atc_command(
            atc_options(model, source, signature, output, soc_version), atc=atc
        )
    except convert.ConversionError as exc:
        return StepResult(step, FAIL, summary=f"cannot build the ATC command: {exc}")
    say(f"$ {shlex.join(command)}")
    started = time.monotonic()
    try:
        cwd.mkdir(parents=True, exist_ok=True)
        result = convert.run_atc(command, timeout=timeout, cwd=str(cwd))
    except convert.AtcError as exc:
        seconds = time.monotonic() - started
        for line in exc.lines[-ATC_TAIL_LINES:]:
            say(f"  | {line}")
        code = exc.codes[0] if exc.codes else None
        errors, _ = convert.parse_atc_output(exc.lines)
        data = {
            "command": command,
            "exit_code": exc.exit_code,
            "error_code": code,
            "error_codes": exc.codes,
            "atc_message": errors[0][1] if errors else None,
            "hint": convert.ATC_HINTS.get(code) if code else None,
            "error": str(exc),
            "output": exc.lines,
        }
        summary = str(exc)
        if code:
            summary = f"ATC {code} (exit {exc.exit_code}): {data['atc_message']}"
            summary += f" | hint: {data['hint']}" if data["hint"] else ""
        return StepResult(step, FAIL, seconds, summary, data)
    seconds = time.monotonic() - started
    data = {
        "command": command,
        "exit_code": result.exit_code,
        "om": str(result.output_path),
        "warnings": result.warnings,
        "gears": list(model.gears),
    }
    if not result.output_path.is_file():
        return StepResult(
            step, FAIL, seconds, f"ATC reported success but wrote no {result.output_path}", data
        )
    size_mb = result.output_path.stat().st_size / 2**20
    summary = f"{result.output_path.name} {size_mb:.1f} MiB, gears {','.join(map(str, model.gears))}"
    if result.warnings:
        summary += f", {len(result.warnings)} warning(s)"
    say(f"  compiled in {seconds:.1f} s")
    return StepResult(step, PASS, seconds, summary, data)
