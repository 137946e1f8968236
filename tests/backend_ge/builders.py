"""Small ONNX models and the data types the backend serves, shared by backend tests."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

DTYPES = [("FP32", TensorProto.FLOAT), ("FP16", TensorProto.FLOAT16), ("INT8", TensorProto.INT8),
          ("UINT8", TensorProto.UINT8), ("INT32", TensorProto.INT32), ("INT64", TensorProto.INT64),
          ("BOOL", TensorProto.BOOL)]  # fmt: skip


def mlp_model():
    """x[N,4] float -> y = relu(x @ W + b) [N,3], plus ids[N,2] int32 -> ids * 2 as a second output."""
    rng = np.random.default_rng(0)
    w = helper.make_tensor(
        "w", TensorProto.FLOAT, [4, 3], rng.standard_normal((4, 3)).astype(np.float32).ravel()
    )
    b = helper.make_tensor("b", TensorProto.FLOAT, [3], rng.standard_normal(3).astype(np.float32))
    two = helper.make_tensor("two", TensorProto.INT32, [1], [2])
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["xw"]),
        helper.make_node("Add", ["xw", "b"], ["pre"]),
        helper.make_node("Relu", ["pre"], ["y"]),
        helper.make_node("Mul", ["ids", "two"], ["ids2"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
            helper.make_tensor_value_info("ids", TensorProto.INT32, ["N", 2]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3]),
            helper.make_tensor_value_info("ids2", TensorProto.INT32, ["N", 2]),
        ],
        [w, b, two],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
