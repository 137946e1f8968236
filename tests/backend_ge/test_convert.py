"""backend_ge.convert: ATC command building and the runner (against recorded real ATC output), the ONNX path,
and the ``convert`` command line."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from backend_ge import config as gc
from backend_ge import convert, fakes

FIXTURES = fakes.ATC_RECORDINGS


def test_command_matches_the_reference_form():
    opts = convert.AtcOptions(
        model="resnet50.onnx",
        output="resnet50.om",
        soc_version="Ascend310P3",
        input_shape={"input": [-1, 3, 224, 224]},
        dynamic_batch_size=[8, 1, 4, 2],
        input_format="NCHW",
        precision_mode="force_fp16",
    )
    assert convert.build_atc_command(opts) == [
        "atc", "--model=resnet50.onnx", "--framework=5", "--output=resnet50", "--soc_version=Ascend310P3",
        "--input_shape=input:-1,3,224,224", "--dynamic_batch_size=1,2,4,8", "--input_format=NCHW",
        "--precision_mode=force_fp16", "--log=error",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "model,framework", [("m.onnx", 5), ("frozen.pb", 3), ("net.air", 1), ("deploy.prototxt", 0)]
)
def test_framework_follows_the_model_format(model, framework):
    assert convert.framework_for(model) == framework


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"model": "deploy.prototxt"}, "--weight"),
        ({"dynamic_batch_size": [4]}, "2 to 100"),
        ({"dynamic_batch_size": list(range(1, 102))}, "2 to 100"),
        ({"input_shape": {"input": [1, 3, 224, 224]}}, "-1"),
        ({"dynamic_dims": "1;2"}, "mutually exclusive"),
        ({"soc_version": ""}, "npu-smi"),
        ({"model": "model.pth"}, "ONNX"),
    ],
)
def test_invalid_atc_options_are_refused_before_running(changes, message):
    base = dict(
        model="m.onnx", output="out", soc_version="Ascend910B3", input_shape={"input": [-1, 3]},
        dynamic_batch_size=[1, 2, 4],
    )  # fmt: skip
    with pytest.raises(convert.ConversionError, match=message):
        convert.build_atc_command(convert.AtcOptions(**{**base, **changes}))


def test_input_shape_styles():
    assert convert.parse_input_shape("input:-1,3,224,224") == {"input": [-1, 3, 224, 224]}
    assert convert.parse_input_shape("a:1,128;b:1,128") == {"a": [1, 128], "b": [1, 128]}
    assert convert.parse_input_shape("[1,3,224,224]", ["input"]) == {"input": [1, 3, 224, 224]}
    assert convert.parse_input_shape("[1,128]", ["input_ids", "attention_mask"]) == {
        "input_ids": [1, 128],
        "attention_mask": [1, 128],
    }
    with pytest.raises(convert.ConversionError, match="no input names"):
        convert.parse_input_shape("[1,3]")


def test_success_run_streams_lines_and_collects_warnings(fake_atc):
    argv_file = fake_atc("success_yolox", FAKE_ATC_LINE_DELAY=0.2)
    seen: list[tuple[float, str]] = []
    command = [fake_atc.path, "--model=m.onnx", "--framework=5", "--output=out/m", "--soc_version=Ascend310"]
    result = convert.run_atc(command, on_line=lambda line: seen.append((time.monotonic(), line)))
    finished = time.monotonic()
    assert [line for _, line in seen] == (FIXTURES / "success_yolox.txt").read_text().splitlines()
    assert finished - seen[0][0] > 0.8  # the first line arrived while ATC was still running
    assert result.exit_code == 0 and result.output_path == Path("out/m.om")
    assert len(result.warnings) == 4 and result.warnings[0].startswith("W11001: Op [Slice_29]")
    assert json.loads(argv_file.read_text()) == command[1:]


@pytest.mark.parametrize(
    "fixture,code,words",
    [
        ("fail_ez3003", "EZ3003", "No supported Ops kernel and engine are found for [AddDsl]"),
        ("fail_e10001", "E10001", "Value [-1] for parameter [input_2] is invalid"),
        (
            "fail_e20001",
            "E20001",
            "Failed to compile Op [/model/layers.4/self_attn/Slice_ascend_mbatch_batch_5]",
        ),
    ],
)
def test_failures_become_readable_errors_with_their_codes(fake_atc, fixture, code, words):
    fake_atc(fixture)
    lines = []
    with pytest.raises(convert.AtcError) as exc:
        convert.run_atc([fake_atc.path, "--output=x"], on_line=lines.append)
    err = exc.value
    assert err.codes == [code] and err.exit_code == 1
    assert str(err).startswith(f"ATC failed with {code}: {words}")
    assert "[PID:" not in str(err)  # ATC's pid/timestamp prefix is noise for users
    assert code not in convert.ATC_HINTS or convert.ATC_HINTS[code] in str(err)
    assert lines == (FIXTURES / f"{fixture}.txt").read_text().splitlines()


def test_missing_cann_environment_says_to_source_set_env(fake_atc):
    fake_atc("missing_libascend_hal")
    with pytest.raises(convert.AtcError, match="source CANN's set_env.sh") as exc:
        convert.run_atc([fake_atc.path])
    assert exc.value.exit_code == 127


def test_timeout_kills_atc_and_reports_it(fake_atc):
    fake_atc("success_yolox", FAKE_ATC_SLEEP=30)
    started = time.monotonic()
    with pytest.raises(convert.AtcError, match="timed out after 0.5 s"):
        convert.run_atc([fake_atc.path], timeout=0.5)
    assert time.monotonic() - started < 10


def test_exit_zero_without_success_line_is_a_failure(fake_atc):
    fake_atc("fail_e10001", FAKE_ATC_EXIT=0)
    with pytest.raises(convert.AtcError, match="E10001"):
        convert.run_atc([fake_atc.path])


def _model(tmp_path, opset=13, batch="N", name="m.onnx"):
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, 3, 4, 4])
    y = helper.make_tensor_value_info("output", TensorProto.FLOAT, [batch, 3])
    node = helper.make_node("ReduceMean", ["input"], ["output"], axes=[2, 3], keepdims=0)
    model = helper.make_model(
        helper.make_graph([node], "g", [x], [y]), opset_imports=[helper.make_opsetid("", opset)]
    )
    path = tmp_path / name
    onnx.save(model, str(path))
    return path


def test_onnx_path_writes_model_and_a_valid_config(tmp_path):
    repo_model = tmp_path / "repo" / "resnet50"
    prepared = convert.prepare_onnx(
        _model(tmp_path), repo_model / "1", max_batch_size=8, preferred_batch_sizes=[4]
    )
    assert prepared.model_path == repo_model / "1" / "model.onnx"
    assert onnx.load(str(prepared.model_path)).graph.input[0].name == "input"
    cfg = gc.load_config((repo_model / "config.pbtxt").read_text(), expected_name="resnet50")
    assert cfg.max_batch_size == 8 and list(cfg.input[0].dims) == [3, 4, 4]
    assert sorted(p.name for p in (repo_model / "1").iterdir()) == ["model.onnx"]  # no temp files left


def test_broken_onnx_is_rejected_with_the_reason(tmp_path):
    path = _model(tmp_path)
    model = onnx.load(str(path))
    model.graph.node[0].input[0] = "nonexistent"
    onnx.save(model, str(path))
    with pytest.raises(convert.ConversionError, match="not a valid ONNX model"):
        convert.check_onnx(path)


def test_cli_without_atc_prepares_onnx_like_seed_example_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    out = tmp_path / "model_repository" / "resnet50" / "1" / "model.graphdef"
    code = convert.main(
        ["--input_model", str(_model(tmp_path)), "--output_model", str(out), "--input_shape", "[1,3,4,4]",
         "--output_shape", "[1,3]", "--input_type", "FP32"]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert (out.parent / "model.onnx").is_file()
    assert gc.load_config((out.parent.parent / "config.pbtxt").read_text(), expected_name="resnet50")


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--input_type", "INT32"], "--input_type INT32"),
        (["--input_shape", "[1,3,224,224]"], "does not fit"),
        (["--output_shape", "[1,1000]"], "does not fit"),
    ],
)
def test_cli_mismatch_exits_nonzero_with_a_readable_error(tmp_path, monkeypatch, capsys, extra, message):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    code = convert.main(
        ["--input_model", str(_model(tmp_path)), "--output_model", str(tmp_path / "o/1/m.om"), *extra]
    )
    assert code == 1 and message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_cli_tensorflow_without_atc_asks_for_an_atc_host(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    pb = tmp_path / "bert.pb"
    pb.write_bytes(b"\x00")
    assert convert.main(["--input_model", str(pb), "--output_model", str(tmp_path / "b/1/m")]) == 1
    assert "need an ATC host" in capsys.readouterr().err


def test_cli_with_atc_prints_the_exact_command_and_streams_output(tmp_path, fake_atc, capsys):
    argv_file = fake_atc("success_yolox")
    model = _model(tmp_path)
    out = tmp_path / "repo" / "resnet50" / "1" / "model.om"
    code = convert.main(
        ["--input_model", str(model), "--output_model", str(out), "--input_shape", "[1,3,4,4]",
         "--soc_version", "Ascend310P3", "--dynamic_batch_size", "1,2,4,8"]
    )  # fmt: skip
    stdout = capsys.readouterr().out.splitlines()
    expected = [
        f"--model={model}", "--framework=5", f"--output={out.with_suffix('')}", "--soc_version=Ascend310P3",
        "--input_shape=input:-1,3,4,4", "--dynamic_batch_size=1,2,4,8", "--log=error",
    ]  # fmt: skip
    assert code == 0
    assert json.loads(argv_file.read_text()) == expected
    assert stdout[0].endswith(" ".join(expected)) and stdout[0].startswith(fake_atc.path)
    assert "ATC run success, welcome to the next use." in stdout


def test_cli_with_atc_failure_exits_nonzero(tmp_path, fake_atc, capsys):
    fake_atc("fail_ez3003")
    code = convert.main(
        ["--input_model", str(_model(tmp_path)), "--output_model", str(tmp_path / "m.om"),
         "--input_shape", "input:1,3,4,4", "--soc_version", "Ascend310P3"]
    )  # fmt: skip
    assert code == 1 and "ATC failed with EZ3003" in capsys.readouterr().err


def test_zero_input_run_uses_the_declared_dtype(tmp_path):
    ids = helper.make_tensor_value_info("ids", TensorProto.INT32, ["N", 8])
    out = helper.make_tensor_value_info("out", TensorProto.INT32, ["N", 8])
    model = helper.make_model(
        helper.make_graph([helper.make_node("Identity", ["ids"], ["out"])], "g", [ids], [out]),
        opset_imports=[helper.make_opsetid("", 13)],
    )
    path = tmp_path / "ids.onnx"
    onnx.save(model, str(path))
    _, sig = convert.check_onnx(path)
    assert sig.inputs[0].dtype == "INT32" and sig.batched
    assert np.dtype("int32") == convert.dtypes.from_wire(sig.inputs[0].dtype).numpy
