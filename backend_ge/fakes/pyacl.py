"""FAKE pyACL: a faithful stand-in for pyACL (``import acl``) for machines without an NPU (tests and
``npu-check --fake``). It never touches a device and never runs on a real host's serving path.

It keeps pyACL's Python signatures (``(value, ret)`` tuples where pyACL returns them, bare ``ret`` elsewhere),
its return codes, and its rules: nothing works before ``init``, device memory needs a current context
(set_device/create_context), a model must be loaded before its description, datasets or execute are used.
Device memory is real host memory (ctypes buffers) so ``rt.memcpy`` moves real bytes, and every resource is
counted so tests can assert balanced malloc/free and create/destroy.

The "om" file: real ``.om`` files only come out of ATC, which cannot run here. A fake om is the ONNX model's
bytes in ``<name>.om`` plus a JSON sidecar ``<name>.om.json`` holding ``{"dynamic_batch": [gears]}`` (written by
:func:`write_fake_om`). With gears, the model looks like an ATC ``--dynamic_batch_size`` build: every tensor's
first dimension is the batch, sizes are those of the largest gear, and an extra last input named
``ascend_mbatch_shape_data`` carries the chosen batch. The math runs in onnxruntime.
"""

from __future__ import annotations

import ctypes
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort

from backend_ge import dtypes

if TYPE_CHECKING:  # the stubs' runtime tree has onnxruntime but not onnx
    import onnx

ACL_SUCCESS = 0
ACL_ERROR_INVALID_PARAM = 100000
ACL_ERROR_UNINITIALIZE = 100001
ACL_ERROR_REPEAT_INITIALIZE = 100002
ACL_ERROR_INVALID_FILE = 100003
ACL_ERROR_INVALID_MODEL_ID = 100011
ACL_ERROR_PARSE_MODEL = 100013
ACL_ERROR_MODEL_INPUT_NOT_MATCH = 100017
ACL_ERROR_MODEL_OUTPUT_NOT_MATCH = 100018
ACL_ERROR_MODEL_NOT_DYNAMIC = 100019
ACL_ERROR_REPEAT_FINALIZE = 100037
ACL_ERROR_RT_PARAM_INVALID = 107000
ACL_ERROR_RT_INVALID_DEVICEID = 107001
ACL_ERROR_RT_CONTEXT_NULL = 107002
ACL_ERROR_RT_MEMORY_ALLOCATION = 207001

MBATCH = "ascend_mbatch_shape_data"
MBATCH_BYTES = 8  # one uint64 batch value
MEMCPY_HOST_TO_DEVICE, MEMCPY_DEVICE_TO_HOST = 1, 2


def write_fake_om(model: onnx.ModelProto, path: str | Path, gears: list[int] | None = None) -> Path:
    """Write a fake ``.om`` (ONNX bytes) and its sidecar; ``gears`` makes it a dynamic-batch model."""
    path = Path(path)
    path.write_bytes(model.SerializeToString())
    Path(str(path) + ".json").write_text(json.dumps({"dynamic_batch": sorted(gears or [])}))
    return path


class _Model:
    def __init__(self, path: Path):
        meta = json.loads(Path(str(path) + ".json").read_text())
        self.gears: list[int] = meta["dynamic_batch"]
        self.session = ort.InferenceSession(path.read_bytes(), providers=["CPUExecutionProvider"])
        self.inputs = [self._tensor(t) for t in self.session.get_inputs()]
        self.outputs = [self._tensor(t) for t in self.session.get_outputs()]
        if self.gears:
            self.inputs.append(
                {"name": MBATCH, "shape": [1], "dtype": dtypes.from_numpy(np.uint8), "size": 8}
            )

    def _tensor(self, t) -> dict:
        dt = dtypes.from_numpy(_ORT_TYPES[t.type])
        shape = [d if isinstance(d, int) and d > 0 else -1 for d in t.shape]
        if self.gears:
            shape[0] = -1
        concrete = [self.gears[-1] if d == -1 else d for d in shape]
        return {"name": t.name, "shape": shape, "dtype": dt, "size": math.prod(concrete) * dt.numpy.itemsize}


_ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(int32)": np.int32,
    "tensor(int64)": np.int64,
    "tensor(bool)": np.bool_,
}


class FakeAcl:
    """One fake pyACL runtime. Attributes mirror the module: ``init``, ``rt.*``, ``mdl.*``, ``util.*``."""

    def __init__(self, device_count: int = 1, device_memory: int = 1 << 30):
        self.device_count = device_count
        self.device_memory = device_memory
        self.calls: list[str] = []
        self.inject: dict[str, int] = {}  # call name -> return code to answer once instead of running it
        self.executed_batches: list[int] = []
        self.malloc_count = 0
        self.initialized = False
        self.finalized = False
        self.current_device: int | None = None
        self.devices_set: dict[int, int] = {}
        self.contexts: set[int] = set()
        self.allocations: dict[int, ctypes.Array] = {}
        self.models: dict[int, _Model] = {}
        self.descs: dict[int, int | None] = {}
        self.datasets: dict[int, list[int]] = {}
        self.dataset_batch: dict[int, int] = {}
        self.data_buffers: dict[int, tuple[int, int]] = {}
        self.cur_dims: dict[tuple[int, int], list[int]] = {}
        self._next = 0x1000
        self._next_model = 0
        self.rt = SimpleNamespace(
            set_device=self._wrap("rt.set_device", self._set_device),
            reset_device=self._wrap("rt.reset_device", self._reset_device),
            create_context=self._wrap("rt.create_context", self._create_context, pair=True),
            destroy_context=self._wrap("rt.destroy_context", self._destroy_context),
            malloc=self._wrap("rt.malloc", self._malloc, pair=True),
            free=self._wrap("rt.free", self._free),
            memcpy=self._wrap("rt.memcpy", self._memcpy),
        )
        self.mdl = SimpleNamespace(
            load_from_file=self._wrap("mdl.load_from_file", self._load, pair=True),
            unload=self._wrap("mdl.unload", self._unload),
            create_desc=self._wrap("mdl.create_desc", self._create_desc, value=True),
            destroy_desc=self._wrap("mdl.destroy_desc", self._destroy_desc),
            get_desc=self._wrap("mdl.get_desc", self._get_desc),
            get_num_inputs=self._wrap("mdl.get_num_inputs", lambda d: len(self._io(d, True)), value=True),
            get_num_outputs=self._wrap("mdl.get_num_outputs", lambda d: len(self._io(d, False)), value=True),
            get_input_size_by_index=self._wrap(
                "mdl.get_input_size_by_index", lambda d, i: self._io(d, True)[i]["size"], value=True
            ),
            get_output_size_by_index=self._wrap(
                "mdl.get_output_size_by_index", lambda d, i: self._io(d, False)[i]["size"], value=True
            ),
            get_input_name_by_index=self._wrap(
                "mdl.get_input_name_by_index", lambda d, i: self._io(d, True)[i]["name"], value=True
            ),
            get_output_name_by_index=self._wrap(
                "mdl.get_output_name_by_index", lambda d, i: self._io(d, False)[i]["name"], value=True
            ),
            get_input_data_type=self._wrap(
                "mdl.get_input_data_type", lambda d, i: self._io(d, True)[i]["dtype"].acl, value=True
            ),
            get_output_data_type=self._wrap(
                "mdl.get_output_data_type", lambda d, i: self._io(d, False)[i]["dtype"].acl, value=True
            ),
            get_input_dims=self._wrap(
                "mdl.get_input_dims", lambda d, i: self._dims(self._io(d, True)[i]), pair=True
            ),
            get_output_dims=self._wrap(
                "mdl.get_output_dims", lambda d, i: self._dims(self._io(d, False)[i], True), pair=True
            ),
            get_cur_output_dims=self._wrap("mdl.get_cur_output_dims", self._cur_output_dims, pair=True),
            get_input_index_by_name=self._wrap("mdl.get_input_index_by_name", self._index_by_name, pair=True),
            get_dynamic_batch=self._wrap("mdl.get_dynamic_batch", self._dynamic_batch, pair=True),
            create_dataset=self._wrap("mdl.create_dataset", self._create_dataset, value=True),
            destroy_dataset=self._wrap("mdl.destroy_dataset", self._destroy_dataset),
            add_dataset_buffer=self._wrap("mdl.add_dataset_buffer", self._add_dataset_buffer, pair=True),
            set_dynamic_batch_size=self._wrap("mdl.set_dynamic_batch_size", self._set_dynamic_batch_size),
            execute=self._wrap("mdl.execute", self._execute),
        )
        self.util = SimpleNamespace()
        self.init = self._wrap("init", self._init, needs_init=False)
        self.finalize = self._wrap("finalize", self._finalize, needs_init=False)
        self.create_data_buffer = self._wrap("create_data_buffer", self._create_data_buffer, value=True)
        self.destroy_data_buffer = self._wrap("destroy_data_buffer", self._destroy_data_buffer)

    # ------------------------------------------------------------------------------------- plumbing

    class _Fail(Exception):
        def __init__(self, code: int):
            self.code = code

    def _wrap(self, name: str, fn, *, pair: bool = False, value: bool = False, needs_init: bool = True):
        """pyACL calling convention: ``pair`` -> (value, ret); ``value`` -> bare value (0/None on failure)."""

        def call(*args):
            self.calls.append(name)
            code = self.inject.pop(name, None)
            if code is None and needs_init and not self.initialized:
                code = ACL_ERROR_UNINITIALIZE
            if code is None:
                try:
                    result = fn(*args)
                except FakeAcl._Fail as f:
                    code = f.code
                else:
                    return (result, ACL_SUCCESS) if pair else result if value else ACL_SUCCESS
            return (0, code) if pair else 0 if value else code

        return call

    def _handle(self) -> int:
        self._next += 0x100
        return self._next

    def _need_context(self) -> None:
        if self.current_device is None:
            raise FakeAcl._Fail(ACL_ERROR_RT_CONTEXT_NULL)

    def leaks(self) -> dict[str, int]:
        """Live resources; all zero after a clean teardown."""
        return {
            "allocations": len(self.allocations),
            "models": len(self.models),
            "descs": len(self.descs),
            "datasets": len(self.datasets),
            "data_buffers": len(self.data_buffers),
            "contexts": len(self.contexts),
            "devices": sum(self.devices_set.values()),
            "initialized": int(self.initialized),
        }

    # ------------------------------------------------------------------------------------- runtime

    def _init(self) -> None:
        if self.initialized:
            raise FakeAcl._Fail(ACL_ERROR_REPEAT_INITIALIZE)
        self.initialized, self.finalized = True, False

    def _finalize(self) -> None:
        if not self.initialized:
            raise FakeAcl._Fail(ACL_ERROR_REPEAT_FINALIZE if self.finalized else ACL_ERROR_UNINITIALIZE)
        self.initialized, self.finalized = False, True

    def _set_device(self, dev: int) -> None:
        if not 0 <= dev < self.device_count:
            raise FakeAcl._Fail(ACL_ERROR_RT_INVALID_DEVICEID)
        self.devices_set[dev] = self.devices_set.get(dev, 0) + 1
        self.current_device = dev

    def _reset_device(self, dev: int) -> None:
        if not self.devices_set.get(dev):
            raise FakeAcl._Fail(ACL_ERROR_RT_INVALID_DEVICEID)
        self.devices_set[dev] -= 1
        if not self.devices_set[dev] and self.current_device == dev:
            self.current_device = None

    def _create_context(self, dev: int) -> int:
        if not 0 <= dev < self.device_count:
            raise FakeAcl._Fail(ACL_ERROR_RT_INVALID_DEVICEID)
        ctx = self._handle()
        self.contexts.add(ctx)
        self.current_device = dev
        return ctx

    def _destroy_context(self, ctx: int) -> None:
        if ctx not in self.contexts:
            raise FakeAcl._Fail(ACL_ERROR_RT_PARAM_INVALID)
        self.contexts.discard(ctx)

    def _malloc(self, size: int, policy: int) -> int:
        self._need_context()
        if size <= 0:
            raise FakeAcl._Fail(ACL_ERROR_INVALID_PARAM)
        if sum(len(b) for b in self.allocations.values()) + size > self.device_memory:
            raise FakeAcl._Fail(ACL_ERROR_RT_MEMORY_ALLOCATION)
        buf = ctypes.create_string_buffer(size)
        self.allocations[ctypes.addressof(buf)] = buf
        self.malloc_count += 1
        return ctypes.addressof(buf)

    def _free(self, ptr: int) -> None:
        if self.allocations.pop(ptr, None) is None:
            raise FakeAcl._Fail(ACL_ERROR_RT_PARAM_INVALID)

    def _device_range(self, ptr: int, count: int) -> None:
        for base, buf in self.allocations.items():
            if base <= ptr and ptr + count <= base + len(buf):
                return
        raise FakeAcl._Fail(ACL_ERROR_INVALID_PARAM)

    def _memcpy(self, dst: int, dst_max: int, src: int, count: int, kind: int) -> None:
        self._need_context()
        if count > dst_max or count < 0:
            raise FakeAcl._Fail(ACL_ERROR_INVALID_PARAM)
        if kind == MEMCPY_HOST_TO_DEVICE:
            self._device_range(dst, count)
        elif kind == MEMCPY_DEVICE_TO_HOST:
            self._device_range(src, count)
        else:
            raise FakeAcl._Fail(ACL_ERROR_INVALID_PARAM)
        ctypes.memmove(dst, src, count)

    # ------------------------------------------------------------------------------------- models

    def _load(self, path: str) -> int:
        self._need_context()
        p = Path(path)
        if not p.is_file() or not Path(str(p) + ".json").is_file():
            raise FakeAcl._Fail(ACL_ERROR_INVALID_FILE)
        try:
            model = _Model(p)
        except Exception:
            raise FakeAcl._Fail(ACL_ERROR_PARSE_MODEL) from None
        self._next_model += 1
        model_id = self._next_model
        self.models[model_id] = model
        return model_id

    def _unload(self, model_id: int) -> None:
        if self.models.pop(model_id, None) is None:
            raise FakeAcl._Fail(ACL_ERROR_INVALID_MODEL_ID)

    def _create_desc(self) -> int:
        h = self._handle()
        self.descs[h] = None
        return h

    def _destroy_desc(self, desc: int) -> None:
        if self.descs.pop(desc, "missing") == "missing":
            raise FakeAcl._Fail(ACL_ERROR_INVALID_PARAM)

    def _get_desc(self, desc: int, model_id: int) -> None:
        if desc not in self.descs:
            raise FakeAcl._Fail(ACL_ERROR_INVALID_PARAM)
        if model_id not in self.models:
            raise FakeAcl._Fail(ACL_ERROR_INVALID_MODEL_ID)
        self.descs[desc] = model_id

    def _model_of(self, desc: int) -> _Model:
        model_id = self.descs.get(desc)
        if model_id is None or model_id not in self.models:
            raise FakeAcl._Fail(ACL_ERROR_INVALID_PARAM)
        return self.models[model_id]

    def _io(self, desc: int, inputs: bool) -> list[dict]:
        m = self._model_of(desc)
        return m.inputs if inputs else m.outputs

    def _dims(self, t: dict, largest: bool = False) -> dict:
        dims = list(t["shape"])
        if largest and dims and dims[0] == -1:  # output dims report the largest gear
            dims[0] = max(self._gears_of_tensor(t), default=1)
        return {"name": t["name"], "dimCount": len(dims), "dims": dims}

    def _gears_of_tensor(self, t: dict) -> list[int]:
        for m in self.models.values():
            if t in m.outputs or t in m.inputs:
                return m.gears
        return []

    def _cur_output_dims(self, desc: int, index: int) -> dict:
        out = self._io(desc, False)[index]
        dims = self.cur_dims.get((self.descs[desc], index))
        return {"name": out["name"], "dimCount": len(dims), "dims": dims} if dims else self._dims(out, True)

    def _index_by_name(self, desc: int, name: str) -> int:
        for i, t in enumerate(self._io(desc, True)):
            if t["name"] == name:
                return i
        raise FakeAcl._Fail(ACL_ERROR_INVALID_PARAM)

    def _dynamic_batch(self, desc: int) -> dict:
        gears = self._model_of(desc).gears
        return {"batchCount": len(gears), "batch": list(gears)}

    # ------------------------------------------------------------------------------------- datasets

    def _create_dataset(self) -> int:
        h = self._handle()
        self.datasets[h] = []
        return h

    def _destroy_dataset(self, ds: int) -> None:
        if self.datasets.pop(ds, None) is None:
            raise FakeAcl._Fail(ACL_ERROR_INVALID_PARAM)
        self.dataset_batch.pop(ds, None)

    def _create_data_buffer(self, ptr: int, size: int) -> int:
        h = self._handle()
        self.data_buffers[h] = (ptr, size)
        return h

    def _destroy_data_buffer(self, db: int) -> None:
        if self.data_buffers.pop(db, None) is None:
            raise FakeAcl._Fail(ACL_ERROR_INVALID_PARAM)

    def _add_dataset_buffer(self, ds: int, db: int) -> int:
        if ds not in self.datasets or db not in self.data_buffers:
            raise FakeAcl._Fail(ACL_ERROR_INVALID_PARAM)
        self.datasets[ds].append(db)
        return ds

    def _set_dynamic_batch_size(self, model_id: int, ds: int, index: int, batch: int) -> None:
        model = self.models.get(model_id)
        if model is None:
            raise FakeAcl._Fail(ACL_ERROR_INVALID_MODEL_ID)
        if not model.gears:
            raise FakeAcl._Fail(ACL_ERROR_MODEL_NOT_DYNAMIC)
        if ds not in self.datasets or index != len(model.inputs) - 1 or len(self.datasets[ds]) <= index:
            raise FakeAcl._Fail(ACL_ERROR_INVALID_PARAM)
        if batch not in model.gears:
            raise FakeAcl._Fail(ACL_ERROR_INVALID_PARAM)
        ptr, size = self.data_buffers[self.datasets[ds][index]]
        self._device_range(ptr, MBATCH_BYTES)
        ctypes.memmove(ptr, ctypes.c_uint64(batch).value.to_bytes(8, "little"), MBATCH_BYTES)
        self.dataset_batch[ds] = batch

    def _execute(self, model_id: int, in_ds: int, out_ds: int) -> None:
        self._need_context()
        model = self.models.get(model_id)
        if model is None:
            raise FakeAcl._Fail(ACL_ERROR_INVALID_MODEL_ID)
        if in_ds not in self.datasets or len(self.datasets[in_ds]) != len(model.inputs):
            raise FakeAcl._Fail(ACL_ERROR_MODEL_INPUT_NOT_MATCH)
        if out_ds not in self.datasets or len(self.datasets[out_ds]) != len(model.outputs):
            raise FakeAcl._Fail(ACL_ERROR_MODEL_OUTPUT_NOT_MATCH)
        # Without set_dynamic_batch_size the buffers hold the largest gear, as their sizes say.
        batch = self.dataset_batch.get(in_ds, model.gears[-1] if model.gears else None)
        feeds = {}
        for t, db in zip(model.inputs, self.datasets[in_ds], strict=True):
            if t["name"] == MBATCH:
                continue
            ptr, size = self.data_buffers[db]
            shape = [batch if d == -1 else d for d in t["shape"]]
            nbytes = math.prod(shape) * t["dtype"].numpy.itemsize
            if nbytes > size:
                raise FakeAcl._Fail(ACL_ERROR_MODEL_INPUT_NOT_MATCH)
            feeds[t["name"]] = np.frombuffer(ctypes.string_at(ptr, nbytes), dtype=t["dtype"].numpy).reshape(
                shape
            )
        results = model.session.run(None, feeds)
        for j, (t, db, value) in enumerate(zip(model.outputs, self.datasets[out_ds], results, strict=True)):
            ptr, size = self.data_buffers[db]
            value = np.ascontiguousarray(value, dtype=t["dtype"].numpy)
            if value.nbytes > size:
                raise FakeAcl._Fail(ACL_ERROR_MODEL_OUTPUT_NOT_MATCH)
            self._device_range(ptr, value.nbytes)
            ctypes.memmove(ptr, value.ctypes.data, value.nbytes)
            self.cur_dims[(model_id, j)] = list(value.shape)
        if batch is not None:
            self.executed_batches.append(batch)
