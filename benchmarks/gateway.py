"""What the inference gateway (HAProxy) adds: the MLP example called directly on Triton and through the
gateway, with the same client in the same run, at concurrency 1 and 16 (``--concurrency``).

The gateway runs the platform's real configuration (``apps.gateway.haproxy``: allow-list, token hash and map
lookup, team check, rate-limit table, version pinning, the instance-key header) with 10,000 tokens in its
map; Triton runs with every API but health restricted to its key, as the host agent starts it. Direct calls
send the key, gateway calls send a token (hashed once per connection, looked up on every request, as for any
keep-alive client).

Each client connection is kept alive and warmed up (20 requests) before it is measured, on both paths. The
paths are measured in interleaved rounds; the added p50 and the throughput ratio are the medians of each
round's own figures (the machine's load drifts between rounds, hardly within one pair). Reported: p50/p99
latency and throughput per path, the added p50 and the throughput ratio, the gateway's CPU per request
(``/proc/<pid>/stat`` of the HAProxy worker), and the token lookup cost (two gateways side by side, 1 token
vs 10,000 tokens in the map). Targets (issue 10): added p50 <= 0.2 ms at concurrency 1;
throughput >= 0.85x direct at concurrency 1 and >= 0.8x at 16.

``--protocol grpc`` measures the gateway's gRPC frontend the same way with ``tritonclient.grpc`` (its
generated stub, one channel per client process, the request message built once): direct to Triton's gRPC
port with the instance key, through the gateway with a token, and through a second gateway whose gRPC route
skips the body inspection (no wait for the body, no Lua action or filter: the model name is fixed in its
configuration) - a comparison that exists only inside this script, never in a configuration the platform
renders. The difference of the two gateways' CPU per request is what walking the message costs.

Usage: ``python benchmarks/gateway.py [--protocol http|grpc] [--requests 3000] [--rounds 5] [--threads 1]
[--json FILE] [--smoke]``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import secrets
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from apps.gateway.haproxy import GatewayState, Options, Route, Server, Slots, write_files  # noqa: E402
from apps.gateway.process import HAProxyProcess  # noqa: E402
from backend_ge import examples  # noqa: E402
from backend_ge.runtime import API_KEY_HEADER, GRPC_API_KEY_HEADER, TritonServer, free_port  # noqa: E402
from benchmarks import smoke  # noqa: E402

MODEL = "bench__mlp"


def request_bytes(port: int, extra_header: str) -> bytes:
    import tritonclient.http as httpclient

    data = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)
    item = httpclient.InferInput("input", list(data.shape), "FP32")
    item.set_data_from_numpy(data)
    body, json_size = httpclient.InferenceServerClient.generate_request_body([item])
    head = (
        f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{extra_header}\r\n"
        f"Content-Type: application/octet-stream\r\nInference-Header-Content-Length: {json_size}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def _stream(port: int, request: bytes, count: int, ready, start, results) -> None:
    """One keep-alive connection sending pre-built bytes (a generic client's header parsing would take the CPU
    the measured servers need on a 2-core machine); parses only the status line and the length."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    pending = b""

    def call() -> int:
        nonlocal pending
        sock.sendall(request)
        buf = pending
        while (end := buf.find(b"\r\n\r\n")) < 0:
            buf += sock.recv(1 << 16)
        head = buf[:end].decode("latin-1")
        length = int(
            next(
                line.split(":")[1] for line in head.split("\r\n") if line.lower().startswith("content-length")
            )
        )
        rest = buf[end + 4 :]
        while len(rest) < length:
            rest += sock.recv(1 << 16)
        pending = rest[length:]
        return int(head[9:12])

    for _ in range(20):
        if call() != 200:
            ready.put("warm-up request failed")
            return
    ready.put(True)
    start.wait(60)
    latencies, errors = [], 0
    first = time.perf_counter()
    for _ in range(count):
        t0 = time.perf_counter()
        if call() != 200:
            errors += 1
        latencies.append(time.perf_counter() - t0)
    results.put((first, time.perf_counter(), latencies, errors))
    sock.close()


def grpc_request(token_or_key: tuple[str, str]):
    """The MLP's ModelInferRequest (the [1, 256] FP32 input as raw bytes) and the metadata to send with it."""
    from tritonclient.grpc import service_pb2

    data = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    tensor = request.inputs.add(name="input", datatype="FP32", shape=list(data.shape))
    del tensor  # the data goes in raw_input_contents, as tritonclient sends it
    request.raw_input_contents.append(data.tobytes())
    return request.SerializeToString(), (token_or_key,)


def _grpc_stream(port: int, request: tuple[bytes, tuple], count: int, ready, start, results) -> None:
    """One client process: a gRPC channel and tritonclient.grpc's stub, one call at a time."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    body, metadata = request
    message = service_pb2.ModelInferRequest.FromString(body)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

    def call() -> bool:
        try:
            stub.ModelInfer(message, metadata=metadata, timeout=60)
        except grpc.RpcError:
            return False
        return True

    for _ in range(20):
        if not call():
            ready.put("warm-up request failed")
            return
    ready.put(True)
    start.wait(60)
    latencies, errors = [], 0
    first = time.perf_counter()
    for _ in range(count):
        t0 = time.perf_counter()
        if not call():
            errors += 1
        latencies.append(time.perf_counter() - t0)
    results.put((first, time.perf_counter(), latencies, errors))
    channel.close()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(port: int, request, concurrency: int, requests: int, cpu_pid: int | None = None) -> dict:
    ctx = mp.get_context("spawn")
    ready, results, start = ctx.Queue(), ctx.Queue(), ctx.Event()
    counts = [requests // concurrency] * concurrency
    target = _stream if isinstance(request, bytes) else _grpc_stream
    procs = [ctx.Process(target=target, args=(port, request, n, ready, start, results)) for n in counts]
    for proc in procs:
        proc.start()
    for _ in procs:
        status = ready.get(timeout=60)
        if status is not True:
            raise RuntimeError(status)
    cpu_before = cpu_seconds(cpu_pid) if cpu_pid else 0.0
    start.set()
    outcomes = [results.get(timeout=300) for _ in procs]
    cpu_after = cpu_seconds(cpu_pid) if cpu_pid else 0.0
    for proc in procs:
        proc.join(10)
    latencies = np.array([t for o in outcomes for t in o[2]]) * 1000
    duration = max(o[1] for o in outcomes) - min(o[0] for o in outcomes)
    done = len(latencies)
    return {
        "requests": done,
        "errors": sum(o[3] for o in outcomes),
        "throughput_rps": done / duration,
        "p50_ms": float(np.percentile(latencies, 50)),
        "p99_ms": float(np.percentile(latencies, 99)),
        "gateway_cpu_us_per_request": (cpu_after - cpu_before) / done * 1e6 if cpu_pid else None,
    }


SLOTS = Slots(64, {"s0": "d1"})  # as the platform renders it: a pool of slots, one taken


def gateway_state(
    key: str, triton_port: int, tokens: int, token: tuple[str, str], grpc_port: int = 0
) -> GatewayState:
    state = GatewayState(
        backends={"d1": (Server(key, "127.0.0.1", triton_port, grpc_port=grpc_port),)},
        checks={"d1": f"{MODEL}/versions/1"},
        routes={MODEL: Route("bench", "d1", 1)},
        limits={"bench": "1000000"},
    )
    for _ in range(tokens - 1):
        state.tokens[f"{secrets.token_hex(4)}:{hashlib.sha256(secrets.token_bytes(16)).hexdigest()}"] = (
            "other:0"
        )
    prefix, secret = token
    state.tokens[f"{prefix}:{hashlib.sha256(secret.encode()).hexdigest()}"] = "bench:32503680000"
    return state


def _median(runs: list[dict], key: str) -> float:
    return float(np.median([r[key] for r in runs]))


def compare(
    paths: dict[str, tuple[int, bytes, int | None]], concurrency: int, requests: int, rounds: int
) -> dict:
    """``rounds`` measurements of every path, interleaved (the order rotates each round, so a change of the
    machine's load during the run falls on every path alike). The ratios are the medians of each round's own
    ratios to the first path, measured seconds apart, not of medians taken minutes apart."""
    names = list(paths)
    rows: dict[str, list[dict]] = {name: [] for name in names}
    for index in range(rounds):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            port, request, pid = paths[name]
            rows[name].append(measure(port, request, concurrency, requests, cpu_pid=pid() if pid else None))
    base = names[0]
    summary: dict = {}
    for name, runs in rows.items():
        summary[name] = {k: _median(runs, k) for k in runs[0] if runs[0][k] is not None}
        if name != base:
            pairs = list(zip(rows[base], runs, strict=True))
            summary[name]["added_p50_ms"] = float(np.median([g["p50_ms"] - d["p50_ms"] for d, g in pairs]))
            summary[name]["throughput_ratio"] = float(
                np.median([g["throughput_rps"] / d["throughput_rps"] for d, g in pairs])
            )
    return summary


def concurrencies(text: str) -> list[int]:
    """``--concurrency`` as a list: "1,16" -> [1, 16]."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def without_body_inspection(config: str, options: Options) -> str:
    """The rendered configuration with the gRPC route's body inspection taken out (for the comparison run
    only): no wait for the body, no Lua action or filter, the model name fixed."""
    replacements = {
        "    filter lua.grpc_walk\n": "",
        "    http-request wait-for-body time 15s if !stream_call\n": "",
        f"    http-request lua.grpc_model {options.grpc_max_message} if model_call\n": (
            f"    http-request set-var(txn.model) str({MODEL}) if model_call\n"
        ),
    }
    for old, new in replacements.items():
        if old not in config:
            raise RuntimeError(f"the gRPC frontend no longer has {old.strip()!r}: update this benchmark")
        config = config.replace(old, new)
    return config


def start_gateway(
    directory: Path, state: GatewayState, threads: int, inspect: bool = True
) -> tuple[HAProxyProcess, int, int]:
    """A gateway on free ports: (process, HTTP port, gRPC port)."""
    port, grpc_port = free_port(), free_port()
    options = Options(
        directory=directory, bind=f"127.0.0.1:{port}", grpc_bind=f"127.0.0.1:{grpc_port}",
        stats_bind=f"127.0.0.1:{free_port()}", key_header=API_KEY_HEADER, grpc_key_header=GRPC_API_KEY_HEADER,
        default_limit=1_000_000, threads=threads,
    )  # fmt: skip
    write_files(state, SLOTS, options)
    if not inspect:
        options.config_file.write_text(without_body_inspection(options.config_file.read_text(), options))
    gateway = HAProxyProcess(options)
    gateway.start()
    return gateway, port, grpc_port


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000, help="requests per measurement")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians)")
    parser.add_argument("--threads", type=int, default=1, help="HAProxy threads (GATEWAY_THREADS)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--concurrency", type=concurrencies, default="1,16", help="client streams, e.g. 1,16")
    parser.add_argument("--protocol", choices=("http", "grpc"), default="http", help="the frontend measured")
    args = smoke.parse_args(parser, argv, requests=100, rounds=1, concurrency="1,2")

    work = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
    src = work / "src"
    examples.write_examples(src, ["mlp"])
    (src / "mlp").rename(src / MODEL)
    config = src / MODEL / "config.pbtxt"
    if config.exists():
        config.write_text(config.read_text().replace('name: "mlp"', f'name: "{MODEL}"'))
    from backend_ge.runtime import prepare_repository

    models, problems = prepare_repository(src, work / "repository")
    assert not problems, problems
    key = secrets.token_hex(24)
    server = TritonServer(work / "repository", workdir=work / "triton", api_key=key, open_apis=("health",),
                          load_models=models, exit_timeout=10, die_with_parent=True)  # fmt: skip
    server.start(timeout=120)
    token = (secrets.token_hex(4), secrets.token_urlsafe(32))
    report: dict = {"protocol": args.protocol, "threads": args.threads, "tokens_in_map": 10_000,
                    "requests": args.requests, "rounds": args.rounds, "runs": {}}  # fmt: skip
    try:
        if args.protocol == "grpc":
            run_grpc(args, work, server, key, token, report)
        else:
            run_http(args, work, server, key, token, report)
    finally:
        server.close()
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def run_http(args, work: Path, server: TritonServer, key: str, token: tuple[str, str], report: dict) -> None:
    gateways: list[HAProxyProcess] = []
    try:
        # The gateway measured, and (for the token lookup) the same gateway with 1 token in its map.
        gateway, port, _ = start_gateway(
            work / "gateway", gateway_state(key, server.http_port, 10_000, token), args.threads
        )
        gateways.append(gateway)
        small, small_port, _ = start_gateway(
            work / "gateway-1-token", gateway_state(key, server.http_port, 1, token), args.threads
        )
        gateways.append(small)  # fmt: skip
        direct = request_bytes(server.http_port, f"{API_KEY_HEADER}: {key}")
        through = request_bytes(port, f"Authorization: Bearer tgp_{token[0]}_{token[1]}")
        time.sleep(1.5)  # the health check marks the server UP
        for concurrency in args.concurrency:
            paths = {
                "direct": (server.http_port, direct, None),
                "gateway": (port, through, gateway.admin.worker_pid),
            }
            report["runs"][f"c{concurrency}"] = compare(paths, concurrency, args.requests, args.rounds)
        # Token lookup: 10,000 tokens in the map vs 1, the two gateways side by side.
        paths = {
            "1_token": (small_port, through, small.admin.worker_pid),
            "10000_tokens": (port, through, gateway.admin.worker_pid),
        }
        lookup = compare(paths, 1, args.requests, args.rounds)
        one, big = lookup["1_token"], lookup["10000_tokens"]
        report["token_lookup"] = {
            "p50_ms_1_token": one["p50_ms"],
            "p50_ms_10000_tokens": big["p50_ms"],
            "difference_us": big["added_p50_ms"] * 1000,
            # CPU is steadier than latency on a shared machine: the lookup's cost shows there first.
            "cpu_us_1_token": one["gateway_cpu_us_per_request"],
            "cpu_us_10000_tokens": big["gateway_cpu_us_per_request"],
        }
    finally:
        for gateway in gateways:
            gateway.stop()
    print_runs(report)
    t = report["token_lookup"]
    print(
        f"token lookup: p50 {t['p50_ms_1_token']:.3f} ms with 1 token, {t['p50_ms_10000_tokens']:.3f} ms with "
        f"10,000 ({t['difference_us']:+.1f} us); gateway CPU {t['cpu_us_1_token']:.1f} vs "
        f"{t['cpu_us_10000_tokens']:.1f} us/request"
    )


def run_grpc(args, work: Path, server: TritonServer, key: str, token: tuple[str, str], report: dict) -> None:
    gateways: list[HAProxyProcess] = []
    state = gateway_state(key, server.http_port, 10_000, token, grpc_port=server.grpc_port)
    try:
        gateway, _, grpc_port = start_gateway(work / "gateway", state, args.threads)
        gateways.append(gateway)
        plain, _, plain_port = start_gateway(
            work / "gateway-no-inspection", state, args.threads, inspect=False
        )
        gateways.append(plain)
        direct = grpc_request((GRPC_API_KEY_HEADER, key))
        through = grpc_request(("authorization", f"Bearer tgp_{token[0]}_{token[1]}"))
        time.sleep(1.5)  # the health check marks the server UP
        for concurrency in args.concurrency:
            paths = {
                "direct": (server.grpc_port, direct, None),
                "gateway": (grpc_port, through, gateway.admin.worker_pid),
                "no_inspection": (plain_port, through, plain.admin.worker_pid),
            }
            report["runs"][f"c{concurrency}"] = compare(paths, concurrency, args.requests, args.rounds)
    finally:
        for gateway in gateways:
            gateway.stop()
    print_runs(report)
    for name, run in report["runs"].items():
        g, n = run["gateway"], run["no_inspection"]
        print(
            f"{name} body inspection: gateway CPU {g['gateway_cpu_us_per_request']:.1f} us/request with it, "
            f"{n['gateway_cpu_us_per_request']:.1f} without ({g['gateway_cpu_us_per_request'] - n['gateway_cpu_us_per_request']:+.1f}); "
            f"added p50 {g['added_p50_ms']:.3f} vs {n['added_p50_ms']:.3f} ms"
        )


def print_runs(report: dict) -> None:
    protocol = report["protocol"]
    for name, run in report["runs"].items():
        d, g = run["direct"], run["gateway"]
        print(
            f"{name}: direct {d['throughput_rps']:.0f} req/s p50 {d['p50_ms']:.3f} ms | gateway "
            f"{g['throughput_rps']:.0f} req/s p50 {g['p50_ms']:.3f} ms | added p50 {g['added_p50_ms']:.3f} ms, "
            f"throughput {g['throughput_ratio']:.2f}x, gateway CPU {g['gateway_cpu_us_per_request']:.1f} us/request"
            f" ({protocol}; errors {int(d['errors'])} direct, {int(g['errors'])} gateway)"
        )
        targets = []
        if name == "c1":
            targets.append(f"added p50 <= 0.2 ms: {'met' if g['added_p50_ms'] <= 0.2 else 'MISSED'}")
        floor = {"c1": 0.85, "c16": 0.8}.get(name)
        if floor:
            targets.append(f"throughput >= {floor}x: {'met' if g['throughput_ratio'] >= floor else 'MISSED'}")
        if targets:
            print(f"  targets {name}: " + "; ".join(targets))


if __name__ == "__main__":
    raise SystemExit(main())
