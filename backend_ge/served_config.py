"""The config a version is served with, built by the platform from the fields a tenant may set.

A tenant's ``config.pbtxt`` (an upload, a config edit, a generated config) is never passed to Triton as
written: :func:`build_served_config` walks every field that is set in it (``ListFields()``, recursively), refuses
every field that is not on :data:`TENANT_FIELDS`, checks the bounds of the ones that are, and copies only those
into a fresh config whose name, backend and instance kind the platform sets. A field Triton adds in a later
release is therefore refused until someone decides a tenant may set it.

What stays the platform's, and why: the model ``name`` (Triton names models after their directory, which the
platform derives), ``backend``/``platform`` (a backend is code run on the host), ``version_policy`` (the platform
pins the versions it serves), every file name (``default_model_filename``, ``cc_model_filenames``, warmup data
files, label files: a path could reach another team's files), the devices (``DEVICE_ID``/``device_ids``,
``gpus``: chosen at placement from the instance's devices), and everything that loads code or changes the
server (``model_repository_agents``, ``EXECUTION_ENV_PATH`` and other python-backend parameters, ``runtime``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from backend_ge.config import (
    ENSEMBLE_PLATFORM,
    GE_BACKEND,
    ConfigError,
    FieldError,
    ModelConfig,
    ModelSignature,
    normalize_config,
    parse_config,
    validate_config,
)
from backend_ge.executors import EXECUTOR_NAMES

# Bounds, each defined once; the registry's serving options use the same numbers.
MAX_BATCH_SIZE = 1024
MAX_QUEUE_DELAY_US = 10_000_000  # 10 s
MAX_QUEUE_TIMEOUT_US = 60_000_000  # a queued request waits at most a minute
MAX_QUEUE_SIZE = 100_000
MAX_PRIORITY_LEVELS = 16
MAX_PREFERRED_BATCH_SIZES = 16
MAX_INSTANCE_COUNT = 8  # every instance is a python stub process (~90 MiB) on the host
# How a refusal names the bound a config's instance count met (build_served_config's ``instance_limit``).
PLATFORM_INSTANCE_LIMIT = "the platform's limit"
TEAM_INSTANCE_LIMIT = "the team's limit (quota_model_instances)"
HOST_INSTANCE_LIMIT = "this host's limit (FLEET_MAX_MODEL_INSTANCES)"
MAX_TENSORS = 64
MAX_RANK = 8
MAX_DIM = 1 << 24
MAX_WARMUPS = 4
MAX_WARMUP_COUNT = 16
MAX_ENSEMBLE_STEPS = 16
MAX_THREADS = 64
MAX_NAME_LENGTH = 128
# Tensor names as ONNX and TensorFlow exporters write them (``input.1``, ``onnx::Gemm_0``, ``x/y:0``).
TENSOR_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:/-]*")

LEAF = None  # an allowed scalar (or repeated scalar) field; its value is bounded below
_QUEUE_POLICY = {
    "timeout_action": LEAF,
    "default_timeout_microseconds": LEAF,
    "allow_timeout_override": LEAF,
    "max_queue_size": LEAF,
}
_RESHAPE = {"shape": LEAF}
# Field name -> LEAF or the allowed sub-fields of a message (for a map: its "key" and "value").
TENANT_FIELDS: dict[str, Any] = {
    "name": LEAF,  # replaced by the platform's name
    "platform": LEAF,  # "ensemble" only; checked below
    "backend": LEAF,  # "ge" only; checked below
    "max_batch_size": LEAF,
    "input": {
        "name": LEAF,
        "data_type": LEAF,
        "format": LEAF,
        "dims": LEAF,
        "reshape": _RESHAPE,
        "optional": LEAF,
    },
    "output": {"name": LEAF, "data_type": LEAF, "dims": LEAF, "reshape": _RESHAPE},
    "dynamic_batching": {
        "preferred_batch_size": LEAF,
        "max_queue_delay_microseconds": LEAF,
        "preserve_ordering": LEAF,
        "priority_levels": LEAF,
        "default_priority_level": LEAF,
        "default_queue_policy": _QUEUE_POLICY,
        "priority_queue_policy": {"key": LEAF, "value": _QUEUE_POLICY},
    },
    "instance_group": {"kind": LEAF, "count": LEAF},
    "model_warmup": {
        "name": LEAF,
        "batch_size": LEAF,
        "count": LEAF,
        "inputs": {
            "key": LEAF,
            "value": {"data_type": LEAF, "dims": LEAF, "zero_data": LEAF, "random_data": LEAF},
        },
    },
    "parameters": {"key": LEAF, "value": {"string_value": LEAF}},
    "ensemble_scheduling": {
        "step": {
            "model_name": LEAF,
            "model_version": LEAF,
            "input_map": {"key": LEAF, "value": LEAF},
            "output_map": {"key": LEAF, "value": LEAF},
        }
    },
}
# Only these fields make sense in an ensemble (Triton schedules it; no backend, instances or parameters).
ENSEMBLE_FIELDS = frozenset({"name", "platform", "max_batch_size", "input", "output", "ensemble_scheduling"})

# The GE backend's documented parameters (backend_ge.executors): value checks by key. Keys are matched exactly:
# the backend reads them case-insensitively, so a second spelling (``device_id``) must not slip through.
_INTEGER_PARAMETER = (0, MAX_THREADS)
GE_PARAMETERS: dict[str, Any] = {
    "EXECUTOR": EXECUTOR_NAMES,
    "EXECUTOR_TYPE": EXECUTOR_NAMES,  # the seed's spelling
    "intra_op_thread_count": _INTEGER_PARAMETER,
    "INTRA_OP_THREADS": _INTEGER_PARAMETER,
}
PLATFORM_PARAMETERS = frozenset({"DEVICE_ID", "device_ids"})

# Why a well-known field is the platform's; anything else gets the generic reason.
_REASONS = {
    "version_policy": "the platform pins the versions it serves",
    "default_model_filename": "file names are the platform's: it lays out the model directory",
    "cc_model_filenames": "file names are the platform's: it lays out the model directory",
    "label_filename": "file names are the platform's: a path could reach other files on the host",
    "input_data_file": "warmup data comes from zero_data or random_data; a file path could reach other files",
    "gpus": "devices are chosen by the platform at placement",
    "secondary_devices": "devices are chosen by the platform at placement",
    "host_policy": "host policies are the platform's",
    "model_repository_agents": "repository agents run code on the inference host",
    "runtime": "the runtime is the platform's (backend ge)",
    "model_namespace": "ensemble steps call models of the same team by name",
}
_GENERIC_REASON = "not a field a tenant may set (the platform refuses fields it does not know)"

AllowedModels = Callable[[str], bool] | Collection[str] | None


def _refuse(path: str, name: str) -> FieldError:
    return FieldError(path, f"{_REASONS.get(name, _GENERIC_REASON)}; remove it")


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _copy_allowed(src, dst, spec: dict, path: str, errors: list[FieldError]) -> None:
    """Copy the fields of ``src`` that ``spec`` allows into ``dst``; every other set field is an error."""
    for field, value in src.ListFields():
        where = _join(path, field.name)
        if field.name not in spec:
            errors.append(_refuse(where, field.name))
            continue
        sub = spec[field.name]
        if field.message_type is None:
            if field.is_repeated:
                getattr(dst, field.name).extend(value)
            else:
                setattr(dst, field.name, value)
        elif field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            target = getattr(dst, field.name)
            for key in value:
                if value_field.message_type is None:
                    target[key] = value[key]
                else:
                    _copy_allowed(value[key], target[key], sub["value"], f"{where}.{key}", errors)
        elif field.is_repeated:
            for i, item in enumerate(value):
                _copy_allowed(item, getattr(dst, field.name).add(), sub, f"{where}[{i}]", errors)
        else:
            getattr(dst, field.name).SetInParent()
            _copy_allowed(value, getattr(dst, field.name), sub, where, errors)


def _bounded(errors: list[FieldError], path: str, value: int, low: int, high: int, what: str = "") -> None:
    if not low <= value <= high:
        errors.append(FieldError(path, f"{what or value} is out of bounds: use {low} to {high}"))


def _check_name(errors: list[FieldError], path: str, name: str) -> None:
    if name and (len(name) > MAX_NAME_LENGTH or not TENSOR_NAME.fullmatch(name)):
        errors.append(
            FieldError(path, f"{name[:40]!r} is not a safe name: letters, digits and _ . : / - only")
        )


def _check_dims(errors: list[FieldError], path: str, dims) -> None:
    if len(dims) > MAX_RANK:
        errors.append(FieldError(path, f"{len(dims)} dimensions; at most {MAX_RANK}"))
    for j, d in enumerate(dims):
        if d != -1 and not 1 <= d <= MAX_DIM:
            errors.append(FieldError(f"{path}[{j}]", f"dimension {d} is out of bounds: -1 or 1 to {MAX_DIM}"))


def _check_tensors(cfg: ModelConfig, errors: list[FieldError]) -> None:
    for kind in ("input", "output"):
        tensors = getattr(cfg, kind)
        if len(tensors) > MAX_TENSORS:
            errors.append(FieldError(kind, f"{len(tensors)} tensors; at most {MAX_TENSORS}"))
        for i, t in enumerate(tensors):
            _check_name(errors, f"{kind}[{i}].name", t.name)
            _check_dims(errors, f"{kind}[{i}].dims", t.dims)
            if t.HasField("reshape"):
                _check_dims(errors, f"{kind}[{i}].reshape.shape", t.reshape.shape)


def _check_queue_policy(errors: list[FieldError], path: str, policy) -> None:
    _bounded(
        errors,
        f"{path}.default_timeout_microseconds",
        policy.default_timeout_microseconds,
        0,
        MAX_QUEUE_TIMEOUT_US,
    )
    _bounded(errors, f"{path}.max_queue_size", policy.max_queue_size, 0, MAX_QUEUE_SIZE)


def _check_dynamic_batching(cfg: ModelConfig, errors: list[FieldError]) -> None:
    _bounded(errors, "max_batch_size", cfg.max_batch_size, 0, MAX_BATCH_SIZE)
    if not cfg.HasField("dynamic_batching"):
        return
    db = cfg.dynamic_batching
    path = "dynamic_batching"
    if len(db.preferred_batch_size) > MAX_PREFERRED_BATCH_SIZES:
        errors.append(
            FieldError(f"{path}.preferred_batch_size", f"at most {MAX_PREFERRED_BATCH_SIZES} preferred sizes")
        )
    _bounded(
        errors, f"{path}.max_queue_delay_microseconds", db.max_queue_delay_microseconds, 0, MAX_QUEUE_DELAY_US
    )
    _bounded(errors, f"{path}.priority_levels", db.priority_levels, 0, MAX_PRIORITY_LEVELS)
    _bounded(errors, f"{path}.default_priority_level", db.default_priority_level, 0, db.priority_levels)
    if db.HasField("default_queue_policy"):
        _check_queue_policy(errors, f"{path}.default_queue_policy", db.default_queue_policy)
    for level in db.priority_queue_policy:
        where = f"{path}.priority_queue_policy.{level}"
        _bounded(errors, where, level, 1, db.priority_levels, f"priority level {level}")
        _check_queue_policy(errors, where, db.priority_queue_policy[level])


def _check_instances(cfg: ModelConfig, errors: list[FieldError], max_instance_count: int, limit: str) -> None:
    total = 0
    over = None
    for i, group in enumerate(cfg.instance_group):
        if group.kind not in (mc.ModelInstanceGroup.KIND_AUTO, mc.ModelInstanceGroup.KIND_CPU):
            errors.append(
                FieldError(
                    f"instance_group[{i}].kind",
                    f"{mc.ModelInstanceGroup.Kind.Name(group.kind)}: GE instances are KIND_CPU; the platform "
                    "assigns NPUs at placement",
                )
            )
        if group.count < 0:
            errors.append(FieldError(f"instance_group[{i}].count", "must be positive"))
        total += max(group.count, 1)
        if over is None and total > max_instance_count:
            over = i
    if over is not None:
        errors.append(
            FieldError(
                f"instance_group[{over}].count",
                f"{total} instances in all; {limit} is {max_instance_count} per model "
                "(each one is a process on the host)",
            )
        )


def _check_warmup(cfg: ModelConfig, errors: list[FieldError]) -> None:
    if len(cfg.model_warmup) > MAX_WARMUPS:
        errors.append(FieldError("model_warmup", f"{len(cfg.model_warmup)} warmups; at most {MAX_WARMUPS}"))
    inputs = {t.name for t in cfg.input}
    for i, warmup in enumerate(cfg.model_warmup):
        path = f"model_warmup[{i}]"
        _check_name(errors, f"{path}.name", warmup.name)
        _bounded(errors, f"{path}.batch_size", warmup.batch_size, 0, max(cfg.max_batch_size, 1))
        _bounded(errors, f"{path}.count", warmup.count, 0, MAX_WARMUP_COUNT)
        for key, value in warmup.inputs.items():
            where = f"{path}.inputs.{key}"
            if key not in inputs:
                errors.append(FieldError(where, f"{key[:40]!r} is not one of the model's inputs"))
            if value.WhichOneof("input_data_type") is None:
                errors.append(FieldError(where, "give zero_data: true or random_data: true"))
            _check_dims(errors, f"{where}.dims", value.dims)


def _check_parameters(cfg: ModelConfig, errors: list[FieldError]) -> None:
    for key, value in cfg.parameters.items():
        where = f"parameters.{key}"
        rule = GE_PARAMETERS.get(key)
        text = value.string_value.strip()
        if key in PLATFORM_PARAMETERS:
            errors.append(FieldError(where, "devices are chosen by the platform at placement; remove it"))
        elif rule is None:
            errors.append(
                FieldError(where, "not a GE backend parameter; allowed: " + ", ".join(GE_PARAMETERS))
            )
        elif isinstance(rule, tuple):
            if not (re.fullmatch(r"[0-9]{1,6}", text) and rule[0] <= int(text) <= rule[1]):
                errors.append(
                    FieldError(where, f"{text[:40]!r} is not a whole number from {rule[0]} to {rule[1]}")
                )
        elif text.lower() not in rule:
            errors.append(
                FieldError(where, f"{text[:40]!r} is not one of {', '.join(sorted(set(rule) - {''}))}")
            )


def _model_allowed(allowed_models: AllowedModels, name: str) -> bool:
    if allowed_models is None:
        return False
    if callable(allowed_models):
        return bool(allowed_models(name))
    return name in allowed_models


def _check_ensemble(cfg: ModelConfig, errors: list[FieldError], allowed_models: AllowedModels) -> None:
    steps = cfg.ensemble_scheduling.step
    if len(steps) > MAX_ENSEMBLE_STEPS:
        errors.append(
            FieldError("ensemble_scheduling.step", f"{len(steps)} steps; at most {MAX_ENSEMBLE_STEPS}")
        )
    for i, step in enumerate(steps):
        path = f"ensemble_scheduling.step[{i}]"
        if step.model_name and not _model_allowed(allowed_models, step.model_name):
            errors.append(
                FieldError(f"{path}.model_name", f"{step.model_name[:60]!r} is not a model of this team")
            )
        if step.model_version != -1 and not 0 <= step.model_version <= 1_000_000:
            errors.append(FieldError(f"{path}.model_version", "use -1 (latest) or a version number"))
        for kind in ("input_map", "output_map"):
            for key, tensor in getattr(step, kind).items():
                _check_name(errors, f"{path}.{kind}.{key}", key)
                _check_name(errors, f"{path}.{kind}.{key}", tensor)


def _check_kind(cfg: ModelConfig, errors: list[FieldError], allowed_models: AllowedModels) -> bool:
    """Backend "ge", or platform "ensemble" where ensembles are accepted; returns True for an ensemble."""
    if cfg.platform and cfg.platform != ENSEMBLE_PLATFORM:
        errors.append(
            FieldError(
                "platform", f'{cfg.platform[:40]!r}: models are served by backend "ge"; remove platform'
            )
        )
    if cfg.backend and cfg.backend != GE_BACKEND:
        errors.append(
            FieldError("backend", f'{cfg.backend[:40]!r}: the platform serves models with backend "ge" only')
        )
    is_ensemble = cfg.platform == ENSEMBLE_PLATFORM
    if is_ensemble and allowed_models is None:
        errors.append(
            FieldError("platform", "ensembles are not accepted here: upload each model of the ensemble")
        )
    if is_ensemble:
        for field, _ in cfg.ListFields():
            if field.name not in ENSEMBLE_FIELDS:
                errors.append(FieldError(field.name, "an ensemble is scheduled by Triton; remove it"))
    elif cfg.HasField("ensemble_scheduling"):
        errors.append(FieldError("ensemble_scheduling", 'only a platform "ensemble" config has steps'))
    return is_ensemble


def build_served_config(
    config: ModelConfig | str,
    *,
    name: str,
    max_instance_count: int = MAX_INSTANCE_COUNT,
    instance_limit: str = PLATFORM_INSTANCE_LIMIT,
    allowed_models: AllowedModels = None,
    signature: ModelSignature | None = None,
    require_io: bool = True,
) -> ModelConfig:
    """The config the platform serves, built from only the fields a tenant may set; raises ConfigError.

    ``config`` is a tenant's config (text or parsed; seed style is normalized first). ``name`` is the
    platform's Triton model name (the tenant's name is a label and is replaced). ``max_instance_count`` is the
    caller's limit for the instance count (the team's quota, the platform's and the host's) and
    ``instance_limit`` names it in the refusal. ``allowed_models`` is the set (or a
    predicate) of model names an ensemble step may call - models of the same team; ``None`` refuses ensembles.
    ``signature`` (from the model file) is checked against the declared inputs and outputs.
    Every problem is reported at once, each with its field path.
    """
    if isinstance(config, str):
        config = parse_config(config)
    source = normalize_config(config)
    errors: list[FieldError] = []
    served = ModelConfig()
    _copy_allowed(source, served, TENANT_FIELDS, "", errors)
    is_ensemble = _check_kind(served, errors, allowed_models)
    _check_tensors(served, errors)
    _check_dynamic_batching(served, errors)
    _check_instances(served, errors, max_instance_count, instance_limit)
    _check_warmup(served, errors)
    _check_parameters(served, errors)
    if is_ensemble:
        _check_ensemble(served, errors, allowed_models)
    # The platform's fields, whatever the tenant wrote.
    served.name = name
    if not is_ensemble:
        served.platform = ""
        served.backend = GE_BACKEND
        if not served.instance_group:
            served.instance_group.add(count=1)
        for group in served.instance_group:
            group.kind = mc.ModelInstanceGroup.KIND_CPU
            group.count = max(group.count, 1)
    known = {e.field for e in errors}
    errors += [
        e
        for e in validate_config(served, expected_name=name, signature=signature, require_io=require_io)
        if e.field not in known
    ]
    if errors:
        raise ConfigError(errors)
    return served


def host_instance_limit(team_limit: int, host_limit: int) -> tuple[int, str]:
    """How many model instances a config may run on a host, and how a refusal names the bound: the team's
    quota (which the platform caps at MAX_INSTANCE_COUNT) or the host's own limit, whichever is lower."""
    host_limit = max(1, int(host_limit))
    if host_limit < team_limit:
        return host_limit, HOST_INSTANCE_LIMIT
    return team_limit, TEAM_INSTANCE_LIMIT


__all__ = [
    "GE_PARAMETERS",
    "HOST_INSTANCE_LIMIT",
    "MAX_BATCH_SIZE",
    "MAX_INSTANCE_COUNT",
    "MAX_QUEUE_DELAY_US",
    "PLATFORM_INSTANCE_LIMIT",
    "TEAM_INSTANCE_LIMIT",
    "TENANT_FIELDS",
    "build_served_config",
    "host_instance_limit",
]
