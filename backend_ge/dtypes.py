"""The data types the GE backend serves, in every naming the project meets.

One row per type: Triton's config enum name (``TYPE_FP32``), the KServe v2 wire name (``FP32``),
numpy, the ONNX TensorProto enum and pyACL's ``aclDataType`` value. Anything not in this table is
rejected with a clear error instead of being guessed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DType:
    config_name: str  # model_config.proto DataType name, e.g. TYPE_FP32
    wire_name: str  # KServe v2 / tritonclient datatype, e.g. FP32
    numpy: np.dtype
    onnx: int  # onnx.TensorProto.DataType value
    acl: int  # aclDataType value (acl/acl_base.h)


SUPPORTED: tuple[DType, ...] = (
    DType("TYPE_FP32", "FP32", np.dtype(np.float32), 1, 0),
    DType("TYPE_FP16", "FP16", np.dtype(np.float16), 10, 1),
    DType("TYPE_INT8", "INT8", np.dtype(np.int8), 3, 2),
    DType("TYPE_INT32", "INT32", np.dtype(np.int32), 6, 3),
    DType("TYPE_UINT8", "UINT8", np.dtype(np.uint8), 2, 4),
    DType("TYPE_INT64", "INT64", np.dtype(np.int64), 7, 9),
    DType("TYPE_BOOL", "BOOL", np.dtype(np.bool_), 9, 12),
)

_BY_CONFIG = {d.config_name: d for d in SUPPORTED}
_BY_WIRE = {d.wire_name: d for d in SUPPORTED}
_BY_NUMPY = {d.numpy: d for d in SUPPORTED}
_BY_ONNX = {d.onnx: d for d in SUPPORTED}
_BY_ACL = {d.acl: d for d in SUPPORTED}

SUPPORTED_NAMES = ", ".join(d.wire_name for d in SUPPORTED)


class UnsupportedDataType(ValueError):
    """A data type the GE backend does not serve."""


def _lookup(table: dict, key, what: str) -> DType:
    try:
        return table[key]
    except (KeyError, TypeError):
        raise UnsupportedDataType(
            f"data type {key!r} ({what}) is not supported by the GE backend; supported: {SUPPORTED_NAMES}"
        ) from None


def from_config(name: str) -> DType:
    """``TYPE_FP32`` (also accepts ``FP32``) -> DType."""
    if not name.startswith("TYPE_"):
        name = "TYPE_" + name
    return _lookup(_BY_CONFIG, name, "model config")


def from_wire(name: str) -> DType:
    return _lookup(_BY_WIRE, name, "request datatype")


def from_numpy(dtype) -> DType:
    return _lookup(_BY_NUMPY, np.dtype(dtype), "numpy")


def from_onnx(elem_type: int) -> DType:
    return _lookup(_BY_ONNX, elem_type, "ONNX element type")


def from_acl(value: int) -> DType:
    return _lookup(_BY_ACL, value, "aclDataType")
