"""What a conversion does to each source format, on this worker's toolchain.

Everything here writes only into ``ctx.workdir`` (a temp model directory the runner renames into place) and
raises :class:`backend_ge.convert.ConversionError` with a sentence a user can act on. The heavy lifting is
``backend_ge.convert`` and ``backend_ge.config``; this module picks the path and feeds them the version's
files, the user's conversion options and serving options.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from apps.conversions.models import Toolchain
from apps.registry.models import ModelVersion, SourceFormat
from backend_ge import config as gc
from backend_ge import convert
from backend_ge.convert import ConversionError
from backend_ge.served_config import TEAM_INSTANCE_LIMIT, build_served_config
from backend_ge.serving import DEFAULT_MAX_BATCH_SIZE

MODEL_VERSION_DIR = "1"
ONNX_FORMATS = (SourceFormat.ONNX, SourceFormat.ONNX_ARCHIVE)


@dataclass
class ConversionContext:
    version: ModelVersion
    options: dict
    workdir: Path  # becomes the servable dir: config.pbtxt + 1/model.*
    log: logging.Logger
    stage: Callable[[str, int], None]
    atc_timeout: float
    on_atc_line: Callable[[str], None]
    on_command: Callable[[list[str]], None]
    # A copy: a toolchain may narrow it (a fixed-batch .om) without touching what the user asked for.
    serving: dict = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.version.model.triton_model_name()


@dataclass
class ConversionResult:
    toolchain: str
    signature: gc.ModelSignature
    config: gc.ModelConfig
    command: list[str] = field(default_factory=list)
    exit_code: int | None = None


def find_atc() -> str | None:
    return shutil.which("atc")


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def _find_source(version: ModelVersion, suffixes: tuple[str, ...]) -> Path:
    """The one model file of the upload: top level first, then one directory down (archives often wrap)."""
    root = version.source_dir()
    for pattern in ("*", "*/*"):
        found = sorted(p for p in root.glob(pattern) if p.is_file() and p.suffix.lower() in suffixes)
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            names = ", ".join(p.name for p in found)
            raise ConversionError(
                f"The upload holds several model files ({names}); upload one model per version."
            )
    raise ConversionError(f"The upload holds no {' or '.join(suffixes)} file.")


def _find_config(version: ModelVersion) -> Path:
    root = version.source_dir()
    for candidate in (root / "config.pbtxt", *sorted(root.glob("*/config.pbtxt"))):
        if candidate.is_file():
            return candidate
    raise ConversionError("The upload holds no config.pbtxt; a Triton model directory and a .om need one.")


def generate_config(ctx: ConversionContext, signature: gc.ModelSignature, **extra) -> gc.ModelConfig:
    """The GE config from the signature and the version's serving options, validated against the signature."""
    s = ctx.serving
    max_batch_size = int(s.get("max_batch_size", DEFAULT_MAX_BATCH_SIZE)) if signature.batched else 0
    cfg = gc.generate_config(
        ctx.model_name,
        signature,
        max_batch_size=max_batch_size,
        preferred_batch_sizes=[b for b in s.get("preferred_batch_sizes") or () if b <= max_batch_size],
        max_queue_delay_us=s.get("max_queue_delay_us"),
        instance_count=int(s.get("instance_count") or 1),
        **extra,
    )
    return checked_config(ctx, cfg, signature, require_io=bool(signature.outputs))


def checked_config(
    ctx: ConversionContext,
    cfg: gc.ModelConfig,
    signature: gc.ModelSignature | None,
    *,
    require_io: bool = True,
) -> gc.ModelConfig:
    """The config the version is served with: built from only the fields a tenant may set, with the
    platform's name and backend, checked against the model's signature (backend_ge.served_config)."""
    try:
        return build_served_config(
            cfg,
            name=ctx.model_name,
            max_instance_count=ctx.version.model.team.model_instance_limit(),
            instance_limit=TEAM_INSTANCE_LIMIT,
            signature=signature,
            require_io=require_io,
        )
    except gc.ConfigError as exc:
        raise ConversionError(
            "The model config is not valid: " + "; ".join(str(e) for e in exc.errors)
        ) from None


def _load_uploaded_config(ctx: ConversionContext, *, require_io: bool = False) -> gc.ModelConfig:
    path = _find_config(ctx.version)
    try:
        cfg = gc.parse_config(path.read_text(encoding="utf-8", errors="replace"))
    except gc.ConfigError as exc:
        raise ConversionError(f"The uploaded config.pbtxt cannot be parsed: {exc}") from None
    if cfg.name != ctx.model_name:
        # Triton names models after their directory, which the platform derives; the uploaded name is a label.
        ctx.log.info("Config name %r replaced by the platform's model name %r", cfg.name, ctx.model_name)
    return checked_config(ctx, cfg, None, require_io=require_io)


def _model_dir(ctx: ConversionContext) -> Path:
    path = ctx.workdir / MODEL_VERSION_DIR
    path.mkdir(parents=True, exist_ok=True)
    return path


# --------------------------------------------------------------------------------------------- ATC


def atc_input_shapes(
    signature: gc.ModelSignature, max_batch_size: int, input_shape: str, batch_gears: str = ""
) -> tuple[dict[str, list[int]], list[int]]:
    """(--input_shape, --dynamic_batch_size gears) for ATC.

    The user's input_shape wins; otherwise the signature's dims with -1 for a batch dimension whose gears are
    ``batch_gears`` ("1,3,8", checked by ``apps.registry.options``; e.g. what a tuning suggested) or else
    1,2,4,...,max_batch_size. Other dynamic dims cannot be compiled without a shape from the user.
    """
    names = [t.name for t in signature.inputs]
    gears = gc.default_batch_gears(max_batch_size) if signature.batched and max_batch_size > 1 else []
    if gears and batch_gears:
        gears = [int(g) for g in batch_gears.split(",")]
        if gears[-1] > max_batch_size:
            raise ConversionError(
                f"batch_gears go up to {gears[-1]}, above the max batch size {max_batch_size}: Triton would "
                "never send such a batch; lower the gears or raise max_batch_size."
            )
    if input_shape:
        shapes = convert.parse_input_shape(input_shape, names)
        if not all(dims and dims[0] == -1 for dims in shapes.values()):
            gears = []
        return shapes, gears
    shapes = {}
    for t in signature.inputs:
        if -1 in t.dims:
            raise ConversionError(
                f"Input {t.name!r} has dynamic dimensions {list(t.dims)} besides the batch: ATC needs fixed "
                "sizes; give input_shape (e.g. name:-1,3,224,224) in the conversion options."
            )
        batch = [-1 if gears else 1] if signature.batched else []
        shapes[t.name] = [*batch, *t.dims]
    return shapes, gears


def _signature_from_input_shape(ctx: ConversionContext, input_shape: str) -> gc.ModelSignature:
    if not input_shape:
        raise ConversionError(
            "A TensorFlow graph does not declare its input shapes: give input_shape (e.g. input:-1,224,224,3) "
            "in the conversion options."
        )
    shapes = convert.parse_input_shape(input_shape)
    batched = all(dims and dims[0] == -1 for dims in shapes.values())
    ctx.log.warning(
        "The .pb's input data types cannot be read without TensorFlow: assuming FP32 inputs and leaving the "
        "outputs to the backend; edit the config if that is wrong."
    )
    inputs = tuple(
        gc.TensorSignature(name, "FP32", tuple(dims[1:] if batched else dims))
        for name, dims in shapes.items()
    )
    return gc.ModelSignature(inputs, (), batched)


def convert_with_atc(
    ctx: ConversionContext, atc: str, source: Path, signature: gc.ModelSignature
) -> ConversionResult:
    max_batch_size = (
        int(ctx.serving.get("max_batch_size", DEFAULT_MAX_BATCH_SIZE)) if signature.batched else 0
    )
    shapes, gears = atc_input_shapes(
        signature, max_batch_size, ctx.options.get("input_shape", ""), ctx.options.get("batch_gears", "")
    )
    command = convert.build_atc_command(
        convert.AtcOptions(
            model=str(source),
            output=str(_model_dir(ctx) / "model"),
            soc_version=ctx.options["soc_version"],
            framework=convert.framework_for(source),
            input_shape=shapes,
            dynamic_batch_size=gears,
            input_format=ctx.options.get("input_format", ""),
            precision_mode=ctx.options.get("precision_mode", ""),
        ),
        atc=atc,
    )
    ctx.on_command(command)
    ctx.stage("compiling with ATC", 20)
    ctx.log.info("Running %s", " ".join(command))
    result = convert.run_atc(command, on_line=ctx.on_atc_line, timeout=ctx.atc_timeout)
    if not result.output_path.is_file():
        raise ConversionError(f"ATC reported success but wrote no {result.output_path.name}")
    for warning in result.warnings:
        ctx.log.warning("ATC warning %s", warning)
    ctx.stage("generating config", 85)
    if signature.batched and not gears:
        # Compiled for a fixed batch of 1: the config must not promise Triton more.
        ctx.serving["max_batch_size"] = 1
    cfg = generate_config(ctx, signature, executor="acl")
    return ConversionResult(Toolchain.ATC, signature, cfg, command, result.exit_code)


# --------------------------------------------------------------------------------------------- paths


def convert_onnx(ctx: ConversionContext, source: Path) -> ConversionResult:
    atc = find_atc()
    if atc:
        ctx.stage("reading the ONNX signature", 10)
        signature = gc.signature_from_onnx(source)
        return convert_with_atc(ctx, atc, source, signature)
    ctx.log.info("atc not found on this worker: validating the ONNX model for the CPU executor")
    ctx.stage("checking the ONNX model (checker, shape inference, onnxruntime test run)", 30)
    prepared = convert.prepare_onnx(source, _model_dir(ctx), write_config=False)
    ctx.log.info(
        "ONNX model valid: inputs %s, outputs %s",
        ", ".join(f"{t.name} {t.dtype}{list(t.dims)}" for t in prepared.signature.inputs),
        ", ".join(f"{t.name} {t.dtype}{list(t.dims)}" for t in prepared.signature.outputs),
    )
    ctx.stage("generating config", 85)
    return ConversionResult(Toolchain.ONNX, prepared.signature, generate_config(ctx, prepared.signature))


def convert_tensorflow(ctx: ConversionContext) -> ConversionResult:
    atc = find_atc()
    if not atc:
        raise ConversionError(
            "A TensorFlow frozen graph (.pb) needs an ATC host (atc not found on this worker): run the conversion "
            "on a worker with the CANN toolkit, or export the model to ONNX and upload that."
        )
    source = _find_source(ctx.version, (".pb",))
    signature = _signature_from_input_shape(ctx, ctx.options.get("input_shape", ""))
    return convert_with_atc(ctx, atc, source, signature)


def convert_torchscript(ctx: ConversionContext) -> ConversionResult:
    source = _find_source(ctx.version, (".pt", ".pth", ".torchscript"))
    if not torch_available():
        raise ConversionError(
            "A TorchScript model needs torch or an ATC host: this worker has no torch to export it to ONNX. "
            "Install the torch extra on the conversion worker, or export ONNX yourself (torch.onnx.export) "
            "and upload the .onnx."
        )
    import torch

    input_shape = ctx.options.get("input_shape", "")
    if not input_shape:
        raise ConversionError(
            "Exporting TorchScript to ONNX needs example input shapes: give input_shape (name:-1,3,224,224)."
        )
    shapes = convert.parse_input_shape(input_shape)
    ctx.stage("exporting TorchScript to ONNX", 15)
    module = torch.jit.load(str(source), map_location="cpu")
    examples = tuple(torch.zeros([d if d > 0 else 1 for d in dims]) for dims in shapes.values())
    onnx_path = ctx.workdir / ".export" / "model.onnx"
    onnx_path.parent.mkdir(parents=True, exist_ok=True)
    torch.onnx.export(
        module,
        examples,
        str(onnx_path),
        input_names=list(shapes),
        dynamic_axes={name: {0: "batch"} for name, dims in shapes.items() if dims[0] == -1},
    )
    try:
        result = convert_onnx(ctx, onnx_path)
    finally:
        shutil.rmtree(onnx_path.parent, ignore_errors=True)
    if result.toolchain == Toolchain.ONNX:
        result.toolchain = Toolchain.TORCHSCRIPT
    return result


def convert_om(ctx: ConversionContext) -> ConversionResult:
    ctx.stage("reading the uploaded config", 30)
    cfg = _load_uploaded_config(ctx, require_io=True)
    source = _find_source(ctx.version, (".om",))
    shutil.copyfile(source, _model_dir(ctx) / "model.om")
    ctx.log.info("Compiled .om: no conversion; the signature comes from the uploaded config")
    return ConversionResult(Toolchain.NONE, gc.signature_from_config(cfg), cfg)


def convert_triton_directory(ctx: ConversionContext) -> ConversionResult:
    ctx.stage("normalizing the uploaded config", 20)
    cfg = _load_uploaded_config(ctx)
    model_root = _find_config(ctx.version).parent
    candidates = sorted(p for p in model_root.glob("*/model.*") if p.is_file())
    if not candidates:
        raise ConversionError("The Triton model directory holds no <version>/model.* file.")
    source = candidates[-1]
    suffix = source.suffix.lower()
    if suffix == ".om":
        cfg = checked_config(ctx, cfg, None)
        shutil.copyfile(source, _model_dir(ctx) / "model.om")
        return ConversionResult(Toolchain.NONE, gc.signature_from_config(cfg), cfg)
    if suffix != ".onnx":
        raise ConversionError(
            f"The Triton model directory holds {source.name}; the GE backend serves model.onnx or model.om."
        )
    ctx.stage("checking the ONNX model (checker, shape inference, onnxruntime test run)", 40)
    prepared = convert.prepare_onnx(source, _model_dir(ctx), write_config=False)
    return ConversionResult(Toolchain.ONNX, prepared.signature, checked_config(ctx, cfg, prepared.signature))


def run_toolchain(ctx: ConversionContext) -> ConversionResult:
    fmt = ctx.version.source_format
    if fmt in ONNX_FORMATS:
        return convert_onnx(ctx, _find_source(ctx.version, (".onnx",)))
    if fmt == SourceFormat.TENSORFLOW:
        return convert_tensorflow(ctx)
    if fmt == SourceFormat.TORCHSCRIPT:
        return convert_torchscript(ctx)
    if fmt == SourceFormat.OM:
        return convert_om(ctx)
    if fmt == SourceFormat.TRITON_REPOSITORY:
        return convert_triton_directory(ctx)
    raise ConversionError(
        f"Unknown source format {fmt!r}; upload ONNX, .pb, TorchScript, .om or a Triton directory."
    )
