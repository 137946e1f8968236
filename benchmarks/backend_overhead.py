"""What serving through Triton + the GE backend costs compared with onnxruntime in-process.

One run, side by side on the same machine and model files:

- ``mlp`` at concurrency 1 and 16 (``--high-concurrency``), with and without dynamic batching;
- ``resnet50`` at concurrency 4, against raw onnxruntime at the batch size Triton actually formed;
- memory: PSS (``/proc/<pid>/smaps_rollup``) per served model with 1, 10 and 50 copies of the MLP loaded
  on one instance (each model instance is one python stub process).

Two controls show what serving costs before this backend's code runs: ``floor`` and ``floor_nobatch``
are python-backend models with the MLP's config that answer every request with a constant output - the
floor of Triton + its python backend + this client, with no model. Every case also reports the CPU the
client, tritonserver and the stubs spend per request (``/proc/<pid>/stat``); ``--stub-timing`` adds the
thread CPU inside ``execute()`` and inside the executor call (``backend_ge.profiling``).

Targets (issue 14): served resnet50 throughput >= 0.95x raw onnxruntime at the same batch size; MLP with
dynamic batching at concurrency 16 >= 3.6x without, and >= 15% of raw onnxruntime's rows/s at batch 16;
added p50 latency at concurrency 1 <= 0.25 ms; PSS per served small model <= 30 MiB.

Usage: ``python benchmarks/backend_overhead.py [--quick] [--json FILE] [--protocol http|grpc]
[--memory-models 1,10,50] [--skip-speed] [--stub-timing] [--smoke]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend_ge import bench, examples, profiling  # noqa: E402
from backend_ge import config as ge_config  # noqa: E402
from backend_ge.runtime import TritonServer, load_all  # noqa: E402
from benchmarks import smoke  # noqa: E402

# The floor: Triton's python backend answering from memory. It reads its input (so its batch size) like
# any model, and builds one response tensor per request like the GE backend does.
FLOOR_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self._output = np.zeros((64, 16), np.float32)

    def execute(self, requests):
        Tensor, Response = pb_utils.Tensor, pb_utils.InferenceResponse
        return [Response([Tensor("output", self._output[: r.inputs()[0].as_numpy().shape[0]])]) for r in requests]
"""


def raw_onnxruntime(
    path: Path,
    feeds: dict[str, np.ndarray],
    seconds: float,
    max_runs: int,
    intra_op_threads: int = 0,
    evict_mib: int = 0,
) -> dict:
    """Back-to-back runs of one in-process session: per-call latency and rows per second.

    ``intra_op_threads`` 0 is onnxruntime's default (every core, spinning workers); the served MLP's config
    asks for one thread, so its compute alone is slower than the default session's at batch 1.
    ``evict_mib`` reads that much other memory between calls (not timed): a served model's weights are
    evicted from the caches by the client and tritonserver between two requests, a back-to-back loop's
    are not (the MLP's 5 MiB of weights make batch-1 compute bound by memory reads).
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    sess = ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    for _ in range(3):
        sess.run(names, feeds)
    other = np.ones(evict_mib << 20, np.uint8) if evict_mib else None
    latencies = []
    start, cpu = time.perf_counter(), 0
    while len(latencies) < max_runs and time.perf_counter() - start < seconds:
        if other is not None:
            other.sum()
        c0, t0 = time.thread_time_ns(), time.perf_counter()
        sess.run(names, feeds)
        latencies.append(time.perf_counter() - t0)
        cpu += time.thread_time_ns() - c0
    elapsed = time.perf_counter() - start
    batch = next(iter(feeds.values())).shape[0]
    lat = np.array(latencies) * 1000
    return {
        "batch": batch,
        "runs": len(latencies),
        "throughput_rps": batch * len(latencies) / elapsed,
        "latency_ms": {"p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99))},
        "cpu_us_per_call": cpu / max(1, len(latencies)) / 1000,
    }


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
    return found


def _pss_kib(pid: int, field: str = "Pss") -> int:
    """Proportional set size of one process: shared pages are split between the processes mapping them.

    ``field`` "Anonymous" gives the process's private heap and stacks, which no other process shares.
    """
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def _infer_once(server: TritonServer, model: str) -> None:
    body = json.dumps(
        {"inputs": [{"name": "input", "shape": [1, 256], "datatype": "FP32", "data": [0.5] * 256}]}
    )
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/{model}/infer", data=body.encode(), method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        reply.read()


def memory_per_model(work: Path, counts: list[int]) -> list[dict]:
    """PSS of tritonserver and its stubs with 1, 10, 50 ... copies of the MLP loaded on one instance."""
    repo = work / "memory-repository"
    examples.write_examples(repo, ["mlp"])
    model_file = repo / "mlp" / "1" / "model.onnx"
    text = (repo / "mlp" / "config.pbtxt").read_text()
    names = ["mlp"] + [f"mlp_{i}" for i in range(1, max(counts))]
    for name in names[1:]:
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.onnx").symlink_to(model_file)
        (repo / name / "config.pbtxt").write_text(text.replace('name: "mlp"', f'name: "{name}"'))
    figures = []
    server = TritonServer(repo, workdir=work / "triton-memory", exit_timeout=10)
    server.start(timeout=120)
    try:
        loaded = 0
        for count in sorted(counts):
            failures = load_all(server, names[loaded:count], parallel=2)
            if failures:
                raise SystemExit(f"model load failed: {failures}")
            for name in names[loaded:count]:
                _infer_once(server, name)  # steady state: a stub imports more on its first request
            loaded = count
            time.sleep(2)
            stubs = _children(server.process.pid)
            stub_kib = [_pss_kib(pid) for pid in stubs]
            server_kib = _pss_kib(server.process.pid)
            anon_kib = [_pss_kib(pid, "Anonymous") for pid in stubs]
            figures.append({
                "models": count,
                "stubs": len(stubs),
                "stub_pss_mib": sum(stub_kib) / 1024 / max(1, len(stubs)),
                "stub_anonymous_mib": sum(anon_kib) / 1024 / max(1, len(stubs)),
                "total_pss_mib": (server_kib + sum(stub_kib)) / 1024 / count,
                "server_pss_mib": server_kib / 1024,
                "model_file_mib": model_file.stat().st_size / 2**20,
                "stub_before_weights_mib": sum(stub_kib) / 1024 / max(1, len(stubs))
                - model_file.stat().st_size / 2**20,
            })  # fmt: skip
    finally:
        server.stop()
    return figures


def _stub_timing(directory: Path | None, model: str) -> dict[str, int]:
    """``backend_ge.profiling`` counters of the model's stubs, summed (empty without ``--stub-timing``)."""
    total: dict[str, int] = {}
    for path in sorted(directory.glob(f"{model}-*.json")) if directory else ():
        for key, value in json.loads(path.read_text()).items():
            total[key] = total.get(key, 0) + value
    return total


def _flush_stub_timing(server: TritonServer, model: str, inputs) -> None:
    """Make the model's stub write its counters now: they are written by a call a second after the last."""
    time.sleep(1.1)
    client = bench.RawHttpClient(server.http_url, model, inputs)
    try:
        client.infer()  # the stub writes the file before it answers
    finally:
        client.close()


def served(
    server: TritonServer, model: str, concurrency: int, requests: int, protocol: str, inputs,
    timing_dir: Path | None = None,
) -> dict:  # fmt: skip
    """bench.run plus CPU time per request of tritonserver and of its python stubs (from /proc)."""
    url = server.grpc_url if protocol == "grpc" else server.http_url
    stubs = _children(server.process.pid)
    if timing_dir:
        _flush_stub_timing(server, model, inputs)
    timing = _stub_timing(timing_dir, model)
    before = (_cpu_seconds(server.process.pid), sum(_cpu_seconds(p) for p in stubs))
    result = bench.run(
        url, model, concurrency=concurrency, requests=requests, protocol=protocol,
        stats_url=server.http_url, inputs=inputs, warmup=5,
    )  # fmt: skip
    after = (_cpu_seconds(server.process.pid), sum(_cpu_seconds(p) for p in stubs))
    done = max(1, result["completed"])
    result["server_cpu_us"] = (after[0] - before[0]) / done * 1e6
    result["stub_cpu_us"] = (after[1] - before[1]) / done * 1e6
    if timing_dir:
        _flush_stub_timing(server, model, inputs)  # counted below with the run's requests: one more of many
        later = _stub_timing(timing_dir, model)
        counted = max(1, later.get("requests", 0) - timing.get("requests", 0))
        for key in ("execute_cpu_ns", "executor_cpu_ns"):
            result[key.replace("_ns", "_us")] = (later.get(key, 0) - timing.get(key, 0)) / counted / 1000
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--protocol", choices=("http", "grpc"), default="http")
    parser.add_argument("--json", default="", help="also write all figures to this file")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per case; the median is reported")
    parser.add_argument(
        "--memory-models", default="1,10,50", help="model counts for the memory figures ('' skips them)"
    )
    parser.add_argument("--skip-speed", action="store_true", help="only the memory figures")
    parser.add_argument(
        "--stub-timing", action="store_true", help="also time execute() and the executor inside the stubs"
    )
    parser.add_argument(
        "--high-concurrency", type=int, default=16, help="client streams of the c=16 cases (one process each)"
    )
    # A smoke run: every case at the fewest requests (16), 2 streams instead of 16 and the shortest raw
    # loops (1-2 s): client processes and loops are what take the time.
    args = smoke.parse_args(parser, argv, rounds=1, memory_models="1", high_concurrency=2)
    scale = 0.0 if args.smoke else 0.2 if args.quick else 1.0
    hi = args.high_concurrency
    n = lambda count: max(16, int(count * scale))  # noqa: E731

    work = Path(tempfile.mkdtemp(prefix="ge-bench-"))
    repo = work / "repository"
    examples.write_examples(repo, ["mlp", "resnet50"])
    # The same model and config, dynamic batching removed: the only difference between the two runs.
    (repo / "mlp_nobatch" / "1").mkdir(parents=True)
    (repo / "mlp_nobatch" / "1" / "model.onnx").symlink_to(repo / "mlp" / "1" / "model.onnx")
    nobatch = ge_config.parse_config((repo / "mlp" / "config.pbtxt").read_text())
    nobatch.name = "mlp_nobatch"
    nobatch.ClearField("dynamic_batching")
    ge_config.write_config(nobatch, repo / "mlp_nobatch" / "config.pbtxt")
    # The controls: the same configs served by the python backend from memory, without a model.
    for name, base in (("floor", "mlp"), ("floor_nobatch", "mlp_nobatch")):
        floor = ge_config.parse_config((repo / base / "config.pbtxt").read_text())
        floor.name, floor.backend = name, "python"
        del floor.parameters["intra_op_thread_count"]
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(FLOOR_MODEL)
        ge_config.write_config(floor, repo / name / "config.pbtxt")

    rng = np.random.default_rng(0)
    mlp_x = {"input": rng.standard_normal((1, 256)).astype(np.float32)}
    resnet_x = {"input": rng.standard_normal((1, 3, 224, 224)).astype(np.float32)}
    results: dict = {"protocol": args.protocol}

    if args.memory_models:
        counts = [int(c) for c in args.memory_models.split(",") if c.strip()]
        results["memory"] = memory_per_model(work, counts)
    if args.skip_speed:
        print_memory(results.get("memory", []))
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return 0

    mlp_path, resnet_path = repo / "mlp" / "1" / "model.onnx", repo / "resnet50" / "1" / "model.onnx"
    timing_dir = work / "stub-timing" if args.stub_timing else None
    if timing_dir:  # read by backend_ge/model.py in every stub (the GE_ prefix reaches them)
        os.environ[profiling.PROFILE_DIR_ENV] = str(timing_dir)
    server = TritonServer(repo, workdir=work / "triton", exit_timeout=10)
    server.start(timeout=120)
    os.environ.pop(profiling.PROFILE_DIR_ENV, None)
    results["load_average_start"] = os.getloadavg()[0]
    try:
        failures = load_all(server, ["mlp", "mlp_nobatch", "floor", "floor_nobatch", "resnet50"])
        if failures:
            raise SystemExit(f"model load failed: {failures}")
        p = args.protocol
        # The machine is shared and noisy: every case runs in several rounds, alternating with the case it
        # is compared with, and the median round is reported. Raw runs happen while the server idles (its
        # stubs sleep), so both sides see the same background load.
        rounds: dict[str, list] = {}
        for _ in range(args.rounds):
            for key, model, conc, count in (
                ("floor_c1_nobatch", "floor_nobatch", 1, 2000),
                ("mlp_c1_batching", "mlp", 1, 2000),
                ("mlp_c1_nobatch", "mlp_nobatch", 1, 2000),
                ("floor_c16_batching", "floor", hi, 8000),
                ("mlp_c16_batching", "mlp", hi, 8000),
                ("mlp_c16_nobatch", "mlp_nobatch", hi, 8000),
            ):
                rounds.setdefault(key, []).append(served(server, model, conc, n(count), p, mlp_x, timing_dir))
            rounds.setdefault("raw_mlp_b1", []).append(raw_onnxruntime(mlp_path, mlp_x, 3 * scale + 1, 20000))
            rounds.setdefault("raw_mlp_b1_t1", []).append(
                raw_onnxruntime(mlp_path, mlp_x, 3 * scale + 1, 20000, intra_op_threads=1)
            )
            rounds.setdefault("raw_mlp_b1_t1_cold", []).append(
                raw_onnxruntime(mlp_path, mlp_x, 3 * scale + 1, 5000, intra_op_threads=1, evict_mib=32)
            )
            mlp_16 = {"input": np.repeat(mlp_x["input"], 16, 0)}
            rounds.setdefault("raw_mlp_b16", []).append(
                raw_onnxruntime(mlp_path, mlp_16, 2 * scale + 1, 20000)
            )
        for _ in range(args.rounds):
            rounds.setdefault("resnet50_c4", []).append(
                served(server, "resnet50", 4, n(100), p, resnet_x, timing_dir)
            )
            batch = max(1, round(rounds["resnet50_c4"][-1]["server"]["avg_batch_size"]))
            resnet_b = {"input": np.repeat(resnet_x["input"], batch, 0)}
            rounds.setdefault("raw_resnet50", []).append(
                raw_onnxruntime(resnet_path, resnet_b, 10 * scale + 2, 400)
            )
        for key, runs in rounds.items():
            runs.sort(key=lambda r: r["throughput_rps"])
            results[key] = runs[len(runs) // 2]
            results[key]["rounds_rps"] = [round(r["throughput_rps"], 1) for r in runs]
    finally:
        results["load_average_end"] = os.getloadavg()[0]
        results["load_averages"] = os.getloadavg()
        server.stop()

    print_report(results)
    print_memory(results.get("memory", []))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def print_report(r: dict) -> None:
    hi = r["mlp_c16_batching"]["concurrency"]  # 16 unless --high-concurrency (the keys keep "c16")
    header = (
        f"{'case':<34}{'req/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'batch':>7}{'queue':>8}{'in':>6}{'infer':>8}{'out':>6}"
        f"{'cpu:client':>11}{'triton':>7}{'stub':>7}{'execute':>8}{'model':>7}"
    )
    print(
        f"\nprotocol: {r['protocol']}   queue/in/infer/out: us per request (statistics API); cpu: us per request"
        " (execute/model: inside the stub, with --stub-timing)"
    )
    print(header)
    print("-" * len(header))
    for key, label in (
        ("floor_c1_nobatch", "floor (no model) c=1 no batching"),
        ("mlp_c1_batching", "served mlp c=1 dynamic batching"),
        ("mlp_c1_nobatch", "served mlp c=1 no batching"),
        ("floor_c16_batching", f"floor (no model) c={hi} batching"),
        ("mlp_c16_batching", f"served mlp c={hi} dynamic batching"),
        ("mlp_c16_nobatch", f"served mlp c={hi} no batching"),
        ("resnet50_c4", "served resnet50 c=4"),
    ):
        x, s = r[key], r[key]["server"]
        timed = f"{x['execute_cpu_us']:>8.0f}{x['executor_cpu_us']:>7.0f}" if "execute_cpu_us" in x else ""
        print(
            f"{label:<34}{x['throughput_rps']:>10.1f}{x['latency_ms']['p50']:>9.2f}{x['latency_ms']['p99']:>9.2f}"
            f"{s['avg_batch_size']:>7.2f}{s['queue_us']:>8.0f}{s['compute_input_us']:>6.0f}"
            f"{s['compute_infer_us']:>8.0f}{s['compute_output_us']:>6.0f}"
            f"{x['client_cpu_us']:>11.0f}{x['server_cpu_us']:>7.0f}{x['stub_cpu_us']:>7.0f}{timed}"
        )
    for key, label in (("raw_mlp_b1", "raw onnxruntime mlp b=1"), ("raw_mlp_b1_t1", "raw ... b=1, 1 thread"),
                       ("raw_mlp_b1_t1_cold", "raw ... b=1, 1 thread, cold cache"),
                       ("raw_mlp_b16", "raw onnxruntime mlp b=16"),
                       ("raw_resnet50", f"raw onnxruntime resnet50 b={r['raw_resnet50']['batch']}")):  # fmt: skip
        x = r[key]
        print(
            f"{label:<34}{x['throughput_rps']:>10.1f}{x['latency_ms']['p50']:>9.2f}{x['latency_ms']['p99']:>9.2f}"
            f"{x['batch']:>7}{'':>28}{'cpu/call':>11}{x['cpu_us_per_call']:>7.0f}"
        )

    p50 = {k: r[k]["latency_ms"]["p50"] for k in r if isinstance(r[k], dict) and "latency_ms" in r[k]}
    resnet_ratio = r["resnet50_c4"]["throughput_rps"] / r["raw_resnet50"]["throughput_rps"]
    batching_ratio = r["mlp_c16_batching"]["throughput_rps"] / r["mlp_c16_nobatch"]["throughput_rps"]
    of_raw = r["mlp_c16_batching"]["throughput_rps"] / r["raw_mlp_b16"]["throughput_rps"]
    added_p50 = p50["mlp_c1_nobatch"] - p50["raw_mlp_b1"]
    added_p50_batching = p50["mlp_c1_batching"] - p50["raw_mlp_b1"]
    added_p50_same_threads = p50["mlp_c1_nobatch"] - p50["raw_mlp_b1_t1"]
    # The floor answers without a model: its p50 is what Triton, the python backend and the client add
    # before any backend code or compute, and its c=16 rate is the most any python-backend model reaches.
    floor_p50 = p50["floor_c1_nobatch"]
    above_floor_p50 = p50["mlp_c1_nobatch"] - floor_p50 - p50["raw_mlp_b1_t1"]
    gain_ceiling = r["floor_c16_batching"]["throughput_rps"] / r["mlp_c16_nobatch"]["throughput_rps"]
    floor_of_raw = r["floor_c16_batching"]["throughput_rps"] / r["raw_mlp_b16"]["throughput_rps"]
    of_floor = r["mlp_c16_batching"]["throughput_rps"] / r["floor_c16_batching"]["throughput_rps"]
    floor_cpu = r["floor_c16_batching"]
    client_share = floor_cpu["client_cpu_us"] / (
        floor_cpu["client_cpu_us"] + floor_cpu["server_cpu_us"] + floor_cpu["stub_cpu_us"]
    )
    print()
    for label, value, unit, target, ok in (
        ("resnet50 served / raw (same batch)", resnet_ratio, "x ", ">= 0.95x", resnet_ratio >= 0.95),
        (f"mlp c={hi} batching / no batching", batching_ratio, "x ", ">= 3.60x", batching_ratio >= 3.6),
        (f"mlp c={hi} batching / raw b=16 rows/s", of_raw * 100, "% ", ">= 15 %", of_raw >= 0.15),
        ("added p50 latency, mlp c=1", added_p50, " ms", "<= 0.25 ms", added_p50 <= 0.25),
    ):
        print(f"{label + ':':<38}{value:6.2f}{unit:<4}target {target:<11}{'ok' if ok else 'MISSED'}")
    print(f"  (with dynamic batching, 100us queue delay: {added_p50_batching:.2f} ms)")
    print(
        f"  (against raw onnxruntime with the served config's one intra-op thread: {added_p50_same_threads:.2f} ms)"
    )
    print("the floor (python backend answering from memory, same configs, same client):")
    print(
        f"  floor p50 at c=1 without any model:           {floor_p50:6.2f} ms  (the added-p50 target is 0.25 ms)"
    )
    print(f"  GE p50 above floor + raw 1-thread compute:    {above_floor_p50:6.2f} ms")
    print(
        f"  ceiling of the batching gain (floor c={hi} / mlp c={hi} no batching): {gain_ceiling:.2f}x (target 3.6x)"
    )
    x = r["mlp_c1_nobatch"]
    if "executor_cpu_us" in x:
        print(
            f"  mlp compute per request at c=1, thread CPU: in the stub {x['executor_cpu_us']:.0f} us, raw 1 thread"
            f" {r['raw_mlp_b1_t1']['cpu_us_per_call']:.0f} us back to back,"
            f" {r['raw_mlp_b1_t1_cold']['cpu_us_per_call']:.0f} us with its weights evicted from the caches"
        )
        print(
            f"  stub CPU per request at c=1: {x['stub_cpu_us']:.0f} us = python backend outside execute()"
            f" {x['stub_cpu_us'] - x['execute_cpu_us']:.0f} + GE Python {x['execute_cpu_us'] - x['executor_cpu_us']:.0f}"
            f" + model {x['executor_cpu_us']:.0f}; the floor's stub: {r['floor_c1_nobatch']['stub_cpu_us']:.0f} us"
        )
    print(
        f"  floor c={hi} rate / raw onnxruntime b=16 rows/s:{floor_of_raw * 100:6.1f} %   (ceiling of the 15 % target)"
    )
    print(f"  GE mlp c={hi} rate / floor c={hi} rate:           {of_floor * 100:6.1f} %")
    print(f"  client's share of all CPU per request at floor c={hi}: {client_share * 100:.0f} %")
    print(f"load average (1, 5, 15 min) at the end: {', '.join(f'{v:.1f}' for v in r['load_averages'])}")
    print("req/s of every round (median reported above):")
    for key in ("floor_c16_batching", "mlp_c16_batching", "mlp_c16_nobatch", "resnet50_c4", "raw_resnet50"):
        print(f"  {key:<18} {r[key]['rounds_rps']}")
    r["summary"] = {"resnet50_ratio": resnet_ratio, "mlp_batching_ratio": batching_ratio,
                    "mlp_batching_of_raw_b16": of_raw, "added_p50_ms": added_p50,
                    "added_p50_batching_ms": added_p50_batching,
                    "added_p50_same_threads_ms": added_p50_same_threads,
                    "floor_p50_ms": floor_p50, "above_floor_p50_ms": above_floor_p50,
                    "batching_gain_ceiling": gain_ceiling,
                    "floor_c16_of_raw_b16": floor_of_raw, "mlp_c16_of_floor": of_floor,
                    "client_cpu_share_floor_c16": client_share}  # fmt: skip


def print_memory(figures: list[dict]) -> None:
    if not figures:
        return
    print(
        f"\nmemory (MiB): PSS per served model, copies of the MLP (model file {figures[0]['model_file_mib']:.1f} MiB)"
        " after one request each"
    )
    header = (
        f"{'models':>8}{'stub':>8}{'stub minus weights':>20}{'stub private':>14}{'server':>8}"
        f"{'(server+stubs)/model':>22}"
    )
    print(header)
    for f in figures:
        print(
            f"{f['models']:>8}{f['stub_pss_mib']:>8.1f}{f['stub_before_weights_mib']:>20.1f}"
            f"{f['stub_anonymous_mib']:>14.1f}{f['server_pss_mib']:>8.1f}{f['total_pss_mib']:>22.1f}"
        )
    # With few stubs their shared libraries' pages are split with whatever else maps them on the machine,
    # so the figure at the largest count is the one that says what one more model costs.
    last = max(figures, key=lambda f: f["models"])
    value = last["stub_before_weights_mib"]
    print(
        f"PSS per served small model (stub, before its weights, {last['models']} models): {value:.1f} MiB  "
        f"target <= 30 MiB {'ok' if value <= 30 else 'MISSED'}"
    )


if __name__ == "__main__":
    sys.exit(main())
