"""``python -m backend_ge npu-check``: the whole command under ``--fake`` (recorded ATC runs and npu-smi
tables, the fake pyACL in-process and inside a real tritonserver's stubs), a recorded ATC failure, and the
message on a host without CANN (this one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from backend_ge import convert, fakes
from backend_ge.npu_smi import parse_npu_smi_info
from backend_ge.npucheck import environment, models

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = str(Path(sys.executable).parent)
STEPS = ["environment", *(f"{kind} {m}" for kind in ("compile", "executor", "triton") for m in models.MODELS),
         "benchmark resnet50"]  # fmt: skip


def npu_check(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_", "GE_FAKES", "ASCEND_"))}
    base["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "backend_ge", "npu-check", *args], capture_output=True,
                          text=True, env={**base, **(env or {})}, timeout=timeout, cwd=ROOT)  # fmt: skip


def table_rows(stdout: str) -> dict[str, tuple[str, str]]:
    """STEP -> (RESULT, DETAIL) from the table printed at the end."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("STEP ") and "RESULT" in line)
    rows = {}
    for line in lines[start + 1 :]:
        if line.startswith("npu-check:"):
            break
        for step in STEPS:
            if line.startswith(step + " "):
                rest = line[len(step) :].split()
                rows[step] = (rest[0], " ".join(rest[2:]))
    return rows


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("npu-check")
    done = npu_check("--fake", "--json", str(out / "report.json"), "--keep", str(out / "work"))
    return done, json.loads((out / "report.json").read_text()), out / "work"


@pytest.mark.triton
def test_fake_run_passes_every_step_and_exits_zero(fake_run):
    done, report, _ = fake_run
    assert done.returncode == 0, done.stdout + done.stderr
    rows = table_rows(done.stdout)
    assert list(rows) == STEPS
    assert {status for status, _ in rows.values()} == {"PASS"}
    assert "npu-check: PASS (11 of 11 steps passed)" in done.stdout
    assert done.stdout.startswith("FAKE RUN (--fake)")
    assert report["ok"] is True and report["exit_code"] == 0 and report["fake"] is True
    assert [(s["step"], s["status"]) for s in report["steps"]] == [(s, "PASS") for s in STEPS]


@pytest.mark.triton
def test_fake_run_reports_the_environment_of_the_recorded_host(fake_run):
    done, report, _ = fake_run
    env = report["environment"]
    assert (env["cann_version"], env["driver_version"], env["soc_version"]) == (
        "8.3.RC2",
        "25.2.0",
        "Ascend910B3",
    )
    assert len(env["chips"]) == 8 and env["device_chip"]["health"] == "OK"
    assert (env["device_chip"]["hbm_used_mb"], env["device_chip"]["hbm_total_mb"]) == (3445, 65536)
    assert env["acl_module"].endswith("backend_ge/fakes/shim/acl.py") and env["acl_fake"] is True
    assert env["missing"] == []
    detail = table_rows(done.stdout)["environment"][1]
    assert "CANN 8.3.RC2, driver 25.2.0, 8 x 910B3" in detail and "soc Ascend910B3" in detail


@pytest.mark.triton
def test_fake_run_shows_each_exact_atc_command(fake_run):
    done, report, work = fake_run
    atc = str(work / "fake-bin" / "atc")
    commands = [line[2:] for line in done.stdout.splitlines() if line.startswith("$ ")]
    assert len(commands) == 3
    resnet = commands[0].split()
    assert resnet == [atc, f"--model={work}/onnx/resnet50.onnx", "--framework=5",
                      f"--output={work}/repository/resnet50/1/model", "--soc_version=Ascend910B3",
                      "--input_shape=input:-1,3,224,224", "--dynamic_batch_size=1,2,4,8,16,32",
                      "--input_format=NCHW", "--precision_mode=force_fp16", "--log=error"]  # fmt: skip
    assert "'--input_shape=input_ids:-1,128;attention_mask:-1,128'" in commands[1]
    compile_steps = [s for s in report["steps"] if s["step"].startswith("compile ")]
    assert compile_steps[0]["data"]["command"] == resnet
    assert all(s["seconds"] > 0 and s["data"]["exit_code"] == 0 for s in compile_steps)


@pytest.mark.triton
def test_fake_run_compares_executor_and_triton_outputs_with_stated_tolerances(fake_run):
    _, report, work = fake_run
    steps = {s["step"]: s for s in report["steps"]}
    for name, model in models.MODELS.items():
        assert report["tolerances"][name] == {
            "rtol": model.rtol,
            "atol": model.atol,
            "precision_mode": "force_fp16",
        }
        executor = steps[f"executor {name}"]["data"]
        assert executor["gears"] == list(model.gears)
        assert sorted({c["batch"] for c in executor["checks"]}) == sorted(model.check_batches)
        assert all(c["ok"] and c["max_abs_diff"] == 0.0 for c in executor["checks"])
        triton = steps[f"triton {name}"]["data"]
        assert triton["inferences"] == 8 and len(triton["checks"]) == 8
    # Dynamic batching merged concurrent requests for the big model at least.
    assert steps["triton resnet50"]["data"]["executions"] < 8
    config = (work / "repository" / "resnet50" / "config.pbtxt").read_text()
    assert "dynamic_batching" in config and '"EXECUTOR"' in config and "acl" in config
    assert (work / "repository" / "resnet50" / "1" / "model.om.json").is_file()  # a fake om, as labelled


@pytest.mark.triton
def test_fake_run_benchmark_compares_batch1_with_dynamic_batching(fake_run):
    done, report, _ = fake_run
    bench = next(s for s in report["steps"] if s["step"] == "benchmark resnet50")["data"]
    one, many = bench["phases"]["batch1"], bench["phases"]["dynamic_batching"]
    assert one["completed"] == many["completed"] == 12 and one["errors"] == many["errors"] == 0
    assert one["concurrency"] == many["concurrency"] == 4
    assert one["server"]["avg_batch_size"] == 1.0 and many["server"]["avg_batch_size"] > 1.0
    assert 0 < one["latency_ms"]["p50"] <= one["latency_ms"]["p99"]
    assert many["npu"]["samples"] >= 1 and many["npu"]["aicore_percent_max"] == 0  # the recorded idle table
    assert (many["npu"]["memory_used_mb_max"], many["npu"]["memory_total_mb"]) == (3445, 65536)
    assert bench["gated_on_speed"] is False and bench["seed_img_s"] == {
        "batch1": 125.0,
        "dynamic_batching": 450.0,
    }
    detail = table_rows(done.stdout)["benchmark resnet50"][1]
    assert "img/s" in detail and "p99" in detail and "125 -> 450 img/s" in detail and "[FAKE:" in detail


@pytest.mark.triton
def test_recorded_atc_failure_fails_its_step_with_code_and_hint(tmp_path):
    report_path = tmp_path / "report.json"
    done = npu_check("--fake", "--models", "bert,mlp", "--fake-atc-replay", "bert=fail_e19010",
                     "--json", str(report_path))  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    rows = table_rows(done.stdout)
    status, detail = rows["compile bert"]
    assert status == "FAIL" and "E19010" in detail and convert.ATC_HINTS["E19010"] in detail
    assert rows["executor bert"][0] == rows["triton bert"][0] == "SKIP"
    assert rows["compile mlp"][0] == rows["executor mlp"][0] == rows["triton mlp"][0] == "PASS"
    assert rows["benchmark resnet50"] == ("SKIP", "resnet50 not checked")
    assert "npu-check: FAIL (1 failed, 3 skipped" in done.stdout
    # ATC's own lines are shown under its command.
    recorded = (fakes.ATC_RECORDINGS / "fail_e19010.txt").read_text().splitlines()
    assert f"  | {recorded[-1]}" in done.stdout
    report = json.loads(report_path.read_text())
    assert report["ok"] is False and report["exit_code"] == 1
    step = next(s for s in report["steps"] if s["step"] == "compile bert")
    assert step["data"]["error_code"] == "E19010" and step["data"]["hint"] == convert.ATC_HINTS["E19010"]
    assert step["data"]["output"] == recorded and step["data"]["exit_code"] == 1


def test_atc_without_the_cann_environment_says_to_source_set_env(tmp_path):
    done = npu_check("--fake", "--models", "mlp", "--fake-atc-replay", "mlp=missing_libascend_hal",
                     "--json", str(tmp_path / "r.json"))  # fmt: skip
    assert done.returncode == 1
    status, detail = table_rows(done.stdout)["compile mlp"]
    assert status == "FAIL" and "set_env.sh" in detail and "libascend_hal.so" in detail
    assert table_rows(done.stdout)["triton mlp"][0] == "SKIP"


def test_missing_cann_says_what_is_missing_one_line_each_and_exits_2(tmp_path):
    report_path = tmp_path / "report.json"
    done = npu_check("--json", str(report_path), env={"PATH": f"{VENV_BIN}:/usr/bin:/bin"})
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert lines[0] == "npu-check: this host cannot run the NPU check; missing:"
    items = [line for line in lines if line.startswith("  ")]
    assert [item.split(":")[0].strip() for item in items] == ["atc", "npu-smi", "pyACL"]
    assert "source its set_env.sh" in items[0] and "Ascend NPU driver" in items[1]
    assert "No module named 'acl'" in items[2] and "never `pip install acl`" in items[2]
    assert "--fake" in lines[-1]
    assert "STEP" not in done.stdout  # no table of steps that never ran
    report = json.loads(report_path.read_text())
    assert report["ok"] is False and report["exit_code"] == 2
    assert report["environment"]["missing"] == [item.strip() for item in items]


def test_an_acl_module_that_is_not_pyacl_is_named_as_pypis_unrelated_package(tmp_path):
    fakes.install_tools(tmp_path / "bin")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "acl.py").write_text('"""a network ACL library"""\n')
    done = npu_check("--json", str(tmp_path / "r.json"), env={
        "PATH": f"{tmp_path / 'bin'}:{VENV_BIN}:/usr/bin:/bin", "GE_FAKES": "1",
        "PYTHONPATH": f"{ROOT}:{tmp_path / 'site'}"})  # fmt: skip
    assert done.returncode == 2
    items = [line.strip() for line in done.stderr.splitlines() if line.startswith("  ")]
    assert len(items) == 1 and items[0].startswith("pyACL: the `acl` imported from")
    assert "not pyACL" in items[0] and "pip uninstall acl" in items[0]


def test_fakes_refuse_to_run_without_the_flag(tmp_path):
    tools = fakes.install_tools(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != fakes.ENV_FLAG}
    for tool in ("atc", "npu-smi"):
        done = subprocess.run([str(tools[tool]), "info"], capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 97 and f"FAKE {tool}" in done.stderr and done.stdout == ""
    env["PYTHONPATH"] = f"{ROOT}:{fakes.SHIM_DIR}"
    done = subprocess.run(
        [sys.executable, "-c", "import acl"], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode != 0 and "FAKE pyACL" in done.stderr


def test_command_line_mistakes_exit_2(capsys):
    from backend_ge.npucheck import main

    for argv in (["--fake-atc-replay", "bert=fail_e19010"], ["--fake", "--fake-atc-replay", "bert=nope"],
                 ["--models", "yolo"]):  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
    assert "--fake-atc-replay needs --fake" in capsys.readouterr().err


def test_fp16_sized_differences_pass_and_larger_ones_fail():
    ref = np.array([[10.0, -0.001, 0.5]], np.float32)
    resnet = models.MODELS["resnet50"]  # atol 0.1 + rtol 0.02 * |ref|
    assert (
        models.compare(ref + np.float32(0.25), ref, resnet.rtol, resnet.atol)["ok"] is False
    )  # 0.25 > 0.1+0.01
    close = models.compare(ref + np.array([[0.29, 0.09, 0.1]], np.float32), ref, resnet.rtol, resnet.atol)
    assert close["ok"] is True and 0.9 < close["worst_fraction_of_tolerance"] <= 1.0
    assert models.compare(ref[:, :2], ref, 0.1, 0.1)["ok"] is False
    assert (
        models.compare(np.full_like(ref, np.nan), ref, 0.1, 0.1)["reason"]
        == "non-finite values in the output"
    )


def test_device_maps_to_the_chip_pyacl_calls_by_that_number():
    duo = parse_npu_smi_info((fakes.NPU_SMI_RECORDINGS / "310p3_duo_x2_25.2.0.txt").read_text())
    assert [(c.npu_id, c.chip_id) for c in (environment.chip_for_device(duo.chips, d) for d in range(4))] == [
        (64, 0), (64, 1), (32832, 0), (32832, 1)
    ]  # fmt: skip
    idle = parse_npu_smi_info((fakes.NPU_SMI_RECORDINGS / "910b3_x8_idle_25.2.0.txt").read_text())
    assert environment.chip_for_device(idle.chips, 5).npu_id == 5
    assert environment.chip_for_device(idle.chips, 8) is None


def test_cann_version_is_read_from_the_toolkits_install_info(tmp_path):
    info = tmp_path / "latest" / "aarch64-linux" / environment.INSTALL_INFO
    info.parent.mkdir(parents=True)
    info.write_text((fakes.CANN_RECORDINGS / fakes.FAKE_HOST_CANN_INFO).read_text())
    version, path = environment.find_cann_version(None, {"ASCEND_HOME_PATH": str(tmp_path / "latest")})
    assert (version, path) == ("8.3.RC2", str(info))
    assert environment.find_cann_version(None, {}) == (None, None)
