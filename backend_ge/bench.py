"""Load generator for a served model (the seed's ``benchmark.py``).

Each concurrent stream is its own process with its own client, sending requests back to back, so the
generator never competes with itself for one interpreter lock. Besides client-side throughput and latency
percentiles it reads Triton's statistics API before and after the run and reports the server-side split:
queue time vs compute (input, infer, output) per request and the average dynamic batch size.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import queue
import sys
import time
import urllib.request
from collections.abc import Mapping
from typing import Any

import numpy as np

_NUMPY = {
    "FP32": np.float32,
    "FP16": np.float16,
    "INT8": np.int8,
    "UINT8": np.uint8,
    "INT32": np.int32,
    "INT64": np.int64,
    "BOOL": np.bool_,
}


class BenchError(RuntimeError):
    """The load could not be generated (model missing, warm-up failed, workers timed out)."""


def _http_get(url: str, path: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(f"http://{url}{path}", timeout=timeout) as resp:
        return json.loads(resp.read())


def make_inputs(url: str, model: str, batch: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs shaped from the model's metadata; integer inputs stay small (valid token ids)."""
    meta = _http_get(url, f"/v2/models/{model}")
    config = _http_get(url, f"/v2/models/{model}/config")
    batched = int(config.get("max_batch_size", 0)) > 0
    rng = np.random.default_rng(seed)
    inputs = {}
    for spec in meta["inputs"]:
        dtype = _NUMPY.get(spec["datatype"])
        if dtype is None:
            raise ValueError(
                f"input {spec['name']} has datatype {spec['datatype']}, not supported by the bench"
            )
        shape = [1 if d < 0 else d for d in spec["shape"]]
        if batched:
            shape[0] = batch
        if np.issubdtype(dtype, np.floating):
            inputs[spec["name"]] = rng.standard_normal(shape).astype(dtype)
        elif dtype is np.bool_:
            inputs[spec["name"]] = rng.integers(0, 2, shape).astype(bool)
        else:
            inputs[spec["name"]] = rng.integers(0, 100, shape).astype(dtype)
    return inputs


def _worker(url, protocol, model, inputs, count, warmup, ready, start, results) -> None:
    if protocol == "grpc":
        import tritonclient.grpc as client_module
    else:
        import tritonclient.http as client_module
    client = client_module.InferenceServerClient(url)
    wire = {np.dtype(v).str: k for k, v in _NUMPY.items()}
    infer_inputs = []
    for name, array in inputs.items():
        item = client_module.InferInput(name, list(array.shape), wire[array.dtype.str])
        item.set_data_from_numpy(array)
        infer_inputs.append(item)
    errors = 0
    try:
        for _ in range(warmup):
            client.infer(model, infer_inputs)
    except Exception as e:  # the parent reports it instead of waiting for a stream that never starts
        ready.put(f"warm-up request failed: {e}")
        return
    ready.put(True)
    start.wait(60)
    latencies = []
    first = time.monotonic()
    for _ in range(count):
        t0 = time.monotonic()
        try:
            client.infer(model, infer_inputs)
        except Exception:  # counted, not fatal: an overloaded server should show up as errors
            errors += 1
            continue
        latencies.append(time.monotonic() - t0)
    last = time.monotonic()
    client.close()
    results.put((first, last, latencies, errors))


def _stats(url: str, model: str) -> dict:
    stats = _http_get(url, f"/v2/models/{model}/stats")["model_stats"]
    return stats[0] if stats else {}


def _server_split(before: Mapping, after: Mapping) -> dict[str, float]:
    def diff(*keys: str) -> float:
        a, b = after, before
        for k in keys:
            a, b = a.get(k, {}), b.get(k, {})
        return float(a or 0) - float(b or 0)

    inferences = diff("inference_count")
    executions = diff("execution_count")
    successes = diff("inference_stats", "success", "count") or 1.0
    per = {}
    for part in ("queue", "compute_input", "compute_infer", "compute_output"):
        # Triton reports each part summed over requests, so dividing by successful requests gives per request.
        per[f"{part}_us"] = diff("inference_stats", part, "ns") / successes / 1000.0
    return {
        "inference_count": inferences,
        "execution_count": executions,
        "avg_batch_size": inferences / executions if executions else 0.0,
        **per,
    }


def run(
    url: str,
    model: str,
    *,
    concurrency: int = 1,
    requests: int = 100,
    protocol: str = "http",
    stats_url: str | None = None,
    inputs: Mapping[str, np.ndarray] | None = None,
    warmup: int = 2,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Run ``requests`` inferences from ``concurrency`` processes; return throughput, latency, server split.

    ``url`` is ``host:port`` for ``protocol``; ``stats_url`` is the HTTP ``host:port`` for the statistics
    API (defaults to ``url``, which must then be HTTP).
    """
    stats_url = stats_url or url
    inputs = dict(inputs) if inputs is not None else make_inputs(stats_url, model)
    ctx = mp.get_context("spawn")  # a fresh interpreter per stream: no inherited threads or client state
    ready, results, start = ctx.Queue(), ctx.Queue(), ctx.Event()
    counts = [requests // concurrency + (1 if i < requests % concurrency else 0) for i in range(concurrency)]
    procs = [
        ctx.Process(
            target=_worker, args=(url, protocol, model, inputs, n, warmup, ready, start, results), daemon=True
        )
        for n in counts
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        for _ in procs:
            status = ready.get(timeout=max(1.0, deadline - time.monotonic()))
            if status is not True:
                raise BenchError(status)
        before = _stats(stats_url, model)
        start.set()
        outcomes = [results.get(timeout=max(1.0, deadline - time.monotonic())) for _ in procs]
        after = _stats(stats_url, model)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    latencies = np.array([t for o in outcomes for t in o[2]]) * 1000.0
    errors = sum(o[3] for o in outcomes)
    duration = max(o[1] for o in outcomes) - min(o[0] for o in outcomes)
    done = len(latencies)
    pct = (lambda q: float(np.percentile(latencies, q))) if done else (lambda q: float("nan"))
    return {
        "model": model,
        "protocol": protocol,
        "concurrency": concurrency,
        "requests": requests,
        "completed": done,
        "errors": errors,
        "duration_s": duration,
        "throughput_rps": done / duration if duration > 0 else 0.0,
        "latency_ms": {
            "p50": pct(50),
            "p90": pct(90),
            "p99": pct(99),
            "mean": float(latencies.mean()) if done else float("nan"),
        },
        "server": _server_split(before, after),
    }


def format_report(result: Mapping[str, Any]) -> str:
    """The seed's benchmark output plus the server-side split."""
    lat, srv = result["latency_ms"], result["server"]
    lines = [
        f"Model: {result['model']}  concurrency: {result['concurrency']}  requests: {result['completed']}"
        f" ok, {result['errors']} failed",
        f"Throughput: {result['throughput_rps']:.1f} req/s",
        f"Latency (p50): {lat['p50']:.2f}ms",
        f"Latency (p90): {lat['p90']:.2f}ms",
        f"Latency (p99): {lat['p99']:.2f}ms",
        f"Server per request: queue {srv['queue_us']:.0f}us, compute input {srv['compute_input_us']:.0f}us,"
        f" infer {srv['compute_infer_us']:.0f}us, output {srv['compute_output_us']:.0f}us",
        f"Average batch size: {srv['avg_batch_size']:.2f} ({srv['inference_count']:.0f} inferences in"
        f" {srv['execution_count']:.0f} executions)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m backend_ge bench``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m backend_ge bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--url", default="127.0.0.1:8000", help="HTTP host:port of the server")
    parser.add_argument("--grpc-url", default="", help="send inferences over gRPC to this host:port")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    if args.concurrency < 1 or args.requests < args.concurrency:
        parser.error("--concurrency must be >= 1 and --requests >= --concurrency")
    try:
        result = run(
            args.grpc_url or args.url,
            args.model,
            concurrency=args.concurrency,
            requests=args.requests,
            protocol="grpc" if args.grpc_url else "http",
            stats_url=args.url,
        )
    except (OSError, ValueError, BenchError, queue.Empty) as e:
        print(f"bench failed: {e or type(e).__name__}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    return 0 if result["errors"] == 0 else 1
