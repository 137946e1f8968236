"""Server lifecycle: graceful stop with requests in flight, and the ``serve`` CLI on a seed-style repository."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from backend_ge.runtime import TritonError, TritonServer, free_port

pytestmark = pytest.mark.triton

ROOT = Path(__file__).resolve().parents[2]


def test_graceful_stop_lets_in_flight_requests_finish(example_repository, tmp_path):
    # mlp_slow holds requests in its batch queue for 1.5 s, so they are surely in flight when SIGINT lands.
    server = TritonServer(
        example_repository, workdir=tmp_path, load_models=["mlp_slow"], exit_timeout=10, die_with_parent=True
    )
    server.start(timeout=90)
    client = httpclient.InferenceServerClient(server.http_url, concurrency=3)
    try:
        x = np.ones((1, 256), np.float32)
        pending = []
        for _ in range(3):
            item = httpclient.InferInput("input", [1, 256], "FP32")
            item.set_data_from_numpy(x)
            pending.append(client.async_infer("mlp_slow", [item]))
        time.sleep(0.5)
        codes: list = []
        stopper = threading.Thread(target=lambda: codes.append(server.stop(timeout=30)))
        t0 = time.monotonic()
        stopper.start()
        outputs = [p.get_result(timeout=20).as_numpy("output") for p in pending]
    finally:
        client.close()
    stopper.join(40)

    assert all(o.shape == (1, 16) for o in outputs)
    assert codes == [0], server.log_tail()
    assert time.monotonic() - t0 < 15  # exited on its own, no kill after the timeout
    assert server.process.returncode == 0


def test_without_auto_complete_complete_configs_serve_and_minimal_ones_are_refused(
    example_repository, tmp_path
):
    # What the host agent runs: the platform's configs are complete, so no auto-complete stub per load.
    server = TritonServer(
        example_repository, workdir=tmp_path, auto_complete_config=False, exit_timeout=5, die_with_parent=True
    )
    server.start(timeout=90)
    try:
        server.load_model("mlp")
        client = httpclient.InferenceServerClient(server.http_url)
        try:
            item = httpclient.InferInput("input", [2, 256], "FP32")
            item.set_data_from_numpy(np.ones((2, 256), np.float32))
            assert client.infer("mlp", [item]).as_numpy("output").shape == (2, 16)
        finally:
            client.close()
        # A seed-style minimal config is completed only by the backend's auto-complete: refused here, with
        # the GE backend's reason.
        with pytest.raises(TritonError, match="missing from the config"):
            server.load_model("mlp_auto")
        assert "--disable-auto-complete-config" in server.command(Path("backends"))
    finally:
        server.stop(timeout=30)


def test_start_failure_reports_the_log_tail(tmp_path):
    missing = tmp_path / "no-repository"
    server = TritonServer(missing, workdir=tmp_path / "work")
    with pytest.raises(Exception, match="tritonserver exited") as err:
        server.start(timeout=60)
    assert str(missing) in str(err.value)
    assert server.stop() is not None


# As the seed article prints it: platform graph_executor, EXECUTOR_TYPE/DEVICE_ID, and no quotes at all.
SEED_RESNET_STYLE_CONFIG = """
name: mlp
platform: graph_executor
max_batch_size: 32
input [ { name: input data_type: TYPE_FP32 dims: [256] } ]
output [ { name: output data_type: TYPE_FP32 dims: [16] } ]
# GE 后端配置
parameters [ { key: EXECUTOR_TYPE value: { string_value: graph } },
             { key: DEVICE_ID value: { string_value: 0 } } ]
dynamic_batching { preferred_batch_size: [4, 8, 16] max_queue_delay_microseconds: 5000 }
"""


def test_serve_cli_loads_a_seed_style_repository_and_stops_on_ctrl_c(example_repository, tmp_path):
    repo = tmp_path / "model_repository"
    (repo / "mlp" / "1").mkdir(parents=True)
    (repo / "mlp" / "1" / "model.onnx").symlink_to(example_repository / "mlp" / "1" / "model.onnx")
    (repo / "mlp" / "config.pbtxt").write_text(SEED_RESNET_STYLE_CONFIG)
    (repo / "no_config" / "1").mkdir(parents=True)  # no config.pbtxt at all: completed from the file
    (repo / "no_config" / "1" / "model.onnx").symlink_to(example_repository / "mlp" / "1" / "model.onnx")
    (repo / "broken").mkdir()
    (repo / "broken" / "config.pbtxt").write_text('name: "broken"\nnot_a_field: 1\n')
    http_port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "backend_ge", "serve", "--model-repository", str(repo),
           "--http-port", str(http_port), "--grpc-port", "0", "--metrics-port", "0", "--workdir", str(tmp_path / "w")]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("Serving HTTP"):
                break
        assert any(line.startswith("mlp: READY") for line in lines), "".join(lines)
        assert any(line.startswith("no_config: READY") for line in lines), "".join(lines)
        assert any("skipping broken" in line and "not_a_field" in line for line in lines), "".join(lines)

        client = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
        item = httpclient.InferInput("input", [1, 256], "FP32")
        item.set_data_from_numpy(np.ones((1, 256), np.float32))
        assert client.infer("mlp", [item]).as_numpy("output").shape == (1, 16)
        assert client.get_model_config("mlp")["backend"] == "ge"
        assert client.get_model_config("no_config")["max_batch_size"] == 8
        assert client.infer("no_config", [item]).as_numpy("output").shape == (1, 16)
        client.close()

        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # a failed assertion: stop the CLI (and so its server) before killing it
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    assert proc.returncode == 0, "".join(lines) + rest
    assert "tritonserver stopped (0)" in rest


def test_server_started_with_die_with_parent_stops_when_its_launcher_is_killed(example_repository, tmp_path):
    launcher = (
        "import sys, time\n"
        "from backend_ge.runtime import TritonServer\n"
        "s = TritonServer(sys.argv[1], workdir=sys.argv[2], die_with_parent=True, exit_timeout=5).start()\n"
        "print(s.process.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", launcher, str(example_repository), str(tmp_path)],
                            stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        server_pid = int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait(10)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and Path(f"/proc/{server_pid}").exists():
        time.sleep(0.2)
    alive = (
        Path(f"/proc/{server_pid}").exists()
        and "Z" not in Path(f"/proc/{server_pid}/stat").read_text().split()[2]
    )
    if alive:
        os.kill(server_pid, signal.SIGKILL)
    assert not alive, "tritonserver outlived its launcher"
