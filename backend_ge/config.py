"""GE model configs: generate, parse, normalize and validate Triton ``config.pbtxt`` files.

Everything goes through Triton's own protobuf (``tritonclient.grpc.model_config_pb2``) and
``google.protobuf.text_format``: what this module writes is exactly what Triton reads, and a config Triton would
reject is caught here first. Validation returns :class:`FieldError` objects (a dotted field path plus a sentence)
so the platform can show each message next to the form field it belongs to.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from backend_ge import dtypes
from backend_ge.files import atomic_write
from backend_ge.seedtext import quote_bare_strings, wrap_seed_steps

GE_BACKEND = "ge"
SEED_PLATFORM = "graph_executor"  # what the seed article writes instead of a backend name
ENSEMBLE_PLATFORM = "ensemble"
SEED_DEVICE_PARAMETERS = ("DEVICE_ID", "device_ids")
EXECUTORS = ("auto", "acl", "onnxruntime")
DYNAMIC = -1

ModelConfig = mc.ModelConfig


@dataclass(frozen=True)
class TensorSignature:
    """One input or output. ``dims`` excludes the batch dimension when the model is batched; -1 is dynamic."""

    name: str
    dtype: str  # KServe wire name, e.g. "FP32"
    dims: tuple[int, ...]
    format: str = ""  # "NCHW", "NHWC" or "" (none)

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "dims": list(self.dims), "format": self.format}


@dataclass(frozen=True)
class ModelSignature:
    """A model's interface as the platform stores it (JSON via :meth:`to_dict`)."""

    inputs: tuple[TensorSignature, ...]
    outputs: tuple[TensorSignature, ...]
    batched: bool = False  # the model's first dimension is a free batch dimension

    def to_dict(self) -> dict:
        return {
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
            "batched": self.batched,
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> ModelSignature:
        def tensors(items) -> tuple[TensorSignature, ...]:
            return tuple(
                TensorSignature(t["name"], t["dtype"], tuple(int(d) for d in t["dims"]), t.get("format", ""))
                for t in items
            )

        return cls(tensors(data["inputs"]), tensors(data["outputs"]), bool(data.get("batched", False)))

    @classmethod
    def from_onnx(cls, model) -> ModelSignature:
        """Read the signature of an ONNX model (a path or a loaded ``ModelProto``)."""
        return signature_from_onnx(model)


@dataclass(frozen=True)
class FieldError:
    """One validation problem: ``field`` is a dotted path such as ``input[0].data_type``."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class ConfigError(ValueError):
    """A config that cannot be used; ``errors`` holds every field-level problem found."""

    def __init__(self, errors: Sequence[FieldError]):
        self.errors = list(errors)
        super().__init__("; ".join(str(e) for e in self.errors))

    def as_dict(self) -> dict[str, list[str]]:
        """Field path -> messages, the shape form views want."""
        out: dict[str, list[str]] = {}
        for e in self.errors:
            out.setdefault(e.field, []).append(e.message)
        return out


# --------------------------------------------------------------------------------------------- ONNX


def _onnx_dim(d) -> int:
    return d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else DYNAMIC


def signature_from_onnx(model) -> ModelSignature:
    """Signature of an ONNX model; a first dimension that is symbolic or -1 on every input marks it batched."""
    import onnx

    if isinstance(model, str | Path):
        model = onnx.load(str(model), load_external_data=False)
    initializers = {i.name for i in model.graph.initializer}

    def tensors(values) -> list[tuple[str, str, list[int]]]:
        out = []
        for v in values:
            if v.name in initializers:  # old exporters list weights as graph inputs
                continue
            tt = v.type.tensor_type
            if not v.type.HasField("tensor_type"):
                raise dtypes.UnsupportedDataType(
                    f"{v.name!r} is not a tensor; the GE backend serves tensors only"
                )
            dt = dtypes.from_onnx(tt.elem_type).wire_name
            shape = [_onnx_dim(d) for d in tt.shape.dim] if tt.HasField("shape") else []
            out.append((v.name, dt, shape))
        return out

    ins, outs = tensors(model.graph.input), tensors(model.graph.output)
    batched = bool(ins) and all(s and s[0] == DYNAMIC for _, _, s in ins)
    if batched:
        batched = all(s and s[0] == DYNAMIC for _, _, s in outs)

    def build(items) -> tuple[TensorSignature, ...]:
        result = []
        for name, dt, shape in items:
            dims = tuple(shape[1:] if batched else shape)
            fmt = (
                "NCHW" if len(dims) == 3 and batched and dims[0] in (1, 3) and dt in ("FP32", "FP16") else ""
            )
            result.append(TensorSignature(name, dt, dims, fmt))
        return tuple(result)

    return ModelSignature(build(ins), build(outs), batched)


# --------------------------------------------------------------------------------------------- generate


def default_batch_gears(max_batch_size: int) -> list[int]:
    """Powers of two up to ``max_batch_size`` plus the maximum itself: 1,2,4,...,max (ATC dynamic batch gears)."""
    gears, b = [], 1
    while b < max_batch_size:
        gears.append(b)
        b *= 2
    if max_batch_size >= 1:
        gears.append(max_batch_size)
    return gears


def generate_config(
    name: str,
    signature: ModelSignature,
    *,
    max_batch_size: int = 0,
    preferred_batch_sizes: Iterable[int] = (),
    max_queue_delay_us: int | None = None,
    dynamic_batching: bool | None = None,
    instance_count: int = 1,
    device_ids: Sequence[int] = (),
    executor: str | None = None,
    parameters: Mapping[str, str] | None = None,
    backend: str = GE_BACKEND,
) -> ModelConfig:
    """Build a GE model config from a signature and the user's serving options.

    NPU devices are not Triton GPUs, so instances are ``KIND_CPU`` groups and the device ids travel as the
    ``DEVICE_ID`` (first device, the seed's name) and ``device_ids`` (Huawei's npu_ge backend name) parameters.
    ``dynamic_batching`` defaults to on whenever the model is batched and ``max_batch_size`` > 0.
    """
    cfg = ModelConfig(name=name, backend=backend)
    if signature.batched:
        cfg.max_batch_size = max_batch_size
    for tensors, repeated in ((signature.inputs, cfg.input), (signature.outputs, cfg.output)):
        for t in tensors:
            item = repeated.add(
                name=t.name, data_type=dtypes.from_wire(t.dtype).config_name, dims=list(t.dims)
            )
            if t.format and repeated is cfg.input:
                item.format = mc.ModelInput.Format.Value("FORMAT_" + t.format.removeprefix("FORMAT_"))
    preferred = sorted(set(preferred_batch_sizes))
    if dynamic_batching is None:
        dynamic_batching = signature.batched and max_batch_size > 0
    if dynamic_batching:
        cfg.dynamic_batching.SetInParent()
        cfg.dynamic_batching.preferred_batch_size.extend(preferred)
        if max_queue_delay_us is not None:
            cfg.dynamic_batching.max_queue_delay_microseconds = max_queue_delay_us
    cfg.instance_group.add(count=instance_count, kind=mc.ModelInstanceGroup.KIND_CPU)
    params = dict(parameters or {})
    if device_ids:
        params.setdefault("DEVICE_ID", str(device_ids[0]))
        params.setdefault("device_ids", ",".join(str(d) for d in device_ids))
    if executor:
        params.setdefault("EXECUTOR", executor)
    for key, value in params.items():
        cfg.parameters[key].string_value = str(value)
    return cfg


def render_config(config: ModelConfig) -> str:
    """The config as ``config.pbtxt`` text (protobuf text format, Triton's on-disk format)."""
    return text_format.MessageToString(config)


def write_config(config: ModelConfig, path: str | Path) -> Path:
    """Write ``config.pbtxt`` atomically: a reader never sees half a file."""
    return atomic_write(path, render_config(config))


# --------------------------------------------------------------------------------------------- parse


_ENUM_ERROR = re.compile(r'Enum type "inference\.(\w+)" has no value named (\w+)')
_FIELD_ERROR = re.compile(r'has no field named "(\w+)"')


def parse_config(text: str) -> ModelConfig:
    """Parse ``config.pbtxt`` text with Triton's protobuf; raise :class:`ConfigError` naming the bad field.

    Accepts the seed's ensemble layout (``step`` at top level) by moving the steps where Triton expects them,
    and the seed's unquoted strings (``name: resnet50``) by quoting them.
    """
    return _parse(text, steps_wrapped=False, quoted=False)


def _parse(text: str, *, steps_wrapped: bool, quoted: bool) -> ModelConfig:
    # Each seed repair is tried once, so a text the repairs keep changing cannot recurse without end.
    try:
        return text_format.Parse(text, ModelConfig())
    except text_format.ParseError as exc:
        m = _FIELD_ERROR.search(str(exc))
        if m and m.group(1) == "step" and not steps_wrapped:
            return _parse(wrap_seed_steps(text), steps_wrapped=True, quoted=quoted)
        if not quoted:
            repaired = quote_bare_strings(text)
            if repaired != text:
                return _parse(repaired, steps_wrapped=steps_wrapped, quoted=True)
        raise ConfigError([_parse_error_to_field(exc)]) from None
    except (ValueError, RecursionError) as exc:  # protobuf's own "Value out of range", a too-deep nesting
        raise ConfigError([FieldError("config", f"not a valid config: {str(exc)[:200]}")]) from None


def _parse_error_to_field(exc: text_format.ParseError) -> FieldError:
    where = f"line {exc.GetLine()}" if exc.GetLine() else "config"
    msg = str(exc).split(": ", 1)[-1] if ": " in str(exc) else str(exc)
    m = _ENUM_ERROR.search(str(exc))
    if m and m.group(1) == "DataType":
        return FieldError(
            "data_type",
            f"unknown data type {m.group(2)} ({where}); supported: "
            + ", ".join(d.config_name for d in dtypes.SUPPORTED),
        )
    if m:
        return FieldError(m.group(1).lower(), f"unknown value {m.group(2)} for {m.group(1)} ({where})")
    m = _FIELD_ERROR.search(str(exc))
    if m:
        return FieldError(m.group(1), f"unknown field {m.group(1)!r} ({where})")
    return FieldError("config", f"{where}: {msg.strip()}")


def normalize_config(config: ModelConfig) -> ModelConfig:
    """Rewrite seed-style configs for this backend: ``platform: "graph_executor"`` -> ``backend: "ge"``.

    The seed's ``EXECUTOR_TYPE`` is kept; its ``DEVICE_ID``/``device_ids`` (device pinning) is dropped from a
    seed-style config, since the platform picks the devices at placement. A copy is returned.
    """
    out = ModelConfig()
    out.CopyFrom(config)
    if out.platform == SEED_PLATFORM:
        out.platform = ""
        out.backend = GE_BACKEND
        for key in SEED_DEVICE_PARAMETERS:
            out.parameters.pop(key, None)
    return out


def load_config(text: str, *, expected_name: str | None = None, require_io: bool = True) -> ModelConfig:
    """Parse, normalize and validate in one step; raises :class:`ConfigError` with every problem found."""
    cfg = normalize_config(parse_config(text))
    errors = validate_config(cfg, expected_name=expected_name, require_io=require_io)
    if errors:
        raise ConfigError(errors)
    return cfg


# --------------------------------------------------------------------------------------------- validate


def _type_name(value: int) -> str:
    return mc.DataType.Name(value) if value in mc.DataType.values() else str(value)


def _check_tensors(cfg: ModelConfig, kind: str, require: bool, is_ge: bool) -> list[FieldError]:
    errors: list[FieldError] = []
    tensors = getattr(cfg, kind)
    if require and not tensors:
        errors.append(FieldError(kind, f"at least one {kind} is required"))
    seen: dict[str, int] = {}
    for i, t in enumerate(tensors):
        path = f"{kind}[{i}]"
        if not t.name:
            errors.append(FieldError(f"{path}.name", "name is required"))
        elif t.name in seen:
            errors.append(
                FieldError(f"{path}.name", f"duplicate {kind} name {t.name!r} (also {kind}[{seen[t.name]}])")
            )
        else:
            seen[t.name] = i
        if t.data_type == mc.TYPE_INVALID:
            errors.append(FieldError(f"{path}.data_type", "data_type is required"))
        elif is_ge:
            try:
                dtypes.from_config(_type_name(t.data_type))
            except dtypes.UnsupportedDataType:
                errors.append(
                    FieldError(
                        f"{path}.data_type",
                        f"{_type_name(t.data_type)} is not served by the GE backend; supported: "
                        + ", ".join(d.config_name for d in dtypes.SUPPORTED),
                    )
                )
        if not t.dims:
            errors.append(FieldError(f"{path}.dims", "dims are required (use -1 for a dynamic dimension)"))
        for j, d in enumerate(t.dims):
            if d == 0 or d < -1:
                errors.append(
                    FieldError(f"{path}.dims[{j}]", f"dimension {d} is invalid; use a positive size or -1")
                )
    return errors


def _check_batching(cfg: ModelConfig) -> list[FieldError]:
    errors: list[FieldError] = []
    if cfg.max_batch_size < 0:
        errors.append(FieldError("max_batch_size", "must be 0 (no batching) or a positive number"))
    if cfg.HasField("dynamic_batching"):
        if cfg.max_batch_size <= 0:
            errors.append(
                FieldError("dynamic_batching", "dynamic batching needs max_batch_size > 0 (a batched model)")
            )
        for j, p in enumerate(cfg.dynamic_batching.preferred_batch_size):
            if p <= 0:
                errors.append(FieldError(f"dynamic_batching.preferred_batch_size[{j}]", "must be positive"))
            elif cfg.max_batch_size > 0 and p > cfg.max_batch_size:
                errors.append(
                    FieldError(
                        f"dynamic_batching.preferred_batch_size[{j}]",
                        f"preferred batch size {p} is larger than max_batch_size {cfg.max_batch_size}",
                    )
                )
    return errors


def _check_ge_parameters(cfg: ModelConfig) -> list[FieldError]:
    errors: list[FieldError] = []
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    if "DEVICE_ID" in params and not params["DEVICE_ID"].strip().isdigit():
        errors.append(FieldError("parameters.DEVICE_ID", f"{params['DEVICE_ID']!r} is not a device number"))
    if "device_ids" in params:
        ids = [s.strip() for s in params["device_ids"].split(",")]
        if not ids or not all(s.isdigit() for s in ids):
            errors.append(
                FieldError(
                    "parameters.device_ids",
                    f"{params['device_ids']!r} is not a comma-separated list of numbers",
                )
            )
    if "EXECUTOR" in params and params["EXECUTOR"] not in EXECUTORS:
        errors.append(
            FieldError("parameters.EXECUTOR", f"{params['EXECUTOR']!r} is not one of {', '.join(EXECUTORS)}")
        )
    for i, g in enumerate(cfg.instance_group):
        if g.kind == mc.ModelInstanceGroup.KIND_GPU:
            errors.append(
                FieldError(
                    f"instance_group[{i}].kind",
                    "KIND_GPU is for CUDA GPUs; GE instances use KIND_CPU with the DEVICE_ID or device_ids parameter",
                )
            )
        if g.count < 0:
            errors.append(FieldError(f"instance_group[{i}].count", "must be positive"))
    return errors


def _check_ensemble(cfg: ModelConfig) -> list[FieldError]:
    errors: list[FieldError] = []
    steps = cfg.ensemble_scheduling.step
    if not steps:
        return [FieldError("ensemble_scheduling.step", "an ensemble needs at least one step")]
    available = {t.name for t in cfg.input}
    for i, s in enumerate(steps):
        path = f"ensemble_scheduling.step[{i}]"
        if not s.model_name:
            errors.append(FieldError(f"{path}.model_name", "model_name is required"))
        if cfg.input:
            for key, tensor in s.input_map.items():
                if tensor not in available:
                    errors.append(
                        FieldError(
                            f"{path}.input_map.{key}",
                            f"{tensor!r} is neither an ensemble input nor an earlier step's output",
                        )
                    )
        available.update(s.output_map.values())
    for i, t in enumerate(cfg.output):
        if t.name not in available:
            errors.append(FieldError(f"output[{i}].name", f"no step produces {t.name!r}"))
    return errors


def validate_config(
    config: ModelConfig,
    *,
    expected_name: str | None = None,
    signature: ModelSignature | None = None,
    require_io: bool = True,
) -> list[FieldError]:
    """Every problem Triton or the GE backend would hit with this config, as field-level errors ([] = valid).

    ``expected_name`` is the model directory name Triton will load it under; ``signature`` (from the model file)
    is checked against the declared inputs and outputs. ``require_io=False`` allows a minimal config that the
    backend's ``auto_complete_config`` fills in.
    """
    cfg = config
    errors: list[FieldError] = []
    if not cfg.name:
        errors.append(FieldError("name", "name is required"))
    elif expected_name is not None and cfg.name != expected_name:
        errors.append(
            FieldError("name", f"name {cfg.name!r} does not match the model directory {expected_name!r}")
        )
    is_ensemble = cfg.platform == ENSEMBLE_PLATFORM
    if cfg.platform == SEED_PLATFORM:
        errors.append(
            FieldError("platform", 'seed-style platform "graph_executor": normalize to backend "ge" first')
        )
    elif not is_ensemble and not cfg.platform and not cfg.backend:
        errors.append(FieldError("backend", 'backend is required (backend: "ge")'))
    is_ge = cfg.backend == GE_BACKEND
    require = require_io or is_ensemble
    errors += _check_tensors(cfg, "input", require, is_ge)
    errors += _check_tensors(cfg, "output", require, is_ge)
    errors += _check_batching(cfg)
    if is_ge:
        errors += _check_ge_parameters(cfg)
    if is_ensemble:
        errors += _check_ensemble(cfg)
    if signature is not None:
        errors += _check_signature(cfg, signature)
    return errors


def _check_signature(cfg: ModelConfig, sig: ModelSignature) -> list[FieldError]:
    errors: list[FieldError] = []
    if sig.batched is False and cfg.max_batch_size > 0:
        errors.append(
            FieldError("max_batch_size", "the model file has no batch dimension; max_batch_size must be 0")
        )
    for kind, expected in (("input", sig.inputs), ("output", sig.outputs)):
        by_name = {t.name: t for t in expected}
        for i, t in enumerate(getattr(cfg, kind)):
            want = by_name.get(t.name)
            if want is None:
                errors.append(
                    FieldError(
                        f"{kind}[{i}].name",
                        f"the model has no {kind} {t.name!r}; it has {', '.join(by_name)}",
                    )
                )
                continue
            if _type_name(t.data_type) != dtypes.from_wire(want.dtype).config_name:
                errors.append(
                    FieldError(
                        f"{kind}[{i}].data_type",
                        f"the model declares {want.dtype}, not {_type_name(t.data_type)}",
                    )
                )
            dims = tuple(t.dims)
            compatible = len(dims) == len(want.dims) and all(
                a in (b, DYNAMIC) or b == DYNAMIC for a, b in zip(dims, want.dims, strict=False)
            )
            if not compatible:
                errors.append(
                    FieldError(
                        f"{kind}[{i}].dims", f"dims {list(dims)} do not match the model's {list(want.dims)}"
                    )
                )
    return errors


def signature_from_config(config: ModelConfig) -> ModelSignature:
    """The signature a (valid) config declares, e.g. for a ``.om`` upload whose model file cannot be read here."""

    def tensors(items, with_format: bool) -> tuple[TensorSignature, ...]:
        out = []
        for t in items:
            fmt = ""
            if with_format and t.format:
                fmt = mc.ModelInput.Format.Name(t.format).removeprefix("FORMAT_")
            out.append(
                TensorSignature(
                    t.name, dtypes.from_config(_type_name(t.data_type)).wire_name, tuple(t.dims), fmt
                )
            )
        return tuple(out)

    return ModelSignature(
        tensors(config.input, True), tensors(config.output, False), config.max_batch_size > 0
    )


__all__ = [
    "ConfigError",
    "FieldError",
    "ModelConfig",
    "ModelSignature",
    "TensorSignature",
    "default_batch_gears",
    "generate_config",
    "load_config",
    "normalize_config",
    "parse_config",
    "render_config",
    "signature_from_config",
    "signature_from_onnx",
    "validate_config",
    "write_config",
]
