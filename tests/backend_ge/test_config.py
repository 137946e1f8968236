"""backend_ge.config: generate, parse, normalize and validate config.pbtxt through Triton's protobuf."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from tritonclient.grpc import model_config_pb2 as mc

from backend_ge import config as gc
from tests.backend_ge.seeds import (
    SEED_BERT,
    SEED_ENSEMBLE,
    SEED_ENSEMBLE_AS_PRINTED,
    SEED_RESNET50,
    SEED_RESNET50_AS_PRINTED,
)

# The seed article's configs, with the quotes its web rendering lost put back.


def fields(errors) -> set[str]:
    return {e.field for e in errors}


def test_seed_resnet50_normalizes_to_ge_backend_keeps_executor_and_drops_device_pinning():
    cfg = gc.load_config(SEED_RESNET50, expected_name="resnet50")
    assert cfg.backend == "ge" and cfg.platform == ""
    assert cfg.parameters["EXECUTOR_TYPE"].string_value == "graph"
    assert "DEVICE_ID" not in cfg.parameters  # the platform picks devices at placement
    assert list(cfg.dynamic_batching.preferred_batch_size) == [4, 8, 16]
    assert cfg.input[0].format == mc.ModelInput.FORMAT_NCHW


@pytest.mark.parametrize(
    "text,name", [(SEED_RESNET50, "resnet50"), (SEED_BERT, "bert"), (SEED_ENSEMBLE, None)]
)
def test_seed_configs_round_trip_through_render_and_parse(text, name):
    cfg = gc.load_config(text, expected_name=name)
    rendered = gc.render_config(cfg)
    again = gc.parse_config(rendered)
    assert again == cfg
    assert gc.validate_config(again) == []


def test_seed_ensemble_steps_move_into_ensemble_scheduling():
    cfg = gc.parse_config(SEED_ENSEMBLE)
    steps = cfg.ensemble_scheduling.step
    assert [s.model_name for s in steps] == ["preprocess", "resnet50", "postprocess"]
    assert steps[1].input_map["input"] == "preprocessed_image"
    assert steps[2].output_map["output"] == "predictions"


def test_ensemble_with_broken_wiring_names_the_step():
    bad = SEED_ENSEMBLE.replace('value: "preprocessed_image" } output_map', 'value: "typo" } output_map')
    errors = gc.validate_config(gc.parse_config(bad))
    assert "ensemble_scheduling.step[1].input_map.input" in fields(errors)


def test_unknown_data_type_is_a_field_error_listing_supported_types():
    with pytest.raises(gc.ConfigError) as exc:
        gc.parse_config('name: "m" input [{ name: "x" data_type: TYPE_FLOAT32 dims: [3] }]')
    assert exc.value.errors[0].field == "data_type"
    assert "TYPE_FLOAT32" in str(exc.value) and "TYPE_FP32" in str(exc.value)


def test_unknown_field_is_reported_with_its_line():
    with pytest.raises(gc.ConfigError) as exc:
        gc.parse_config('name: "m"\nmax_batch: 4\n')
    assert exc.value.errors[0].field == "max_batch"
    assert "line 2" in exc.value.errors[0].message


# Extra inputs are appended after the base config's input[0].
BAD_CASES = {
    "missing dims": ('input [{ name: "x" data_type: TYPE_FP32 }]', "input[1].dims"),
    "zero dim": ('input [{ name: "x" data_type: TYPE_FP32 dims: [0, 3] }]', "input[1].dims[0]"),
    "preferred > max": (
        "dynamic_batching { preferred_batch_size: [4, 64] }",
        "dynamic_batching.preferred_batch_size[1]",
    ),
    "duplicate input": (
        'input [{ name: "x" data_type: TYPE_FP32 dims: [3] }, { name: "x" data_type: TYPE_FP32 dims: [3] }]',
        "input[2].name",
    ),
    "string dtype on ge": ('input [{ name: "s" data_type: TYPE_STRING dims: [1] }]', "input[1].data_type"),
    "missing data_type": ('input [{ name: "y" dims: [3] }]', "input[1].data_type"),
    "bad DEVICE_ID": (
        'parameters { key: "DEVICE_ID" value { string_value: "npu0" } }',
        "parameters.DEVICE_ID",
    ),
    "bad device_ids": (
        'parameters { key: "device_ids" value { string_value: "4,x" } }',
        "parameters.device_ids",
    ),
    "bad executor": (
        'parameters { key: "EXECUTOR" value { string_value: "tensorrt" } }',
        "parameters.EXECUTOR",
    ),
    "gpu kind": ("instance_group [{ count: 1 kind: KIND_GPU }]", "instance_group[0].kind"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_config_reports_the_offending_field(case):
    extra, field = BAD_CASES[case]
    base = (
        'name: "m" backend: "ge" max_batch_size: 8\n'
        'input [{ name: "in" data_type: TYPE_FP32 dims: [3] }]\n'
        'output [{ name: "out" data_type: TYPE_FP32 dims: [2] }]\n'
    )
    errors = gc.validate_config(gc.parse_config(base + extra))
    assert field in fields(errors), errors


def test_valid_base_config_has_no_errors():
    base = (
        'name: "m" backend: "ge" max_batch_size: 8\n'
        'input [{ name: "in" data_type: TYPE_FP32 dims: [3] }]\n'
        'output [{ name: "out" data_type: TYPE_FP32 dims: [2] }]\n'
    )
    assert gc.validate_config(gc.parse_config(base)) == []


def test_name_mismatch_with_model_directory():
    errors = gc.validate_config(
        gc.parse_config(SEED_BERT.replace("graph_executor", "ge")), expected_name="bert2"
    )
    assert "name" in fields(errors)


def test_dynamic_batching_without_max_batch_size_is_rejected():
    cfg = gc.parse_config(SEED_BERT.replace("max_batch_size: 16", "max_batch_size: 0"))
    assert "dynamic_batching" in fields(gc.validate_config(gc.normalize_config(cfg)))


def test_unnormalized_seed_platform_is_flagged():
    assert "platform" in fields(gc.validate_config(gc.parse_config(SEED_BERT)))


def test_minimal_config_is_valid_when_auto_complete_fills_io():
    cfg = gc.parse_config('name: "m" backend: "ge"')
    assert gc.validate_config(cfg, require_io=False) == []
    assert {"input", "output"} <= fields(gc.validate_config(cfg))


def test_config_error_groups_messages_by_field():
    with pytest.raises(gc.ConfigError) as exc:
        gc.load_config('name: "m" backend: "ge" input [{ name: "a" dims: [0] }]')
    grouped = exc.value.as_dict()
    assert "input[0].data_type" in grouped and "input[0].dims[0]" in grouped and "output" in grouped


def _onnx_model(batch_dim, tmp_path):
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch_dim, 3, 8, 8])
    y = helper.make_tensor_value_info("output", TensorProto.FLOAT, [batch_dim, 3])
    w = helper.make_tensor("w", TensorProto.FLOAT, [3], np.ones(3, np.float32).tolist())
    nodes = [
        helper.make_node("ReduceMean", ["input"], ["m"], axes=[2, 3], keepdims=0),
        helper.make_node("Mul", ["m", "w"], ["output"]),
    ]
    graph = helper.make_graph(nodes, "g", [x], [y], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("batch_dim", ["N", -1])
def test_signature_from_onnx_detects_batch_dimension(tmp_path, batch_dim):
    sig = gc.ModelSignature.from_onnx(_onnx_model(batch_dim, tmp_path))
    assert sig.batched
    assert sig.inputs == (gc.TensorSignature("input", "FP32", (3, 8, 8), "NCHW"),)
    assert sig.outputs == (gc.TensorSignature("output", "FP32", (3,), ""),)


def test_signature_from_onnx_with_fixed_batch_is_not_batched(tmp_path):
    sig = gc.signature_from_onnx(_onnx_model(1, tmp_path))
    assert not sig.batched and sig.inputs[0].dims == (1, 3, 8, 8)


def test_generated_config_matches_seed_example_1_and_validates(tmp_path):
    sig = gc.signature_from_onnx(_onnx_model("N", tmp_path))
    cfg = gc.generate_config(
        "resnet50",
        sig,
        max_batch_size=32,
        preferred_batch_sizes=[16, 4, 8],
        max_queue_delay_us=5000,
        instance_count=2,
        device_ids=[4, 5],
    )
    assert gc.validate_config(cfg, expected_name="resnet50", signature=sig) == []
    text = gc.render_config(cfg)
    assert 'backend: "ge"' in text and "max_batch_size: 32" in text
    back = gc.parse_config(text)
    assert list(back.dynamic_batching.preferred_batch_size) == [4, 8, 16]
    assert back.dynamic_batching.max_queue_delay_microseconds == 5000
    assert back.instance_group[0].count == 2 and back.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU
    assert back.parameters["DEVICE_ID"].string_value == "4"
    assert back.parameters["device_ids"].string_value == "4,5"
    assert list(back.input[0].dims) == [3, 8, 8]


def test_signature_mismatch_names_the_field(tmp_path):
    sig = gc.signature_from_onnx(_onnx_model("N", tmp_path))
    cfg = gc.load_config(SEED_RESNET50)
    errors = gc.validate_config(cfg, signature=sig)
    assert "input[0].dims" in fields(errors)  # [3,224,224] vs the model's [3,8,8]
    assert "output[0].dims" in fields(errors)


def test_signature_json_round_trip_and_from_config():
    cfg = gc.load_config(SEED_BERT)
    sig = gc.signature_from_config(cfg)
    assert sig.batched and [t.name for t in sig.inputs] == ["input_ids", "attention_mask"]
    assert gc.ModelSignature.from_dict(sig.to_dict()) == sig


def test_write_config_is_atomic_and_readable(tmp_path):
    cfg = gc.load_config(SEED_BERT)
    path = gc.write_config(cfg, tmp_path / "config.pbtxt")
    assert gc.parse_config(path.read_text()) == cfg
    assert [p.name for p in tmp_path.iterdir()] == ["config.pbtxt"]


def test_default_batch_gears():
    assert gc.default_batch_gears(8) == [1, 2, 4, 8]
    assert gc.default_batch_gears(12) == [1, 2, 4, 8, 12]
    assert gc.default_batch_gears(1) == [1]


# The seed article prints its configs with every quote stripped; users paste them like that.


def test_seed_config_without_quotes_parses_and_normalizes():
    cfg = gc.normalize_config(gc.parse_config(SEED_RESNET50_AS_PRINTED))
    assert cfg.name == "resnet50" and cfg.backend == "ge" and cfg.platform == ""
    assert [i.name for i in cfg.input] == ["input"] and list(cfg.input[0].dims) == [3, 224, 224]
    assert cfg.parameters["EXECUTOR_TYPE"].string_value == "graph"
    assert "DEVICE_ID" not in cfg.parameters
    assert list(cfg.dynamic_batching.preferred_batch_size) == [4, 8, 16]


def test_seed_ensemble_without_quotes_parses():
    cfg = gc.parse_config(SEED_ENSEMBLE_AS_PRINTED)
    steps = cfg.ensemble_scheduling.step
    assert [s.model_name for s in steps] == ["preprocess", "resnet50", "postprocess"]
    assert steps[1].input_map["input"] == "preprocessed_image"
    assert steps[2].output_map["output"] == "predictions"


def test_enum_values_are_not_quoted_and_real_errors_still_surface():
    with pytest.raises(gc.ConfigError) as excinfo:
        gc.parse_config("name: m\ninput [ { name: x data_type: TYPE_FLOAT32 dims: [1] } ]\n")
    assert "TYPE_FLOAT32" in str(excinfo.value.errors[0].message)
