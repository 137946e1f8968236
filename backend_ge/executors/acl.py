"""Run an ATC-compiled ``.om`` model on an Ascend NPU through pyACL (``import acl``, shipped with CANN).

The call sequence follows Huawei's pyACL model-inference flow: init, set_device, create_context,
load_from_file, model description, device buffers sized by ``get_input_size_by_index`` (the largest
dynamic-batch gear), datasets, then per call host->device copies, ``set_dynamic_batch_size``, execute,
``get_cur_output_dims`` and device->host copies. Device buffers and datasets are created once and reused; only
``close()`` releases them.

Host staging avoids copies: ``acl.util.numpy_to_ptr`` is deprecated and ``acl.util.bytes_to_ptr`` needs a
``bytes`` object (one extra copy of every input), so the executor hands pyACL the address of C-contiguous numpy
arrays (``ndarray.ctypes.data``), which is the same integer pointer pyACL's helpers return. Inputs are copied
straight from the caller's rows and outputs straight into the array returned to the caller.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass

import numpy as np

from backend_ge import dtypes
from backend_ge.executors.base import Executor, ExecutorError, TensorSpec

DYNAMIC_BATCH_INPUT = "ascend_mbatch_shape_data"  # ACL_DYNAMIC_TENSOR_NAME
ACL_MEM_MALLOC_HUGE_FIRST = 0
ACL_MEMCPY_HOST_TO_DEVICE = 1
ACL_MEMCPY_DEVICE_TO_HOST = 2
ACL_SUCCESS = 0
ACL_ERROR_REPEAT_INITIALIZE = 100002

# aclError values (acl/acl_base.h, runtime/rt_error_codes.h) with what they usually mean for this backend.
ERROR_MEANINGS: dict[int, str] = {
    100000: "ACL_ERROR_INVALID_PARAM: a parameter is invalid",
    100001: "ACL_ERROR_UNINITIALIZE: acl.init() was not called",
    100002: "ACL_ERROR_REPEAT_INITIALIZE: already initialized",
    100003: "ACL_ERROR_INVALID_FILE: the model file is missing or unreadable",
    100006: "ACL_ERROR_PARSE_FILE: the file could not be parsed",
    100011: "ACL_ERROR_INVALID_MODEL_ID: the model is not loaded",
    100012: "ACL_ERROR_DESERIALIZE_MODEL: the .om does not match this CANN version; rebuild it with atc",
    100013: "ACL_ERROR_PARSE_MODEL: the .om could not be parsed; rebuild it with atc for this CANN version",
    100014: "ACL_ERROR_READ_MODEL_FAILURE: the model file could not be read",
    100015: "ACL_ERROR_MODEL_SIZE_INVALID: the model file is invalid",
    100017: "ACL_ERROR_MODEL_INPUT_NOT_MATCH: the inputs do not match the model",
    100018: "ACL_ERROR_MODEL_OUTPUT_NOT_MATCH: the outputs do not match the model",
    100019: "ACL_ERROR_MODEL_NOT_DYNAMIC: the model was not compiled with dynamic batch",
    100037: "ACL_ERROR_REPEAT_FINALIZE: already finalized",
    107000: "ACL_ERROR_RT_PARAM_INVALID: runtime parameter invalid",
    107001: "ACL_ERROR_RT_INVALID_DEVICEID: no such NPU device; check DEVICE_ID against npu-smi info",
    107002: "ACL_ERROR_RT_CONTEXT_NULL: no current context; set_device/create_context first",
    200000: "ACL_ERROR_BAD_ALLOC: out of memory",
    207001: "ACL_ERROR_RT_MEMORY_ALLOCATION: device memory allocation failed",
    500000: "ACL_ERROR_INTERNAL_ERROR: internal error; see the logs under $HOME/ascend/log/",
    500002: "ACL_ERROR_GE_FAILURE: graph engine failure; see the logs under $HOME/ascend/log/",
    507011: "ACL_ERROR_RT_MODEL_EXECUTE: model execution failed",
}


class AclError(ExecutorError):
    """A pyACL call returned a non-zero code; ``call`` and ``code`` say which and what."""

    def __init__(self, call: str, code: int, detail: str = ""):
        self.call, self.code = call, code
        meaning = ERROR_MEANINGS.get(code, "unknown aclError; see the logs under $HOME/ascend/log/")
        super().__init__(f"{call} failed with error {code} ({meaning}){': ' + detail if detail else ''}")


def _check(call: str, ret: int, detail: str = "") -> None:
    if ret != ACL_SUCCESS:
        raise AclError(call, ret, detail)


# acl.init()/acl.finalize() are process-wide: count executors per acl module so the last one out finalizes,
# and never finalize a runtime someone else initialized (init answered "repeat initialize").
_INIT_USERS: dict[int, list] = {}  # id(acl module) -> [executors using it, whether we initialized it]


@dataclass
class _Binding:
    """One model input or output: its device buffer, sizes and, for batched tensors, bytes per row."""

    index: int
    spec: TensorSpec | None  # None for the hidden dynamic-batch input
    device_ptr: int
    size: int
    data_buffer: int
    row_bytes: int = 0


class AclExecutor(Executor):
    """Runs one ``.om`` file on one NPU device. Not thread-safe: one per Triton model instance."""

    kind = "acl"

    def __init__(self, path: str, device_id: int = 0, acl_module=None):
        if acl_module is None:
            try:
                acl_module = importlib.import_module("acl")
            except ImportError as exc:
                raise ExecutorError(
                    "the Ascend runtime (pyACL, `import acl`) is not importable: install CANN and source its "
                    "set_env.sh, or serve model.onnx with the onnxruntime executor"
                ) from exc
        self._acl = acl_module
        self._path = str(path)
        self._device_id = int(device_id)
        self._counted = False
        self._device_set = False
        self._context = 0
        self._model_id: int | None = None
        self._desc = 0
        self._in_ds = 0
        self._out_ds = 0
        self._in: list[_Binding] = []
        self._out: list[_Binding] = []
        self._gears: list[int] = []
        self._mbatch_index = -1
        self._closed = False
        try:
            self._open()
        except BaseException:
            self._release(raise_errors=False)
            raise

    # ----------------------------------------------------------------------------------------- setup

    def _open(self) -> None:
        acl = self._acl
        key = id(acl)
        if key not in _INIT_USERS:
            ret = acl.init()
            if ret not in (ACL_SUCCESS, ACL_ERROR_REPEAT_INITIALIZE):
                _check("acl.init", ret)
            _INIT_USERS[key] = [0, ret == ACL_SUCCESS]
        _INIT_USERS[key][0] += 1
        self._counted = True
        _check("acl.rt.set_device", acl.rt.set_device(self._device_id), f"device {self._device_id}")
        self._device_set = True
        self._context, ret = acl.rt.create_context(self._device_id)
        _check("acl.rt.create_context", ret)
        model_id, ret = acl.mdl.load_from_file(self._path)
        _check("acl.mdl.load_from_file", ret, self._path)
        self._model_id = model_id
        self._desc = acl.mdl.create_desc()
        if not self._desc:
            raise AclError("acl.mdl.create_desc", 100000, "returned a null description")
        _check("acl.mdl.get_desc", acl.mdl.get_desc(self._desc, model_id))
        batch, ret = acl.mdl.get_dynamic_batch(self._desc)
        _check("acl.mdl.get_dynamic_batch", ret)
        self._gears = sorted(int(b) for b in batch.get("batch", [])[: batch.get("batchCount", 0)])
        if self._gears:
            self._mbatch_index, ret = acl.mdl.get_input_index_by_name(self._desc, DYNAMIC_BATCH_INPUT)
            _check("acl.mdl.get_input_index_by_name", ret, DYNAMIC_BATCH_INPUT)
        self._in_ds = self._create_dataset()
        self._out_ds = self._create_dataset()
        for i in range(acl.mdl.get_num_inputs(self._desc)):
            self._bind(i, is_input=True)
        for i in range(acl.mdl.get_num_outputs(self._desc)):
            self._bind(i, is_input=False)

    def _create_dataset(self) -> int:
        ds = self._acl.mdl.create_dataset()
        if not ds:
            raise AclError("acl.mdl.create_dataset", 100000, "returned a null dataset")
        return ds

    def _bind(self, index: int, *, is_input: bool) -> _Binding:
        acl, desc = self._acl, self._desc
        side = "input" if is_input else "output"
        size = (acl.mdl.get_input_size_by_index if is_input else acl.mdl.get_output_size_by_index)(
            desc, index
        )
        ptr, ret = acl.rt.malloc(size, ACL_MEM_MALLOC_HUGE_FIRST)
        _check("acl.rt.malloc", ret, f"{size} bytes for {side} {index}")
        binding = _Binding(index, None, ptr, size, 0)
        # Registered before anything else can fail, so close() frees it.
        (self._in if is_input else self._out).append(binding)
        binding.data_buffer = acl.create_data_buffer(ptr, size)
        if not binding.data_buffer:
            raise AclError("acl.create_data_buffer", 100000, "returned a null data buffer")
        _, ret = acl.mdl.add_dataset_buffer(self._in_ds if is_input else self._out_ds, binding.data_buffer)
        _check("acl.mdl.add_dataset_buffer", ret, f"{side} {index}")
        if is_input and index == self._mbatch_index:
            return binding
        name = (acl.mdl.get_input_name_by_index if is_input else acl.mdl.get_output_name_by_index)(
            desc, index
        )
        dims, ret = (acl.mdl.get_input_dims if is_input else acl.mdl.get_output_dims)(desc, index)
        _check(f"acl.mdl.get_{side}_dims", ret, f"{side} {index}")
        acl_type = (acl.mdl.get_input_data_type if is_input else acl.mdl.get_output_data_type)(desc, index)
        try:
            dtype = dtypes.from_acl(acl_type)
        except dtypes.UnsupportedDataType as exc:
            raise ExecutorError(f"{side} {name!r}: {exc}") from None
        shape = tuple(int(d) for d in dims["dims"][: dims.get("dimCount", len(dims["dims"]))])
        if self._gears:
            # Depending on the CANN version the batch dimension reads -1 or the largest gear; either way it is free.
            shape = (-1, *shape[1:])
            row_elems = math.prod(shape[1:])
            binding.row_bytes = row_elems * dtype.numpy.itemsize
            if binding.row_bytes * self._gears[-1] > size:
                raise ExecutorError(
                    f"{side} {name!r}: device size {size} is smaller than the largest gear needs"
                )
        binding.spec = TensorSpec(name, dtype, shape)
        return binding

    # ----------------------------------------------------------------------------------------- interface

    @property
    def inputs(self) -> list[TensorSpec]:
        return [b.spec for b in self._in if b.spec is not None]

    @property
    def outputs(self) -> list[TensorSpec]:
        return [b.spec for b in self._out if b.spec is not None]

    @property
    def max_batch_size(self) -> int:
        return self._gears[-1] if self._gears else 0

    @property
    def batch_gears(self) -> list[int]:
        """Batch sizes the model was compiled for (``--dynamic_batch_size``); [] for a static model."""
        return list(self._gears)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._closed:
            raise ExecutorError("the executor is closed")
        arrays = self._stage(feeds)
        if not self._gears:
            return self._run_static(arrays)
        n = next(iter(arrays.values())).shape[0]
        outs = {}
        for b in self._out:
            dims, ret = self._acl.mdl.get_output_dims(self._desc, b.index)
            _check("acl.mdl.get_output_dims", ret)
            outs[b.spec.name] = np.empty((n, *dims["dims"][1:]), dtype=b.spec.dtype.numpy)
        biggest = self._gears[-1]
        for start in range(0, n, biggest):
            rows = min(biggest, n - start)
            self._run_chunk(arrays, outs, start, rows)
        return outs

    def _stage(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        arrays: dict[str, np.ndarray] = {}
        batch = None
        for spec in self.inputs:
            if spec.name not in feeds:
                raise ExecutorError(f"missing input {spec.name!r}")
            arr = np.asarray(feeds[spec.name])
            if arr.dtype != spec.dtype.numpy:
                raise ExecutorError(
                    f"input {spec.name!r} is {arr.dtype}, the model expects {spec.dtype.numpy}"
                )
            expected = spec.shape
            if len(arr.shape) != len(expected) or any(
                e != -1 and a != e for a, e in zip(arr.shape, expected, strict=False)
            ):
                raise ExecutorError(
                    f"input {spec.name!r} has shape {list(arr.shape)}, expected {list(expected)}"
                )
            if self._gears:
                if batch is None:
                    batch = arr.shape[0]
                elif arr.shape[0] != batch:
                    raise ExecutorError(
                        f"input {spec.name!r} has batch {arr.shape[0]}, other inputs have {batch}"
                    )
            arrays[spec.name] = np.ascontiguousarray(arr)
        unknown = set(feeds) - set(arrays)
        if unknown:
            raise ExecutorError(
                f"unknown input(s) {sorted(unknown)}; the model has {[s.name for s in self.inputs]}"
            )
        if self._gears and batch == 0:
            raise ExecutorError("empty batch")
        return arrays

    def _copy_in(self, binding: _Binding, arr: np.ndarray, nbytes: int) -> None:
        if nbytes > binding.size:
            raise ExecutorError(
                f"input {binding.spec.name!r} needs {nbytes} bytes, the model holds {binding.size}"
            )
        ret = self._acl.rt.memcpy(
            binding.device_ptr, binding.size, arr.ctypes.data, nbytes, ACL_MEMCPY_HOST_TO_DEVICE
        )
        _check("acl.rt.memcpy", ret, f"host->device for {binding.spec.name!r}")

    def _copy_out(self, binding: _Binding, out: np.ndarray, nbytes: int) -> None:
        ret = self._acl.rt.memcpy(
            out.ctypes.data, out.nbytes, binding.device_ptr, nbytes, ACL_MEMCPY_DEVICE_TO_HOST
        )
        _check("acl.rt.memcpy", ret, f"device->host for {binding.spec.name!r}")

    def _execute(self) -> None:
        _check("acl.mdl.execute", self._acl.mdl.execute(self._model_id, self._in_ds, self._out_ds))

    def _current_dims(self, binding: _Binding) -> tuple[int, ...]:
        dims, ret = self._acl.mdl.get_cur_output_dims(self._desc, binding.index)
        _check("acl.mdl.get_cur_output_dims", ret, binding.spec.name)
        return tuple(int(d) for d in dims["dims"][: dims.get("dimCount", len(dims["dims"]))])

    def _run_chunk(self, arrays, outs, start: int, rows: int) -> None:
        gear = next(g for g in self._gears if g >= rows)
        for b in self._in:
            if b.spec is not None:
                # Rows beyond `rows` keep stale data: padded rows are computed and then dropped below.
                self._copy_in(b, arrays[b.spec.name][start : start + rows], rows * b.row_bytes)
        ret = self._acl.mdl.set_dynamic_batch_size(self._model_id, self._in_ds, self._mbatch_index, gear)
        _check("acl.mdl.set_dynamic_batch_size", ret, f"batch {gear}")
        self._execute()
        for b in self._out:
            dims = self._current_dims(b)
            if not dims or dims[0] != gear:
                raise ExecutorError(
                    f"output {b.spec.name!r} came back with dims {list(dims)} for batch {gear}"
                )
            out = outs[b.spec.name]
            if tuple(out.shape[1:]) != dims[1:]:
                raise ExecutorError(
                    f"output {b.spec.name!r} has dims {list(dims)}, expected [{gear}, *{list(out.shape[1:])}]"
                )
            self._copy_out(b, out[start : start + rows], rows * b.row_bytes)

    def _run_static(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for b in self._in:
            arr = arrays[b.spec.name]
            self._copy_in(b, arr, arr.nbytes)
        self._execute()
        outs = {}
        for b in self._out:
            out = np.empty(self._current_dims(b), dtype=b.spec.dtype.numpy)
            if out.nbytes > b.size:
                raise ExecutorError(
                    f"output {b.spec.name!r} dims need {out.nbytes} bytes, device holds {b.size}"
                )
            self._copy_out(b, out, out.nbytes)
            outs[b.spec.name] = out
        return outs

    # ----------------------------------------------------------------------------------------- teardown

    def close(self) -> None:
        if self._closed:
            return
        self._release(raise_errors=True)

    def _release(self, *, raise_errors: bool) -> None:
        """Release in pyACL's documented order; keep going past failures so nothing leaks, then report."""
        acl, errors = self._acl, []
        self._closed = True

        def step(call: str, ret) -> None:
            if ret != ACL_SUCCESS:
                errors.append(AclError(call, ret))

        for b in self._in + self._out:
            if b.data_buffer:
                step("acl.destroy_data_buffer", acl.destroy_data_buffer(b.data_buffer))
                b.data_buffer = 0
        for attr in ("_in_ds", "_out_ds"):
            if getattr(self, attr):
                step("acl.mdl.destroy_dataset", acl.mdl.destroy_dataset(getattr(self, attr)))
                setattr(self, attr, 0)
        if self._model_id is not None:
            step("acl.mdl.unload", acl.mdl.unload(self._model_id))
            self._model_id = None
        if self._desc:
            step("acl.mdl.destroy_desc", acl.mdl.destroy_desc(self._desc))
            self._desc = 0
        for b in self._in + self._out:
            if b.device_ptr:
                step("acl.rt.free", acl.rt.free(b.device_ptr))
                b.device_ptr = 0
        if self._context:
            step("acl.rt.destroy_context", acl.rt.destroy_context(self._context))
            self._context = 0
        if self._device_set:
            step("acl.rt.reset_device", acl.rt.reset_device(self._device_id))
            self._device_set = False
        if self._counted:
            key = id(acl)
            _INIT_USERS[key][0] -= 1
            self._counted = False
            if _INIT_USERS[key][0] == 0:
                _, owned = _INIT_USERS.pop(key)
                if owned:
                    step("acl.finalize", acl.finalize())
        if errors and raise_errors:
            raise errors[0]
