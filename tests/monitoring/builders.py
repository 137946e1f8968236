"""A model whose failures Triton counts: the GE backend fails a request the model cannot compute.

Triton 2.51 rejects malformed requests (wrong shape for static dims, wrong data type, batch too large) in
its frontend with a 400 and counts them nowhere - neither ``nv_inference_request_failure`` nor the
statistics API's ``fail`` (checked against a real server: see fixtures/capture.py). Failures that reach
the model do count. This model declares ``input`` as ``[N, L]`` with ``L`` dynamic, so Triton passes any
``L``, but it reshapes the input to ``[N, 1]``: ``L == 1`` computes, any other ``L`` fails in onnxruntime
and the backend answers with an error, counted as reason ``BACKEND``.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper


def reshaping_onnx() -> bytes:
    graph = helper.make_graph(
        [
            helper.make_node("Reshape", ["input", "shape"], ["column"]),
            helper.make_node("MatMul", ["column", "w"], ["output"]),
        ],
        "reshaper",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", "L"])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", 4])],
        initializer=[
            helper.make_tensor("shape", TensorProto.INT64, [2], [0, 1]),
            helper.make_tensor("w", TensorProto.FLOAT, [1, 4], np.arange(4, dtype=np.float32).tolist()),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model.SerializeToString()


def infer_body(width: int) -> dict:
    """A KServe v2 JSON request: ``width`` 1 succeeds, anything else fails in the backend."""
    return {"inputs": [{"name": "input", "shape": [1, width], "datatype": "FP32", "data": [0.5] * width}]}


def reshaper_version(model, owner, tmp_path):
    """The model's next version, READY: the reshaping ONNX model prepared for the CPU executor."""
    from tests.factories import ready_onnx_version

    return ready_onnx_version(model, reshaping_onnx(), tmp_path, created_by=owner)


HOSTILE = '</pre><script>alert("x")</script><img src=x onerror=alert(1)>'


def signature(dims, dtype="FP32", extra=False) -> dict:
    outputs = [{"name": "output", "dtype": "FP32", "dims": [10], "format": ""}]
    if extra:
        outputs.append({"name": "scores", "dtype": "FP16", "dims": [10], "format": ""})
    return {
        "inputs": [{"name": "input", "dtype": dtype, "dims": dims, "format": ""}],
        "outputs": outputs,
        "batched": True,
    }
