"""The agent's footprint measurement (``hostagent.footprint``): HBM before/after from the fake ``npu-smi``
(recorded real tables of one 8 x 910B3 machine, idle and with processes), and on CPU the model's python stubs'
PSS plus Triton's RSS growth, read from a /proc laid out as Linux lays it out (and from the real one)."""

from __future__ import annotations

import os
from pathlib import Path

from backend_ge import fakes, npu_smi
from hostagent import footprint


def test_npu_footprint_is_hbm_used_after_minus_before_on_the_instance_devices(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    fakes.install_tools(bindir, ("npu-smi",))
    monkeypatch.setenv("PATH", str(bindir))
    monkeypatch.setenv(fakes.ENV_FLAG, "1")
    monkeypatch.setenv("FAKE_NPU_SMI_TABLE", "910b3_x8_idle_25.2.0")  # HBM used 3445 and 3418 MB on NPU 0, 1
    meter = footprint.Meter(server_pid=os.getpid(), model_name="vision__resnet", device_ids=[0, 1])
    assert meter.hbm_before == 3445 + 3418
    monkeypatch.setenv("FAKE_NPU_SMI_TABLE", "910b3_x8_processes_24.1.rc2")  # 54592 and 54592 MB
    assert meter.finish() == (54592 - 3445) + (54592 - 3418)
    # Another load on the instance overlapped this one: the chip's difference holds both, so no figure.
    assert meter.finish(alone=False) is None


def test_npu_footprint_is_none_without_a_readable_npu_smi():
    def broken():
        raise npu_smi.NpuSmiError("npu-smi info exited with status 1")

    assert footprint.hbm_used_mb([0], broken) is None
    assert footprint.hbm_used_mb([0], lambda: None) is None


def fake_process(proc: Path, pid: int, ppid: int, argv: list[str], *, rss_kb=0, pss_kb=0) -> None:
    entry = proc / str(pid)
    entry.mkdir(parents=True)
    (entry / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (entry / "stat").write_text(f"{pid} ({Path(argv[0]).name[:15]}) S {ppid} {pid} {pid} 0 -1 4194560\n")
    (entry / "status").write_text(f"Name:\tx\nVmPeak:\t 1 kB\nVmRSS:\t {rss_kb} kB\n")
    (entry / "smaps_rollup").write_text(f"00400000-7fff [rollup]\nRss:  {rss_kb} kB\nPss:  {pss_kb} kB\n")


def test_cpu_footprint_is_the_stubs_pss_plus_tritons_growth(tmp_path):
    proc = tmp_path / "proc"
    repo = "/srv/fleet/h1/cpu-0/repository"
    stub = "/srv/fleet/h1/runtime/backends/python/triton_python_backend_stub"
    fake_process(proc, 100, 1, ["/srv/tritonserver", "--model-repository", repo], rss_kb=200_000)
    meter = footprint.Meter(server_pid=100, model_name="vision__scaler", proc=proc)
    assert meter.rss_before == 200_000
    # The load: Triton grows by 10 MiB, two stubs of the model start, beside another model's stub and an
    # unrelated child of another process.
    (proc / "100" / "status").write_text("VmRSS:\t 210240 kB\n")
    for pid, model, pss in (
        (201, "vision__scaler", 30_000),
        (202, "vision__scaler", 20_000),
        (203, "other", 99),
    ):
        fake_process(proc, pid, 100, [stub, f"{repo}/{model}/1/model.py", "shm", "1048576"], pss_kb=pss)
    fake_process(proc, 300, 42, [stub, f"{repo}/vision__scaler/1/model.py"], pss_kb=77_000)
    assert footprint.stub_pids(100, "vision__scaler", proc) == [201, 202]
    assert meter.finish() == -(-(30_000 + 20_000 + 10_240) // 1024)  # 59 MiB, rounded up
    # Loads overlapped: Triton's growth is shared between them, the model's own stubs are still its own.
    assert meter.finish(alone=False) == -(-(30_000 + 20_000) // 1024)  # 49 MiB


def test_cpu_footprint_is_none_when_no_stub_is_seen(tmp_path):
    proc = tmp_path / "proc"
    fake_process(proc, 100, 1, ["/srv/tritonserver"], rss_kb=1000)
    assert footprint.Meter(server_pid=100, model_name="m", proc=proc).finish() is None
    assert footprint.start(None, "m", []) is None


def test_the_real_proc_gives_rss_and_pss_of_this_process():
    assert footprint.rss_kb(os.getpid()) > 0 and footprint.pss_kb(os.getpid()) > 0
    assert footprint.stub_pids(os.getpid(), "nothing") == []
