"""Small real models and the rows tests build around them: the classifier of seed example 3 (input
[N,3,224,224] -> output [N,1000]) small enough to load in a moment, the scaler the gateway tests call
thousands of times, and READY versions/instances as rows for tests that need no tritonserver."""

from __future__ import annotations

import json

import numpy as np
from onnx import TensorProto, helper

from apps.deployments.models import Deployment, DeploymentInstance, DeploymentState, PlacementState
from apps.fleet.models import Host, InstanceState, TritonInstance
from apps.registry.models import ModelVersion, RegisteredModel, VersionState

CLASSIFIER_SIGNATURE = {
    "inputs": [{"name": "input", "dtype": "FP32", "dims": [3, 224, 224], "format": "NCHW"}],
    "outputs": [{"name": "output", "dtype": "FP32", "dims": [1000], "format": ""}],
    "batched": True,
}


def classifier_onnx(scale: float) -> bytes:
    """Seed example 3's interface (input [N,3,224,224] -> output [N,1000]) in a model small enough to load in
    a moment; ``scale`` makes versions distinguishable by their outputs."""
    weights = (np.arange(3 * 1000, dtype=np.float32).reshape(3, 1000) / 3000.0) * scale
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["input", "axes"], ["pooled"], keepdims=0),
            helper.make_node("MatMul", ["pooled", "w"], ["output"]),
        ],
        "classifier",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 224, 224])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", 1000])],
        initializer=[
            helper.make_tensor("axes", TensorProto.INT64, [2], [2, 3]),
            helper.make_tensor("w", TensorProto.FLOAT, weights.shape, weights.flatten().tolist()),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model.SerializeToString()


def expected_output(scale: float, batch: np.ndarray) -> np.ndarray:
    weights = (np.arange(3 * 1000, dtype=np.float32).reshape(3, 1000) / 3000.0) * scale
    return batch.mean(axis=(2, 3)) @ weights


def scaler_onnx(scale: float) -> bytes:
    """input [N,4] -> output [N,4] = input * scale: versions are told apart by their outputs."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["input", "s"], ["output"])],
        "scaler",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", 4])],
        initializer=[helper.make_tensor("s", TensorProto.FLOAT, [1], [scale])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model.SerializeToString()


def wide_scaler_onnx(width: int, scale: float = 2.0) -> bytes:
    """input [N,width] -> output = input * scale: large tensors (a row of 262,144 floats is 1 MiB)."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["input", "s"], ["output"])],
        "wide_scaler",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", width])],
        initializer=[helper.make_tensor("s", TensorProto.FLOAT, [1], [scale])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model.SerializeToString()


INFER_BODY = json.dumps(
    {"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [1.0, 2.0, 3.0, 4.0]}]}
).encode()


def output_of(answer: dict) -> list[float]:
    return np.array(answer["outputs"][0]["data"]).tolist()


def add_instance(host: Host, name: str = "cpu-0", port: int = 18100) -> TritonInstance:
    """A READY instance row (no tritonserver behind it)."""
    return TritonInstance.objects.create(
        host=host,
        name=name,
        http_port=port,
        grpc_port=port + 1,
        metrics_port=port + 2,
        state=InstanceState.READY,
    )


def make_version(model: RegisteredModel, number: int = 1, state: str = VersionState.READY) -> ModelVersion:
    """A version row with the classifier's signature and no files."""
    return ModelVersion.objects.create(
        model=model, number=number, state=state, signature=CLASSIFIER_SIGNATURE, config_text=""
    )


def serving_rows(team, owner, slug: str, instance: TritonInstance) -> Deployment:
    """A SERVING deployment of a new model ``slug`` on ``instance``, as rows (its placement READY)."""
    model = RegisteredModel.objects.create(team=team, name=slug, slug=slug, created_by=owner)
    version = make_version(model, 1)
    deployment = Deployment.objects.create(
        team=team, model=model, active_version=version, state=DeploymentState.SERVING, created_by=owner
    )
    DeploymentInstance.objects.create(
        deployment=deployment, instance=instance, served_version=version, state=PlacementState.READY
    )
    return deployment
