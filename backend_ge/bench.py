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
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

import numpy as np

from backend_ge.runtime import DEFAULT_HTTP_PORT

_NUMPY: dict[str, type] = {
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


_WIRE = {np.dtype(v): k for k, v in _NUMPY.items()}


def _http_get(url: str, path: str, timeout: float = 10.0, headers: Mapping[str, str] | None = None) -> dict:
    request = urllib.request.Request(f"http://{url}{path}", headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        raise BenchError(f"GET {path}: HTTP {e.code} {detail}") from None


def make_inputs(
    url: str, model: str, batch: int = 1, seed: int = 0, headers: Mapping[str, str] | None = None
) -> dict[str, np.ndarray]:
    """Random inputs shaped from the model's metadata; integer inputs stay small (valid token ids).
    ``headers``: sent with every call (an instance's key, where the server restricts its APIs)."""
    meta = _http_get(url, f"/v2/models/{model}", headers=headers)
    # The metadata API, not the config API: the config is part of an instance's control plane (it needs the
    # instance key), while metadata is what any client may read. Triton reports a batched model's inputs with
    # a leading -1 (the batch dimension).
    batched = all(spec["shape"] and spec["shape"][0] == -1 for spec in meta["inputs"])
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


class RawHttpClient:
    """Keep-alive HTTP/1.1 client that POSTs one pre-encoded KServe v2 binary request again and again.

    A generic client (tritonclient, http.client) spends ~200 us of CPU per request parsing headers; on a
    machine with few cores that time is taken from the server being measured, so the load generator sends
    bytes built once and parses only the status line and lengths of each reply.
    """

    def __init__(
        self, url: str, model: str, inputs: Mapping[str, np.ndarray], headers: Mapping[str, str] | None = None
    ) -> None:
        import tritonclient.http as httpclient

        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        if any(c in extra.replace("\r\n", "") for c in "\r\n"):
            raise BenchError("a header may not contain a line break")

        host, port = url.rsplit(":", 1)
        items = []
        for name, array in inputs.items():
            item = httpclient.InferInput(name, list(array.shape), _WIRE[np.dtype(array.dtype)])
            item.set_data_from_numpy(array)
            items.append(item)
        body, json_size = httpclient.InferenceServerClient.generate_request_body(items)
        head = (
            f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: {url}\r\n"
            f"Content-Type: application/octet-stream\r\nInference-Header-Content-Length: {json_size}\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n"
        )
        self._request = head.encode() + body
        self._sock = socket.create_connection((host, int(port)), timeout=120)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._pending = b""

    def infer(self) -> tuple[int, bytes, int | None]:
        """Send the request; return (HTTP status, body, inference header length)."""
        self._sock.sendall(self._request)
        buf = self._pending
        end = buf.find(b"\r\n\r\n")
        while end < 0:
            buf += self._recv()
            end = buf.find(b"\r\n\r\n")
        lines = buf[:end].decode("latin-1").split("\r\n")
        status, length, header_length = int(lines[0][9:12]), 0, None
        for line in lines[1:]:
            key, _, value = line.partition(":")
            key = key.strip().lower()
            if key == "content-length":
                length = int(value)
            elif key == "inference-header-content-length":
                header_length = int(value)
            elif key == "transfer-encoding":
                raise BenchError(f"unexpected Transfer-Encoding {value.strip()} from the server")
        rest = buf[end + 4 :]
        while len(rest) < length:
            rest += self._recv()
        self._pending = rest[length:]
        return status, rest[:length], header_length

    def _recv(self) -> bytes:
        chunk = self._sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("server closed the connection")
        return chunk

    def close(self) -> None:
        self._sock.close()


def _http_stream(url, model, inputs, headers=None):
    """Returns (infer, close) for one HTTP stream; the first reply is fully checked."""
    import tritonclient.http as httpclient

    client = RawHttpClient(url, model, inputs, headers)
    status, body, header_length = client.infer()
    if status != 200:
        raise BenchError(body.decode(errors="replace"))
    result = httpclient.InferResult.from_response_body(body, header_length=header_length)
    if not result.get_response().get("outputs"):
        raise BenchError(f"reply without outputs: {result.get_response()}")

    def infer() -> None:
        status, body, _ = client.infer()
        if status != 200:
            raise BenchError(body[:300].decode(errors="replace"))

    return infer, client.close


def _grpc_stream(url, model, inputs, headers=None):  # headers: HTTP only (``run`` refuses them)
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    items = []
    for name, array in inputs.items():
        item = grpcclient.InferInput(name, list(array.shape), _WIRE[np.dtype(array.dtype)])
        item.set_data_from_numpy(array)
        items.append(item)
    return (lambda: client.infer(model, items)), client.close


def _worker(url, protocol, model, inputs, count, warmup, ready, start, results, headers=None) -> None:
    try:
        infer, close = (_grpc_stream if protocol == "grpc" else _http_stream)(url, model, inputs, headers)
        for _ in range(warmup):
            infer()
    except Exception as e:  # the parent reports it instead of waiting for a stream that never starts
        ready.put(f"warm-up request failed: {e}")
        return
    ready.put(True)
    start.wait(60)
    errors, latencies = 0, []
    first = time.monotonic()
    cpu = time.process_time()
    for _ in range(count):
        t0 = time.monotonic()
        try:
            infer()
        except Exception:  # counted, not fatal: an overloaded server should show up as errors
            errors += 1
            continue
        latencies.append(time.monotonic() - t0)
    last = time.monotonic()
    cpu = time.process_time() - cpu
    close()
    results.put((first, last, latencies, errors, cpu))


def _stats(url: str, model: str, headers: Mapping[str, str] | None = None) -> dict:
    stats = _http_get(url, f"/v2/models/{model}/stats", headers=headers)["model_stats"]
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
    headers: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Run ``requests`` inferences from ``concurrency`` processes; return throughput, latency, server split.

    ``url`` is ``host:port`` for ``protocol``; ``stats_url`` is the HTTP ``host:port`` for the statistics
    API (defaults to ``url``, which must then be HTTP). ``headers`` go with every HTTP request (an instance
    key where the server restricts its APIs).
    """
    if headers and protocol == "grpc":
        raise BenchError("headers are sent over HTTP only")
    stats_url = stats_url or url
    inputs = dict(inputs) if inputs is not None else make_inputs(stats_url, model, headers=headers)
    ctx = mp.get_context("spawn")  # a fresh interpreter per stream: no inherited threads or client state
    ready, results, start = ctx.Queue(), ctx.Queue(), ctx.Event()
    counts = [requests // concurrency + (1 if i < requests % concurrency else 0) for i in range(concurrency)]
    procs = [
        ctx.Process(
            target=_worker,
            args=(url, protocol, model, inputs, n, warmup, ready, start, results, headers),
            daemon=True,
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
        before = _stats(stats_url, model, headers)
        start.set()
        outcomes = [results.get(timeout=max(1.0, deadline - time.monotonic())) for _ in procs]
        after = _stats(stats_url, model, headers)
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
        "client_cpu_us": sum(o[4] for o in outcomes) / done * 1e6 if done else float("nan"),
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
    parser.add_argument(
        "--url",
        default=f"127.0.0.1:{DEFAULT_HTTP_PORT}",
        help="HTTP host:port of the server (`serve`'s default)",
    )
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
