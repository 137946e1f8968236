"""What the GE backend does inside Triton's python stub: config completion, validation and batching.

``backend_ge/model.py`` (installed as ``<backends>/ge/model.py``) hands every call to this module together
with the stub's ``triton_python_backend_utils`` module, so this code never imports the stub-only module
and stays testable on its own.

Hot path rules (one call per dynamic batch): request tensors are read as zero-copy numpy views of Triton's
shared memory, concatenated once, run once, and each response gets numpy slices (views) of the batch
output; no dtype conversion happens because the loaded config must match the model's types exactly.
"""

from __future__ import annotations

import ctypes
import gc
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from backend_ge import dtypes
from backend_ge.executors import Executor, create_executor
from backend_ge.executors.base import TensorSpec

# Triton's onnxruntime backend fills max_batch_size with a small default when a model can batch; the seed
# configs use 16-32, so 8 is a middle that keeps per-call memory small on 2-core CPU hosts. The one default:
# the backend's auto-complete, the platform's generated configs, upload forms and `convert` all read it here
# (this module imports no tritonclient, so the python stubs stay small).
DEFAULT_MAX_BATCH_SIZE = 8
# Triton 2.51's python backend counts a request answered with an error response as a *success*
# (nv_inference_request_success); only an exception out of execute() counts as a failure, and that would
# fail every request of the batch. So the backend counts its own failed requests in this family, which
# Triton exposes on its metrics port next to its own; the platform's scraper subtracts them from the
# successes. Reasons: INVALID_REQUEST (the request does not fit the model) and BACKEND (the model failed).
FAILURE_METRIC = "ge_inference_request_failure"
FAILURE_REASONS = ("INVALID_REQUEST", "BACKEND")


class ConfigMismatch(ValueError):
    """The model config disagrees with the model file; raised at load time."""


class RequestError(ValueError):
    """One request is malformed; only that request fails (INVALID_ARG)."""


def config_parameters(config: Mapping[str, Any]) -> dict[str, str]:
    """``parameters { key: .. value { string_value: .. } }`` as a plain dict."""
    params = config.get("parameters") or {}
    return {k: (v.get("string_value", "") if isinstance(v, Mapping) else str(v)) for k, v in params.items()}


def instance_index(instance_name: str) -> int:
    """Triton names instances ``<group>_<n>``; n picks the device from ``device_ids``."""
    match = re.search(r"_(\d+)$", instance_name or "")
    return int(match.group(1)) if match else 0


def _dims_compatible(config_dims: list[int], model_dims: tuple[int, ...]) -> bool:
    if len(config_dims) != len(model_dims):
        return False
    return all(c == -1 or m == -1 or c == m for c, m in zip(config_dims, model_dims, strict=True))


def check_config(config: Mapping[str, Any], executor: Executor) -> None:
    """Raise ConfigMismatch when the config's tensors, types, dims or batching do not fit the model."""
    problems: list[str] = []
    max_batch = int(config.get("max_batch_size") or 0)
    strip = 1 if max_batch > 0 else 0
    if max_batch > 0 and executor.max_batch_size < max_batch:
        if executor.max_batch_size == 0:
            problems.append(f"max_batch_size is {max_batch} but the model has no dynamic batch dimension")
        else:
            problems.append(
                f"max_batch_size {max_batch} exceeds the model's largest batch {executor.max_batch_size}"
            )
    for kind, specs in (("input", executor.inputs), ("output", executor.outputs)):
        by_name = {s.name: s for s in specs}
        configured = config.get(kind) or []
        for entry in configured:
            name = entry.get("name", "")
            spec = by_name.get(name)
            if spec is None:
                problems.append(
                    f"config {kind} {name!r} is not in the model (model {kind}s: {', '.join(by_name)})"
                )
                continue
            try:
                want = dtypes.from_config(entry.get("data_type", "TYPE_INVALID"))
            except dtypes.UnsupportedDataType as e:
                problems.append(f"{kind} {name!r}: {e}")
                continue
            if want != spec.dtype:
                problems.append(
                    f"{kind} {name!r} is {want.config_name} in the config but {spec.dtype.config_name} in the model"
                )
            dims = list((entry.get("reshape") or {}).get("shape") or entry.get("dims") or [])
            if spec.shape[strip:] and not _dims_compatible(dims, spec.shape[strip:]):
                problems.append(
                    f"{kind} {name!r} has dims {dims} in the config but {list(spec.shape[strip:])} in the model"
                )
        if kind == "input":
            missing = set(by_name) - {e.get("name") for e in configured}
            problems += [f"model input {m!r} is missing from the config" for m in sorted(missing)]
    if problems:
        raise ConfigMismatch("model config does not match the model file: " + "; ".join(problems))


def complete_config(config: dict[str, Any], executor: Executor) -> dict[str, Any]:
    """Return what to add to a partial config: ``max_batch_size``, ``dynamic_batching``, inputs, outputs."""
    added: dict[str, Any] = {"input": [], "output": []}
    max_batch = int(config.get("max_batch_size") or 0)
    untouched = not config.get("input") and not config.get("output")
    if max_batch == 0 and untouched and executor.max_batch_size > 0:
        max_batch = min(DEFAULT_MAX_BATCH_SIZE, executor.max_batch_size)
        added["max_batch_size"] = max_batch
        added["dynamic_batching"] = "dynamic_batching" not in config
    strip = 1 if max_batch > 0 else 0
    for kind, specs in (("input", executor.inputs), ("output", executor.outputs)):
        have = {e.get("name") for e in config.get(kind) or []}
        for spec in specs:
            if spec.name not in have:
                added[kind].append(
                    {"name": spec.name, "data_type": spec.dtype.config_name, "dims": list(spec.shape[strip:])}
                )
    return added


def auto_complete(pb_utils, model_config) -> Any:
    """``TritonPythonModel.auto_complete_config``: fill the config from the model file."""
    config = model_config.as_dict()
    if config.get("input") and config.get("output") and config.get("max_batch_size") is not None:
        inputs_typed = all(e.get("data_type", "TYPE_INVALID") != "TYPE_INVALID" for e in config["input"])
        if inputs_typed:
            return model_config  # complete already: skip loading the model a second time
    version_dir = Path(pb_utils.get_model_dir())
    executor = create_executor(
        version_dir, config_parameters(config), model_filename=config.get("default_model_filename", "")
    )
    try:
        added = complete_config(config, executor)
    finally:
        executor.close()
    if "max_batch_size" in added:
        model_config.set_max_batch_size(added["max_batch_size"])
        if added["dynamic_batching"]:
            model_config.set_dynamic_batching()
    for entry in added["input"]:
        model_config.add_input(entry)
    for entry in added["output"]:
        model_config.add_output(entry)
    return model_config


def _wire_name(dtype: np.dtype) -> str:
    try:
        return dtypes.from_numpy(dtype).wire_name
    except dtypes.UnsupportedDataType:
        return str(dtype)


def _failure_counters(pb_utils, model: str, version: str) -> tuple[Any, dict[str, Any]]:
    """One ``FAILURE_METRIC`` counter per reason; none where the stub has no custom metrics (tests' fakes)."""
    family_class = getattr(pb_utils, "MetricFamily", None)
    if family_class is None:
        return None, {}
    try:
        # Instances of one model create the same family and labels; Triton hands them the same counter.
        family = family_class(
            name=FAILURE_METRIC,
            description="Requests the GE backend answered with an error (Triton counts them as successes)",
            kind=family_class.COUNTER,
        )
        return family, {
            reason: family.Metric(labels={"model": model, "version": version, "reason": reason})
            for reason in FAILURE_REASONS
        }
    except Exception:  # metrics disabled on this server: serving must not depend on them
        return None, {}


def release_free_memory() -> None:
    """Settle the stub's memory once the model is loaded (one stub process per model instance).

    Loading parses the model file and builds the session through temporary buffers; glibc keeps freed
    pages in the process unless asked (measured: ~4-5 MiB of a stub's ~40 MiB for the example MLP).
    The objects alive now (numpy's and onnxruntime's modules, the model) live as long as the stub:
    frozen, so the collector's full passes stop re-scanning them while requests are served.
    """
    gc.collect()
    gc.freeze()
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


class _Input:
    """One model input as the hot path checks it."""

    __slots__ = ("dims", "dtype", "name", "static")

    def __init__(self, spec: TensorSpec, strip: int) -> None:
        self.name = spec.name
        self.dtype = spec.dtype.numpy
        self.dims = tuple(spec.shape[strip:])
        self.static = all(d >= 0 for d in self.dims)


class GeModel:
    """One model instance: an executor plus the batching around it."""

    def __init__(self, pb_utils, args: Mapping[str, str]) -> None:
        self._pb = pb_utils
        config = json.loads(args["model_config"])
        self.name = args.get("model_name", config.get("name", ""))
        version_dir = Path(args["model_repository"]) / str(args["model_version"])
        self.executor = create_executor(
            version_dir,
            config_parameters(config),
            instance_index=instance_index(args.get("model_instance_name", "")),
            model_filename=config.get("default_model_filename", ""),
        )
        try:
            check_config(config, self.executor)
        except Exception:
            self.executor.close()
            raise
        self.max_batch_size = int(config.get("max_batch_size") or 0)
        strip = 1 if self.max_batch_size > 0 else 0
        self._inputs = [_Input(s, strip) for s in self.executor.inputs]
        self._input_names = [s.name for s in self._inputs]
        self._output_names = [o["name"] for o in config.get("output") or []] or [
            s.name for s in self.executor.outputs
        ]
        self._run = self.executor.runner(self._output_names)
        self._Tensor = pb_utils.Tensor
        self._InferenceResponse = pb_utils.InferenceResponse
        self._invalid_arg = pb_utils.TritonError.INVALID_ARG
        self._internal = pb_utils.TritonError.INTERNAL
        # The family object stays referenced for as long as its counters are used.
        self._failure_family, self._failures = _failure_counters(
            pb_utils, self.name, str(args.get("model_version", ""))
        )
        release_free_memory()

    # -- request checks --------------------------------------------------------------------------------
    def _arrays(self, request) -> list[np.ndarray]:
        """The request's inputs in model order, as zero-copy views; raise RequestError when malformed."""
        tensors = request.inputs()
        specs = self._inputs
        if len(tensors) == len(specs) == 1 and tensors[0].name() == specs[0].name:
            # Every model input named once: no lookup table per request (the common single-input case).
            by_name = None
        else:
            by_name = {t.name(): t for t in tensors}
        arrays = []
        batch = None
        batched = self.max_batch_size > 0
        for spec in specs:
            tensor = tensors[0] if by_name is None else by_name.get(spec.name)
            if tensor is None:
                raise RequestError(f"missing input {spec.name!r} for model {self.name!r}")
            array = tensor.as_numpy()
            if array.dtype != spec.dtype:
                raise RequestError(
                    f"input {spec.name!r} has data type {_wire_name(array.dtype)}, "
                    f"model {self.name!r} expects {_wire_name(spec.dtype)}"
                )
            shape = array.shape
            if batched:
                if not shape or (batch is not None and shape[0] != batch):
                    raise RequestError(
                        f"input {spec.name!r} has shape {list(shape)}: batch sizes differ between inputs"
                    )
                batch = shape[0]
                item = shape[1:]
            else:
                item = shape
            if item != spec.dims and (spec.static or not _dims_compatible(list(item), spec.dims)):
                expected = ([-1] if batched else []) + list(spec.dims)
                raise RequestError(
                    f"input {spec.name!r} has shape {list(shape)}, model {self.name!r} expects {expected}"
                )
            arrays.append(array)
        return arrays

    def _response(self, outputs: list[np.ndarray], start: int | None = None, stop: int | None = None):
        Tensor = self._Tensor
        if start is None:
            tensors = [Tensor(name, out) for name, out in zip(self._output_names, outputs, strict=True)]
        else:
            tensors = [
                Tensor(name, out[start:stop]) for name, out in zip(self._output_names, outputs, strict=True)
            ]
        return self._InferenceResponse(tensors)

    def _error(self, message: str, code):
        counter = self._failures.get("INVALID_REQUEST" if code == self._invalid_arg else "BACKEND")
        if counter is not None:
            counter.increment(1)
        return self._pb.InferenceResponse(output_tensors=[], error=self._pb.TritonError(message, code))

    # -- execute ---------------------------------------------------------------------------------------
    def execute(self, requests: list) -> list:
        """One executor call per group of same-shaped valid requests (normally the whole batch)."""
        if len(requests) == 1:  # no batch formed (low load, or no dynamic batching): nothing to group
            responses: list = [None]
            try:
                arrays = self._arrays(requests[0])
            except RequestError as e:
                return [self._error(str(e), self._invalid_arg)]
            self._run_group([(0, arrays)], responses)
            return responses
        responses = [None] * len(requests)
        groups: dict[tuple, list[tuple[int, list[np.ndarray]]]] = {}
        for i, request in enumerate(requests):
            try:
                arrays = self._arrays(request)
            except RequestError as e:
                responses[i] = self._error(str(e), self._invalid_arg)
                continue
            if not self.max_batch_size:
                self._run_group([(i, arrays)], responses)
                continue
            key = tuple(a.shape[1:] for a in arrays)
            groups.setdefault(key, []).append((i, arrays))
        for members in groups.values():
            self._run_group(members, responses)
        return responses

    def _run_group(self, members: list[tuple[int, list[np.ndarray]]], responses: list) -> None:
        if len(members) == 1:
            feeds = dict(zip(self._input_names, members[0][1], strict=True))
        else:
            feeds = {
                name: np.concatenate([arrays[k] for _, arrays in members])
                for k, name in enumerate(self._input_names)
            }
        try:
            outputs = self._run(feeds)
        except Exception as e:  # the whole group failed: every request in it learns why
            for i, _ in members:
                responses[i] = self._error(f"model {self.name!r} failed: {e}", self._internal)
            return
        if len(members) == 1:
            responses[members[0][0]] = self._response(outputs)
            return
        total = sum(arrays[0].shape[0] for _, arrays in members)
        short = [n for n, out in zip(self._output_names, outputs, strict=True) if out.shape[:1] != (total,)]
        if short:  # slicing would hand requests someone else's rows
            message = f"model {self.name!r} returned output {short[0]!r} without a batch dimension of {total}"
            for i, _ in members:
                responses[i] = self._error(message, self._internal)
            return
        start = 0
        for i, arrays in members:
            stop = start + arrays[0].shape[0]
            responses[i] = self._response(outputs, start, stop)
            start = stop

    def close(self) -> None:
        recorder = getattr(self, "profile_recorder", None)  # set by backend_ge.profiling, when enabled
        if recorder is not None:
            recorder.flush()
        self.executor.close()
