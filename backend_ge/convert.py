"""Model conversion for the GE backend: the seed's ``convert_to_ge.py``.

Two paths:

* **ATC** (a host with CANN): build the ``atc`` command line, run it with a timeout, stream its output line by
  line to a callback, and turn a failure's ``E``-codes into a readable :class:`AtcError`.
* **ONNX** (no ``atc``): full ``onnx.checker`` check, shape inference, signature extraction, a real onnxruntime
  load and a zero-input test run, then ``model.onnx`` (written atomically) plus a generated ``config.pbtxt``.

``main(argv)`` is the ``python -m backend_ge convert`` command line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from backend_ge import config as gc
from backend_ge import dtypes
from backend_ge.files import atomic_write
from backend_ge.serving import DEFAULT_MAX_BATCH_SIZE

FRAMEWORKS = {"caffe": 0, "mindspore": 1, "tensorflow": 3, "onnx": 5}
FRAMEWORK_BY_SUFFIX = {".prototxt": 0, ".air": 1, ".pb": 3, ".onnx": 5}
SUCCESS_LINE = "ATC run success, welcome to the next use."
FAILURE_LINE = "ATC run failed"
_CODE_LINE = re.compile(
    r"^\s*([EW][0-9A-Z]\d{4}):\s*(?:\[PID: \d+\]\s*)?(?:\d{4}-\d{2}-\d{2}-[\d:.]+\s+)?(.*)$"
)

# What each ATC error code usually means for a user of this platform, and what to do about it.
ATC_HINTS: dict[str, str] = {
    "E10001": "a parameter value is invalid; check --input_shape names and dims against the model's inputs",
    "E10007": "--framework is missing or invalid (0 Caffe, 1 MindSpore, 3 TensorFlow, 5 ONNX)",
    "E10054": "a required parameter is empty or a value is not quoted",
    "E19010": "ATC has no parser for an operator; the ONNX opset is probably too new, export with an older opset",
    "EZ3003": "an operator has no kernel for this --soc_version; check the SoC and the installed operator package",
    "E20001": "an operator failed to compile for these shapes",
    "E19999": "ATC internal error; see the detailed logs under $HOME/ascend/log/",
}


class ConversionError(RuntimeError):
    """The model cannot be converted; the message says why in words a user can act on."""


class AtcError(ConversionError):
    """ATC failed: ``codes`` are its error codes in order, ``lines`` its full output, ``exit_code`` its status."""

    def __init__(self, message: str, *, codes: Sequence[str] = (), lines: Sequence[str] = (), exit_code=None):
        self.codes, self.lines, self.exit_code = list(codes), list(lines), exit_code
        super().__init__(message)


@dataclass
class AtcOptions:
    """Everything that goes on an ATC command line. ``output`` may carry a ``.om`` suffix; ATC adds its own."""

    model: str
    output: str
    soc_version: str
    framework: int | None = None
    weight: str | None = None
    input_shape: Mapping[str, Sequence[int]] | None = None
    dynamic_batch_size: Sequence[int] = ()
    dynamic_image_size: str = ""
    dynamic_dims: str = ""
    input_format: str = ""
    precision_mode: str = ""
    log: str = "error"
    extra: Mapping[str, str] = field(default_factory=dict)


@dataclass
class AtcResult:
    command: list[str]
    exit_code: int
    lines: list[str]
    output_path: Path
    warnings: list[str]


def framework_for(path: str | os.PathLike) -> int:
    """ATC's ``--framework`` number from the model file's suffix."""
    suffix = Path(path).suffix.lower()
    if suffix == ".caffemodel":
        suffix = ".prototxt"
    if suffix not in FRAMEWORK_BY_SUFFIX:
        raise ConversionError(
            f"ATC cannot read {Path(path).name!r}: use ONNX (.onnx), TensorFlow frozen graph (.pb), "
            "MindSpore (.air) or Caffe (.prototxt with --weight)"
        )
    return FRAMEWORK_BY_SUFFIX[suffix]


def format_input_shape(shapes: Mapping[str, Sequence[int]]) -> str:
    """``{"input": [-1, 3, 224, 224]}`` -> ``input:-1,3,224,224`` (``;`` between inputs)."""
    return ";".join(f"{name}:{','.join(str(int(d)) for d in dims)}" for name, dims in shapes.items())


def parse_input_shape(text: str, names: Sequence[str] = ()) -> dict[str, list[int]]:
    """Accept ATC style ``a:1,3,224,224;b:1,128`` and the seed's ``[1,3,224,224]`` (for the model's inputs).

    Seed-style shapes carry no names: they apply, in order, to ``names`` (the model's inputs); a single
    shape given for several inputs applies to all of them (the seed's BERT example).
    """
    text = text.strip()
    if not text:
        raise ConversionError("--input_shape is empty")
    try:
        if ":" in text:
            out = {}
            for part in text.split(";"):
                name, _, dims = part.strip().rpartition(":")
                out[name.strip().strip('"')] = [int(d) for d in dims.strip(" []").split(",")]
            return out
        shapes = [[int(d) for d in grp.split(",")] for grp in re.findall(r"\[([^\]]*)\]", text)] or [
            [int(d) for d in text.split(",")]
        ]
    except ValueError:
        raise ConversionError(f"--input_shape {text!r} is not 'name:d0,d1;...' or '[d0,d1,...]'") from None
    if not names:
        raise ConversionError(f"--input_shape {text!r} has no input names; write it as 'name:d0,d1,...'")
    if len(shapes) == 1:
        shapes = shapes * len(names)
    if len(shapes) != len(names):
        raise ConversionError(
            f"--input_shape gives {len(shapes)} shapes for {len(names)} inputs ({', '.join(names)})"
        )
    return dict(zip(names, shapes, strict=True))


def build_atc_command(opts: AtcOptions, atc: str = "atc") -> list[str]:
    """The exact ATC argument vector (no shell involved, so values need no quoting)."""
    framework = opts.framework if opts.framework is not None else framework_for(opts.model)
    if framework == 0 and not opts.weight:
        raise ConversionError("Caffe models need --weight (the .caffemodel next to the .prototxt)")
    if not opts.soc_version:
        raise ConversionError(
            "--soc_version is required: the chip name from `npu-smi info` prefixed with Ascend"
        )
    dynamic = [n for n, v in (("dynamic_batch_size", opts.dynamic_batch_size), ("dynamic_image_size",
               opts.dynamic_image_size), ("dynamic_dims", opts.dynamic_dims)) if v]  # fmt: skip
    if len(dynamic) > 1:
        raise ConversionError(f"--{' and --'.join(dynamic)} are mutually exclusive; choose one")
    output = opts.output[:-3] if opts.output.endswith(".om") else opts.output
    cmd = [atc, f"--model={opts.model}", f"--framework={framework}", f"--output={output}"]
    if opts.weight:
        cmd.append(f"--weight={opts.weight}")
    cmd.append(f"--soc_version={opts.soc_version}")
    if opts.dynamic_batch_size:
        gears = sorted({int(g) for g in opts.dynamic_batch_size})
        if not 2 <= len(gears) <= 100 or gears[0] < 1:
            raise ConversionError("--dynamic_batch_size needs 2 to 100 positive batch sizes")
        if not opts.input_shape or any(not d or d[0] != -1 for d in opts.input_shape.values()):
            raise ConversionError(
                "dynamic batch needs --input_shape with -1 as every input's first dimension"
            )
    if opts.input_shape:
        cmd.append(f"--input_shape={format_input_shape(opts.input_shape)}")
    if opts.dynamic_batch_size:
        cmd.append(f"--dynamic_batch_size={','.join(str(g) for g in gears)}")
    if opts.dynamic_image_size:
        cmd.append(f"--dynamic_image_size={opts.dynamic_image_size}")
    if opts.dynamic_dims:
        cmd.append(f"--dynamic_dims={opts.dynamic_dims}")
    if opts.input_format:
        cmd.append(f"--input_format={opts.input_format}")
    if opts.precision_mode:
        cmd.append(f"--precision_mode={opts.precision_mode}")
    cmd.extend(f"--{k}={v}" for k, v in opts.extra.items())
    if opts.log:
        cmd.append(f"--log={opts.log}")
    return cmd


def parse_atc_output(lines: Sequence[str]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(errors, warnings) as (code, message) pairs, with ATC's ``[PID: n] timestamp`` prefix removed."""
    errors, warnings = [], []
    for line in lines:
        m = _CODE_LINE.match(line)
        if m:
            (warnings if m.group(1).startswith("W") else errors).append((m.group(1), m.group(2).strip()))
    return errors, warnings


def explain_atc_failure(lines: Sequence[str], exit_code: int | None) -> AtcError:
    """Turn ATC's output into one readable error (code, ATC's own sentence, and what to do)."""
    text = "\n".join(lines)
    if "libascend_hal.so" in text or "error while loading shared libraries" in text:
        return AtcError(
            "atc cannot start: the CANN environment is not set up (missing libascend_hal.so); "
            "source CANN's set_env.sh (e.g. /usr/local/Ascend/ascend-toolkit/set_env.sh) before running",
            lines=lines,
            exit_code=exit_code,
        )
    errors, _ = parse_atc_output(lines)
    codes = [c for c, _ in errors]
    if errors:
        code, message = errors[0]
        hint = ATC_HINTS.get(code)
        summary = f"ATC failed with {code}: {message}" + (f" ({hint})" if hint else "")
        if len(codes) > 1:
            summary += f"; further codes: {', '.join(codes[1:])}"
    elif FAILURE_LINE in text:
        summary = "ATC failed without an error code; see the detailed logs under $HOME/ascend/log/"
    else:
        summary = f"ATC exited with status {exit_code} without its success line"
    return AtcError(summary, codes=codes, lines=lines, exit_code=exit_code)


def run_atc(
    command: Sequence[str],
    *,
    on_line: Callable[[str], None] | None = None,
    timeout: float | None = 3600,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
) -> AtcResult:
    """Run ATC, calling ``on_line`` for every output line as it arrives; raise :class:`AtcError` on failure.

    The process gets its own session so a timeout kills ATC and the compiler processes it spawns.
    """
    lines: list[str] = []
    try:
        proc = subprocess.Popen(
            list(command),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            bufsize=1,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
        )
    except FileNotFoundError:
        raise AtcError(
            f"{command[0]!r} not found: install the CANN toolkit and source its set_env.sh"
        ) from None

    def pump() -> None:
        for raw in proc.stdout:
            line = raw.rstrip("\r\n")
            lines.append(line)
            if on_line is not None:
                on_line(line)

    reader = threading.Thread(target=pump, name="atc-output", daemon=True)
    reader.start()
    try:
        exit_code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(5)
        raise AtcError(
            f"ATC timed out after {timeout:g} s and was stopped", lines=lines, exit_code=None
        ) from None
    reader.join()
    output = next((a.split("=", 1)[1] for a in command if a.startswith("--output=")), "")
    if exit_code != 0 or not any(SUCCESS_LINE in line for line in lines):
        raise explain_atc_failure(lines, exit_code)
    _, warnings = parse_atc_output(lines)
    return AtcResult(
        list(command), exit_code, lines, Path(output + ".om"), [f"{c}: {m}" for c, m in warnings]
    )


# ------------------------------------------------------------------------------------------- ONNX path


@dataclass
class PreparedModel:
    signature: gc.ModelSignature
    model_path: Path
    config_path: Path | None
    config: gc.ModelConfig | None


def check_onnx(path: str | os.PathLike):
    """Full checker, strict shape inference, and a real onnxruntime load plus a zero-input run.

    Returns ``(model, signature)``; raises :class:`ConversionError` with the checker's or runtime's reason.
    """
    import numpy as np
    import onnx
    import onnxruntime as ort

    path = Path(path)
    try:
        model = onnx.load(str(path))
        onnx.checker.check_model(model, full_check=True)
        model = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    except Exception as exc:  # onnx raises several unrelated types; all mean "invalid model"
        raise ConversionError(f"{path.name} is not a valid ONNX model: {exc}") from None
    try:
        signature = gc.signature_from_onnx(model)
    except dtypes.UnsupportedDataType as exc:
        raise ConversionError(str(exc)) from None
    try:
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        feeds = {}
        for t in session.get_inputs():
            shape = [d if isinstance(d, int) and d > 0 else 1 for d in t.shape]
            feeds[t.name] = np.zeros(shape, dtype=dtypes.from_wire(_wire_of(signature, t.name)).numpy)
        session.run(None, feeds)
    except Exception as exc:
        raise ConversionError(f"{path.name} does not run in onnxruntime: {exc}") from None
    return model, signature


def _wire_of(signature: gc.ModelSignature, name: str) -> str:
    return next(t.dtype for t in signature.inputs if t.name == name)


def prepare_onnx(
    source: str | os.PathLike,
    version_dir: str | os.PathLike,
    *,
    name: str | None = None,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    write_config: bool = True,
    **config_options,
) -> PreparedModel:
    """Validate ``source`` and write ``<version_dir>/model.onnx``; with ``write_config`` also the model's
    ``config.pbtxt`` one level up (Triton's layout ``<model>/config.pbtxt`` + ``<model>/<version>/model.onnx``).
    """
    model, signature = check_onnx(source)
    version_dir = Path(version_dir)
    version_dir.mkdir(parents=True, exist_ok=True)
    target = version_dir / "model.onnx"
    atomic_write(target, model.SerializeToString())
    cfg = config_path = None
    if write_config:
        model_dir = version_dir.parent
        cfg = gc.generate_config(
            name or model_dir.name,
            signature,
            max_batch_size=max_batch_size if signature.batched else 0,
            **config_options,
        )
        config_path = gc.write_config(cfg, model_dir / "config.pbtxt")
    return PreparedModel(signature, target, config_path, cfg)


# ------------------------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m backend_ge convert", description=__doc__.split("\n")[0])
    p.add_argument("--input_model", required=True, help="model file: .onnx, .pb, .air, .prototxt")
    p.add_argument("--output_model", required=True, help="e.g. model_repository/resnet50/1/model.om")
    p.add_argument("--input_shape", help="'input:-1,3,224,224' (ATC style) or '[1,3,224,224]' (seed style)")
    p.add_argument(
        "--input_type", help="expected input data type, e.g. FP32 or INT32 (checked against the model)"
    )
    p.add_argument("--output_shape", help="expected output shape, e.g. [1,1000] (checked against the model)")
    p.add_argument("--soc_version", default=os.environ.get("ASCEND_SOC_VERSION", ""), help="e.g. Ascend310P3")
    p.add_argument("--framework", type=int, choices=sorted(FRAMEWORKS.values()))
    p.add_argument("--weight", help="Caffe .caffemodel")
    p.add_argument("--dynamic_batch_size", help="gears, e.g. 1,2,4,8 (sets the batch dimension to -1)")
    p.add_argument("--input_format", default="")
    p.add_argument("--precision_mode", default="")
    p.add_argument(
        "--max_batch_size",
        type=int,
        default=DEFAULT_MAX_BATCH_SIZE,
        help=f"config.pbtxt max_batch_size (ONNX path; default {DEFAULT_MAX_BATCH_SIZE})",
    )
    p.add_argument("--timeout", type=float, default=3600)
    return p


def _dims_match(declared: Sequence[int], actual: Sequence[int]) -> bool:
    return len(declared) == len(actual) and all(
        a in (b, -1) or b == -1 for a, b in zip(declared, actual, strict=True)
    )


def _convert_with_atc(args, atc: str) -> int:
    names: list[str] = []
    if args.input_model.lower().endswith(".onnx") and args.input_shape and ":" not in args.input_shape:
        names = [t.name for t in gc.signature_from_onnx(args.input_model).inputs]
    shapes = parse_input_shape(args.input_shape, names) if args.input_shape else None
    gears = [int(g) for g in args.dynamic_batch_size.split(",")] if args.dynamic_batch_size else []
    if gears and shapes:
        shapes = {k: [-1, *v[1:]] for k, v in shapes.items()}
    output = str(Path(args.output_model).with_suffix(""))
    opts = AtcOptions(
        model=args.input_model, output=output, soc_version=args.soc_version, framework=args.framework,
        weight=args.weight, input_shape=shapes, dynamic_batch_size=gears, input_format=args.input_format,
        precision_mode=args.precision_mode,
    )  # fmt: skip
    command = build_atc_command(opts, atc=atc)
    print(shlex.join(command), flush=True)
    result = run_atc(command, on_line=lambda line: print(line, flush=True), timeout=args.timeout)
    print(f"wrote {result.output_path}")
    return 0


def _convert_onnx(args) -> int:
    source = Path(args.input_model)
    if source.suffix.lower() != ".onnx":
        kind = {".pb": "TensorFlow .pb", ".air": "MindSpore .air", ".prototxt": "Caffe"}.get(
            source.suffix.lower()
        )
        if kind:
            raise ConversionError(f"{kind} models need an ATC host (CANN toolkit with `atc` on PATH)")
        raise ConversionError(
            f"{source.name}: export the model to ONNX (or TorchScript -> ONNX) first; without ATC only ONNX is prepared"
        )
    model, signature = check_onnx(source)
    if args.input_shape:
        names = [t.name for t in signature.inputs]
        for name, dims in parse_input_shape(args.input_shape, names).items():
            tensor = next((t for t in signature.inputs if t.name == name), None)
            if tensor is None:
                raise ConversionError(
                    f"--input_shape names {name!r}; the model's inputs are {', '.join(names)}"
                )
            full = [-1, *tensor.dims] if signature.batched else list(tensor.dims)
            if not _dims_match(dims, full):
                raise ConversionError(f"--input_shape {name}:{dims} does not fit the model's {full}")
    if args.input_type:
        want = dtypes.from_config(args.input_type.upper()).wire_name
        wrong = [t.name for t in signature.inputs if t.dtype != want]
        if wrong:
            raise ConversionError(f"--input_type {want}: input(s) {', '.join(wrong)} are not {want}")
    if args.output_shape:
        out = signature.outputs[0]
        declared = parse_input_shape(args.output_shape, [out.name])[out.name]
        full = [-1, *out.dims] if signature.batched else list(out.dims)
        if not _dims_match(declared, full):
            raise ConversionError(
                f"--output_shape {declared} does not fit the model's output {out.name} {full}"
            )
    prepared = prepare_onnx(source, Path(args.output_model).parent, max_batch_size=args.max_batch_size)
    print(f"atc not found on PATH: prepared ONNX for the CPU executor at {prepared.model_path}")
    if prepared.config_path:
        print(f"wrote {prepared.config_path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``convert`` command: ATC when ``atc`` is on PATH, otherwise the ONNX preparation. Returns the exit code."""
    args = _parser().parse_args(argv)
    if not Path(args.input_model).exists():
        print(f"error: {args.input_model} does not exist", file=sys.stderr)
        return 2
    try:
        atc = shutil.which("atc")
        return _convert_with_atc(args, atc) if atc else _convert_onnx(args)
    except (ConversionError, dtypes.UnsupportedDataType) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
