"""The onnxruntime executor and the executor factory, without Triton."""

from __future__ import annotations

import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from backend_ge import dtypes
from backend_ge.examples import build_mlp
from backend_ge.executors import ExecutorError, choose_executor, create_executor, select_device
from backend_ge.executors.onnxruntime import UNBOUNDED_BATCH, OnnxRuntimeExecutor
from backend_ge.serving import ConfigMismatch, check_config, complete_config, instance_index


def _identity_model(elem: int, batch_dim) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "identity",
        [helper.make_tensor_value_info("x", elem, [batch_dim, 3])],
        [helper.make_tensor_value_info("y", elem, [batch_dim, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.fixture(scope="module")
def mlp_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("mlp") / "model.onnx"
    onnx.save_model(build_mlp(), path)
    return path


def test_specs_come_from_the_session(mlp_path):
    with OnnxRuntimeExecutor(mlp_path) as executor:
        assert [(s.name, s.dtype.wire_name, s.shape) for s in executor.inputs] == [
            ("input", "FP32", (-1, 256))
        ]
        assert [(s.name, s.dtype.wire_name, s.shape) for s in executor.outputs] == [
            ("output", "FP32", (-1, 16))
        ]
        assert executor.max_batch_size == UNBOUNDED_BATCH


def test_run_equals_a_plain_onnxruntime_session(mlp_path):
    x = np.random.default_rng(0).standard_normal((5, 256)).astype(np.float32)
    expected = ort.InferenceSession(str(mlp_path), providers=["CPUExecutionProvider"]).run(
        None, {"input": x}
    )[0]
    with OnnxRuntimeExecutor(mlp_path, intra_op_threads=1) as executor:
        np.testing.assert_array_equal(executor.run({"input": x})["output"], expected)


def _two_output_model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["same"]), helper.make_node("Neg", ["x"], ["negated"])],
        "two_outputs",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
        [
            helper.make_tensor_value_info("same", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("negated", TensorProto.FLOAT, ["batch", 3]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_runner_returns_the_outputs_asked_for_in_that_order(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save_model(_two_output_model(), path)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    with OnnxRuntimeExecutor(path) as executor:
        negated, same = executor.runner(["negated", "same"])({"x": x})
        (only,) = executor.runner(["same"])({"x": x})
    np.testing.assert_array_equal(negated, -x)
    np.testing.assert_array_equal(same, x)
    np.testing.assert_array_equal(only, x)


def test_runner_refuses_an_output_the_model_does_not_have(mlp_path):
    with (
        OnnxRuntimeExecutor(mlp_path) as executor,
        pytest.raises(ExecutorError, match=r"unknown output\(s\) \['logits'\]"),
    ):
        executor.runner(["logits"])


def test_runner_failures_and_closed_sessions_are_executor_errors(mlp_path):
    executor = OnnxRuntimeExecutor(mlp_path)
    run = executor.runner(["output"])
    with pytest.raises(ExecutorError, match="onnxruntime run failed"):
        run({"input": np.zeros((1, 7), np.float32)})  # wrong width: onnxruntime itself refuses it
    executor.close()
    with pytest.raises(ExecutorError, match="closed"):
        run({"input": np.zeros((1, 256), np.float32)})


def test_intra_op_threads_reach_the_session(mlp_path):
    executor = OnnxRuntimeExecutor(mlp_path, intra_op_threads=1)
    assert executor._session.get_session_options().intra_op_num_threads == 1


def test_fixed_batch_dimension_means_no_batching(tmp_path):
    onnx.save_model(_identity_model(TensorProto.FLOAT, 2), tmp_path / "m.onnx")
    assert OnnxRuntimeExecutor(tmp_path / "m.onnx").max_batch_size == 0


def test_unsupported_type_is_rejected_with_the_supported_list(tmp_path):
    onnx.save_model(_identity_model(TensorProto.DOUBLE, "N"), tmp_path / "m.onnx")
    with pytest.raises(dtypes.UnsupportedDataType, match=r"tensor\(double\).*supported: FP32, FP16"):
        OnnxRuntimeExecutor(tmp_path / "m.onnx")


def test_unreadable_model_is_an_executor_error(tmp_path):
    (tmp_path / "model.onnx").write_bytes(b"not an onnx model")
    with pytest.raises(ExecutorError, match="could not load"):
        OnnxRuntimeExecutor(tmp_path / "model.onnx")


def test_run_after_close_fails_clearly(mlp_path):
    executor = OnnxRuntimeExecutor(mlp_path)
    executor.close()
    executor.close()
    with pytest.raises(ExecutorError, match="closed"):
        executor.run({"input": np.zeros((1, 256), np.float32)})


# -- factory -----------------------------------------------------------------------------------------------


@pytest.fixture
def version_dir(tmp_path):
    return tmp_path


def test_onnx_file_selects_onnxruntime(version_dir, mlp_path):
    (version_dir / "model.onnx").symlink_to(mlp_path)
    assert choose_executor(version_dir, {}, acl_importable=False) == (
        "onnxruntime",
        version_dir / "model.onnx",
    )
    with create_executor(version_dir, {"EXECUTOR_TYPE": "graph", "intra_op_thread_count": "1"}) as executor:
        assert executor.kind == "onnxruntime"


def test_om_file_prefers_acl_when_importable(version_dir):
    (version_dir / "model.om").write_bytes(b"om")
    (version_dir / "model.onnx").write_bytes(b"onnx")
    assert choose_executor(version_dir, {}, acl_importable=True)[0] == "acl"
    assert choose_executor(version_dir, {}, acl_importable=False)[0] == "onnxruntime"
    assert choose_executor(version_dir, {"EXECUTOR": "onnxruntime"}, acl_importable=True)[0] == "onnxruntime"


def test_om_without_runtime_names_the_missing_runtime(version_dir):
    (version_dir / "model.om").write_bytes(b"om")
    with pytest.raises(ExecutorError, match=r"model\.om found in .*runtime \(pyACL"):
        choose_executor(version_dir, {}, acl_importable=False)


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({}, "model.om or model.onnx"),
        ({"EXECUTOR": "acl"}, "model.om in"),
        ({"EXECUTOR": "onnxruntime"}, "model.onnx in"),
    ],
)
def test_missing_model_file_is_named(version_dir, params, needle):
    with pytest.raises(ExecutorError, match="model file not found") as err:
        choose_executor(version_dir, params, acl_importable=True)
    assert needle in str(err.value) and str(version_dir) in str(err.value)


def test_default_model_filename_is_honoured(version_dir, mlp_path):
    (version_dir / "resnet.onnx").symlink_to(mlp_path)
    assert choose_executor(version_dir, {}, model_filename="resnet.onnx") == (
        "onnxruntime",
        version_dir / "resnet.onnx",
    )
    with pytest.raises(ExecutorError, match=".om or .onnx"):
        choose_executor(version_dir, {}, model_filename="model.pt")


def test_unknown_executor_value_is_rejected(version_dir):
    with pytest.raises(ExecutorError, match="'tensorrt' is not one of auto, acl, onnxruntime"):
        choose_executor(version_dir, {"EXECUTOR": "tensorrt"})


def test_create_executor_builds_the_acl_executor_when_pyacl_imports(version_dir, monkeypatch):
    from tests.backend_ge.builders import mlp_model
    from tests.backend_ge.fake_acl import FakeAcl, write_fake_om

    fake = FakeAcl(device_count=8)
    monkeypatch.setitem(sys.modules, "acl", fake)
    write_fake_om(mlp_model(), version_dir / "model.om", [1, 2, 4])
    executor = create_executor(version_dir, {"device_ids": "4,5"}, instance_index=1)
    try:
        assert executor.kind == "acl"
        assert fake.current_device == 5  # instance 1 of device_ids "4,5"
    finally:
        executor.close()


@pytest.mark.parametrize(
    ("params", "index", "device"),
    [({}, 0, 0), ({"DEVICE_ID": "3"}, 2, 3), ({"device_ids": "4,5"}, 0, 4), ({"device_ids": "4,5"}, 3, 5),
     ({"device_ids": "4, 5", "DEVICE_ID": "1"}, 1, 5)],
)  # fmt: skip
def test_device_is_picked_per_instance(params, index, device):
    assert select_device(params, index) == device


def test_bad_device_list_is_rejected():
    with pytest.raises(ExecutorError, match="'4,x'"):
        select_device({"device_ids": "4,x"})


def test_instance_index_comes_from_tritons_instance_name():
    assert [instance_index(n) for n in ("resnet50_0", "resnet50_3", "my_model_12", "")] == [0, 3, 12, 0]


# -- config against the model ------------------------------------------------------------------------------


def _entry(name, dtype, dims):
    return {"name": name, "data_type": dtype, "dims": dims}


def test_minimal_config_is_completed_with_batching(mlp_path):
    with OnnxRuntimeExecutor(mlp_path) as executor:
        added = complete_config({"max_batch_size": 0, "input": [], "output": []}, executor)
    assert added["max_batch_size"] == 8 and added["dynamic_batching"] is True
    assert added["input"] == [_entry("input", "TYPE_FP32", [256])]
    assert added["output"] == [_entry("output", "TYPE_FP32", [16])]


def test_partial_config_keeps_what_the_user_wrote(mlp_path):
    config = {"max_batch_size": 4, "input": [_entry("input", "TYPE_FP32", [256])], "output": []}
    with OnnxRuntimeExecutor(mlp_path) as executor:
        added = complete_config(config, executor)
    assert "max_batch_size" not in added and added["input"] == []
    assert added["output"] == [_entry("output", "TYPE_FP32", [16])]


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"input": [_entry("input", "TYPE_INT32", [256])]}, "TYPE_INT32 in the config but TYPE_FP32"),
        ({"input": [_entry("input", "TYPE_FP32", [255])]}, "dims [255] in the config but [256]"),
        ({"input": [_entry("x", "TYPE_FP32", [256])]}, "config input 'x' is not in the model"),
        ({"output": [_entry("output", "TYPE_BF16", [16])]}, "TYPE_BF16"),
    ],
)
def test_config_that_disagrees_with_the_model_fails_the_load(mlp_path, change, needle):
    config = {"max_batch_size": 8, "input": [_entry("input", "TYPE_FP32", [256])],
              "output": [_entry("output", "TYPE_FP32", [16])], **change}  # fmt: skip
    with (
        OnnxRuntimeExecutor(mlp_path) as executor,
        pytest.raises(ConfigMismatch, match=needle.replace("[", r"\[")),
    ):
        check_config(config, executor)


def test_batching_a_model_without_a_batch_dimension_fails_the_load(tmp_path):
    onnx.save_model(_identity_model(TensorProto.FLOAT, 2), tmp_path / "m.onnx")
    config = {
        "max_batch_size": 4,
        "input": [_entry("x", "TYPE_FP32", [3])],
        "output": [_entry("y", "TYPE_FP32", [3])],
    }
    with (
        OnnxRuntimeExecutor(tmp_path / "m.onnx") as executor,
        pytest.raises(ConfigMismatch, match="no dynamic batch"),
    ):
        check_config(config, executor)
