"""Canary test models with the scaler's interface (input [N,4] -> output [N,4] = input * scale) that pass the
platform's checks and smoke test (zeros, and random values in [0, 1)) but misbehave under real traffic."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper


def _model(nodes, initializers) -> bytes:
    graph = helper.make_graph(
        nodes,
        "canary",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", 4])],
        initializer=initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model.SerializeToString()


def flaky_scaler_onnx(scale: float, failure_rate: float = 0.3) -> bytes:
    """Fails ``failure_rate`` of its executions (a Gather out of bounds, drawn by RandomUniform) when an input
    value is above 1 - as the clients' [1, 2, 3, 4] is; never on the smoke test's values in [0, 1)."""
    return _model(
        [
            helper.make_node("Mul", ["input", "s"], ["scaled"]),
            helper.make_node("RandomUniform", [], ["draw"], shape=[1], low=0.0, high=1.0),
            helper.make_node("Add", ["draw", "rate"], ["shifted"]),
            helper.make_node("Floor", ["shifted"], ["unlucky"]),
            helper.make_node("ReduceMax", ["input"], ["peak"], keepdims=0),
            helper.make_node("Greater", ["peak", "one"], ["armed"]),
            helper.make_node("Cast", ["armed"], ["armed_f"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["unlucky", "armed_f"], ["index_f"]),
            helper.make_node("Cast", ["index_f"], ["index"], to=TensorProto.INT64),
            helper.make_node("Gather", ["zero", "index"], ["nothing"]),  # out of bounds when index is 1
            helper.make_node("Add", ["scaled", "nothing"], ["output"]),
        ],
        [
            helper.make_tensor("s", TensorProto.FLOAT, [1], [scale]),
            helper.make_tensor("rate", TensorProto.FLOAT, [1], [failure_rate]),
            helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
            helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]),
        ],
    )


def slow_scaler_onnx(scale: float, size: int = 512, rounds: int = 3) -> bytes:
    """Correct outputs, but ``rounds`` [size x size] matrix products per execution that depend on the input (so
    onnxruntime cannot fold them away): tens of milliseconds where the plain scaler takes well under one."""
    weights = np.random.default_rng(3).random((size, size), dtype=np.float32) / size
    nodes = [
        helper.make_node("Mul", ["input", "s"], ["scaled"]),
        helper.make_node("ReduceMax", ["input"], ["peak"], keepdims=0),
        helper.make_node("Mul", ["w", "peak"], ["m0"]),
    ]
    for i in range(rounds):
        nodes.append(helper.make_node("MatMul", [f"m{i}", "w"], [f"m{i + 1}"]))
    nodes += [
        helper.make_node("ReduceMean", [f"m{rounds}"], ["mean"], keepdims=0),
        helper.make_node("Mul", ["mean", "nil"], ["nothing"]),
        helper.make_node("Add", ["scaled", "nothing"], ["output"]),
    ]
    return _model(
        nodes,
        [
            helper.make_tensor("s", TensorProto.FLOAT, [1], [scale]),
            helper.make_tensor("w", TensorProto.FLOAT, weights.shape, weights.flatten().tolist()),
            helper.make_tensor("nil", TensorProto.FLOAT, [], [0.0]),
        ],
    )
