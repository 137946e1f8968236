"""``python -m backend_ge``: bench, examples and the convert dispatch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backend_ge import config as ge_config
from backend_ge.__main__ import main

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "backend_ge", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)  # fmt: skip


@pytest.mark.triton
def test_bench_reports_throughput_latency_and_the_server_split(triton):
    before = triton.model_statistics("mlp")[0]["inference_count"]
    done = _cli(
        "bench",
        "--model",
        "mlp",
        "--concurrency",
        "2",
        "--requests",
        "40",
        "--url",
        triton.http_url,
        "--json",
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)

    assert (result["completed"], result["errors"]) == (40, 0)
    assert result["throughput_rps"] > 0
    lat = result["latency_ms"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"]
    server = result["server"]
    assert server["inference_count"] == 40  # warm-up requests happen before the first snapshot
    assert triton.model_statistics("mlp")[0]["inference_count"] - before >= 40
    assert server["avg_batch_size"] >= 1.0
    assert server["compute_infer_us"] > 0 and server["queue_us"] >= 0


@pytest.mark.triton
def test_bench_text_report_reads_like_the_seed(triton):
    done = _cli("bench", "--model", "bert", "--concurrency", "1", "--requests", "4", "--url", triton.http_url)
    assert done.returncode == 0, done.stderr
    for line in ("Throughput:", "Latency (p50):", "Latency (p99):", "Average batch size:", "queue"):
        assert line in done.stdout


@pytest.mark.triton
def test_bench_on_an_unknown_model_fails_with_a_message(triton):
    done = _cli("bench", "--model", "no_such_model", "--requests", "2", "--url", triton.http_url)
    assert done.returncode == 1
    assert "bench failed" in done.stderr and "no_such_model" in done.stderr


def test_examples_writes_models_with_ge_configs(tmp_path, capsys):
    assert main(["examples", str(tmp_path), "--only", "mlp"]) == 0
    cfg = ge_config.parse_config((tmp_path / "mlp" / "config.pbtxt").read_text())
    assert (cfg.name, cfg.backend, cfg.max_batch_size) == ("mlp", "ge", 64)
    assert cfg.HasField("dynamic_batching")
    assert (tmp_path / "mlp" / "1" / "model.onnx").stat().st_size > 1_000_000
    assert str(tmp_path / "mlp") in capsys.readouterr().out


def test_examples_rejects_an_unknown_name(tmp_path, capsys):
    assert main(["examples", str(tmp_path), "--only", "gpt"]) == 2
    assert "unknown example(s) gpt" in capsys.readouterr().err


def test_convert_is_handed_its_own_arguments(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "--help"])
    assert exit_info.value.code == 0
    assert "--input_model" in capsys.readouterr().out
