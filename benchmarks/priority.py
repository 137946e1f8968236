"""Priority classes under saturation: an interactive client's latency alone, then beside a batch client that
saturates the model, with classes and without.

The MLP example on a real tritonserver, behind the platform's real
gateway configuration (``apps.gateway.haproxy``) with ``maxconn`` per server (``GATEWAY_SERVER_MAXCONN``):
beyond it requests wait in the gateway's queue. Two gateways side by side on the same Triton:

* with classes: the batch token's class is ``batch`` (HAProxy queues it behind interactive requests) and the
  version's levels are in ``priority.map`` (the gateway writes Triton's ``priority`` parameter: interactive 1,
  batch 2, so Triton's batcher takes interactive requests first too);
* without classes: both tokens are interactive and no level is written - one queue, first come first served.

``--triton-levels`` gives the model's config ``priority_levels: 2`` (requests naming no level are level 2).
Measured on Triton 2.51 (2026-12-06, maxconn 4, 24 batch streams): with levels, Triton's dynamic batcher itself
holds some requests ~500 ms under this load (HAProxy's log shows the time in Triton's answer, with classes and
without), so the interactive p99 is ~500 ms either way; the same model without levels does not. The default
run therefore measures the gateway's queue by class on a model without levels.

Rounds interleave the three scenarios (alone, with classes, without); the figures are the medians of the
rounds' own p99s. The interactive client is one keep-alive connection sending a request every ``--gap-ms``;
the batch client is ``--batch-streams`` connections sending back to back. Every load is bounded in requests
and time. Target (issue 36): the interactive p99 with classes within 1.5x of its p99 alone.

Usage: ``python benchmarks/priority.py [--requests 300] [--rounds 3] [--batch-streams 24] [--maxconn 4]
[--triton-levels] [--json FILE] [--smoke]``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import secrets
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from apps.core import priority  # noqa: E402
from apps.gateway.haproxy import GatewayState, Options, Route, Server, Slots, write_files  # noqa: E402
from apps.gateway.process import HAProxyProcess  # noqa: E402
from backend_ge import examples  # noqa: E402
from backend_ge.runtime import API_KEY_HEADER, GRPC_API_KEY_HEADER, TritonServer, free_port  # noqa: E402
from benchmarks import smoke  # noqa: E402
from benchmarks.gateway import MODEL, request_bytes  # noqa: E402

SLOTS = Slots(64, {"s0": "d1"})
NEVER = 32503680000
TARGET_RATIO = 1.5


def gateway_state(
    key: str, triton_port: int, tokens: dict[str, tuple[str, str]], levels: bool
) -> GatewayState:
    """``tokens``: class -> (prefix, secret) of the token that sends with it."""
    state = GatewayState(
        backends={"d1": (Server(key, "127.0.0.1", triton_port),)},
        checks={"d1": f"{MODEL}/versions/1"},
        routes={MODEL: Route("bench", "d1", 1)},
        limits={"bench": "1000000"},
        priority_levels={f"{MODEL}/1": "2"} if levels else {},  # read only where the config has levels
    )
    for pclass, (prefix, secret) in tokens.items():
        state.tokens[f"{prefix}:{hashlib.sha256(secret.encode()).hexdigest()}"] = f"bench:{NEVER}:{pclass}"
    return state


def start_gateway(directory: Path, state: GatewayState, maxconn: int) -> tuple[HAProxyProcess, int]:
    port = free_port()
    options = Options(
        directory=directory, bind=f"127.0.0.1:{port}", grpc_bind=f"127.0.0.1:{free_port()}",
        stats_bind=f"127.0.0.1:{free_port()}", key_header=API_KEY_HEADER, grpc_key_header=GRPC_API_KEY_HEADER,
        default_limit=1_000_000, server_maxconn=maxconn,
    )  # fmt: skip
    write_files(state, SLOTS, options)
    gateway = HAProxyProcess(options)
    gateway.start()
    return gateway, port


def _call(sock: socket.socket, request: bytes, pending: bytes) -> tuple[int, bytes]:
    sock.sendall(request)
    buf = pending
    while (end := buf.find(b"\r\n\r\n")) < 0:
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("the gateway closed the connection")
        buf += chunk
    head = buf[:end].decode("latin-1")
    length = int(
        next(line.split(":")[1] for line in head.split("\r\n") if line.lower().startswith("content-length"))
    )
    rest = buf[end + 4 :]
    while len(rest) < length:
        rest += sock.recv(1 << 16)
    return int(head[9:12]), rest[length:]


def client(port: int, request: bytes, count: int, gap_s: float, deadline: float, stop, results) -> None:
    """One keep-alive connection: up to ``count`` requests (``gap_s`` apart), until ``stop`` or ``deadline``
    (a monotonic time); puts (latencies in s, errors)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    latencies, errors, pending = [], 0, b""
    try:
        for _ in range(count):
            if (stop is not None and stop.is_set()) or time.monotonic() > deadline:
                break
            t0 = time.perf_counter()
            status, pending = _call(sock, request, pending)
            latencies.append(time.perf_counter() - t0)
            errors += status != 200
            if gap_s:
                time.sleep(gap_s)
    except OSError:
        errors += 1
    finally:
        sock.close()
    results.put((latencies, errors))


def scenario(port: int, interactive: bytes, batch: bytes | None, args) -> dict:
    """The interactive client's figures, beside ``args.batch_streams`` batch clients when ``batch`` is given."""
    ctx = mp.get_context("fork")
    stop, results = ctx.Event(), ctx.Queue()
    deadline = time.monotonic() + args.max_seconds
    loaders = []
    if batch is not None:
        for _ in range(args.batch_streams):
            loader = ctx.Process(target=client, args=(port, batch, 10**6, 0.0, deadline, stop, results))
            loader.start()
            loaders.append(loader)
        time.sleep(args.warmup_s)  # the queue fills
    interactive_results = ctx.Queue()
    measured = ctx.Process(
        target=client,
        args=(port, interactive, args.requests, args.gap_ms / 1000, deadline, None, interactive_results),
    )
    started = time.perf_counter()
    measured.start()
    latencies, errors = interactive_results.get(timeout=args.max_seconds + 30)
    elapsed = time.perf_counter() - started
    measured.join(10)
    stop.set()
    batch_done, batch_errors = 0, 0
    for _ in loaders:
        done, failed = results.get(timeout=60)
        batch_done, batch_errors = batch_done + len(done), batch_errors + failed
    for loader in loaders:
        loader.join(10)
    ms = np.array(latencies) * 1000 if latencies else np.array([float("nan")])
    return {
        "requests": len(latencies),
        "errors": errors,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "batch_requests": batch_done,
        "batch_errors": batch_errors,
        "batch_rps": batch_done / elapsed if loaders else 0.0,
    }


def prepare(work: Path, triton_levels: bool) -> tuple[TritonServer, str]:
    src = work / "src"
    examples.write_examples(src, ["mlp"])
    (src / "mlp").rename(src / MODEL)
    config = src / MODEL / "config.pbtxt"
    text = config.read_text().replace('name: "mlp"', f'name: "{MODEL}"')
    # Two levels; requests naming none are level 2, like the batch class.
    if triton_levels:
        text = text.replace(
            "dynamic_batching {\n", "dynamic_batching {\n  priority_levels: 2\n  default_priority_level: 2\n"
        )
    config.write_text(text)
    from backend_ge.runtime import prepare_repository

    models, problems = prepare_repository(src, work / "repository")
    assert not problems, problems
    key = secrets.token_hex(24)
    server = TritonServer(work / "repository", workdir=work / "triton", api_key=key, open_apis=("health",),
                          load_models=models, exit_timeout=10, die_with_parent=True)  # fmt: skip
    server.start(timeout=120)
    return server, key


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="interactive requests per scenario")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    parser.add_argument("--batch-streams", type=int, default=24, help="batch client connections")
    parser.add_argument("--maxconn", type=int, default=4, help="GATEWAY_SERVER_MAXCONN of both gateways")
    parser.add_argument(
        "--gap-ms", type=float, default=5.0, help="the interactive client's pause between requests"
    )
    parser.add_argument(
        "--warmup-s", type=float, default=1.0, help="batch load before the interactive client starts"
    )
    parser.add_argument("--max-seconds", type=float, default=120.0, help="bound on each scenario")
    parser.add_argument(
        "--triton-levels",
        action="store_true",
        help="give the model priority_levels 2, so the gateway writes Triton's priority parameter too",
    )
    parser.add_argument("--json", type=Path)
    args = smoke.parse_args(
        parser, argv, requests=40, rounds=1, batch_streams=6, warmup_s=0.5, max_seconds=30.0
    )

    work = Path(tempfile.mkdtemp(prefix="priority-bench-"))
    server, key = prepare(work, args.triton_levels)
    tokens = {name: (secrets.token_hex(4), secrets.token_urlsafe(32)) for name in priority.CLASSES}
    requests = {
        name: request_bytes(0, f"Authorization: Bearer tgp_{prefix}_{secret}")
        for name, (prefix, secret) in tokens.items()
    }
    gateways: list[HAProxyProcess] = []
    rows: dict[str, list[dict]] = {"alone": [], "with_classes": [], "without_classes": []}
    try:
        classes, classes_port = start_gateway(
            work / "with", gateway_state(key, server.http_port, tokens, levels=True), args.maxconn
        )
        gateways.append(classes)
        # Without classes: the batch token is interactive too, and no level is written.
        same = {name: tokens[name] for name in priority.CLASSES}
        fifo_state = gateway_state(key, server.http_port, {}, levels=False)
        for prefix, secret in same.values():
            fifo_state.tokens[f"{prefix}:{hashlib.sha256(secret.encode()).hexdigest()}"] = (
                f"bench:{NEVER}:{priority.INTERACTIVE}"
            )
        fifo, fifo_port = start_gateway(work / "without", fifo_state, args.maxconn)
        gateways.append(fifo)
        time.sleep(1.5)  # health checks mark the servers UP
        interactive, batch = requests[priority.INTERACTIVE], requests[priority.BATCH]
        plan = [
            ("alone", classes_port, None),
            ("with_classes", classes_port, batch),
            ("without_classes", fifo_port, batch),
        ]
        for index in range(args.rounds):
            for name, port, load in plan[index % 3 :] + plan[: index % 3]:
                rows[name].append(scenario(port, interactive, load, args))
    finally:
        for gateway in gateways:
            gateway.stop()
        server.close()

    def median(name: str, key: str) -> float:
        return float(np.median([r[key] for r in rows[name]]))

    report = {
        "model": "mlp" + (" (priority_levels 2)" if args.triton_levels else ""),
        "maxconn": args.maxconn,
        "batch_streams": args.batch_streams,
        "interactive_requests": args.requests,
        "rounds": args.rounds,
        "alone_p99_ms": median("alone", "p99_ms"),
        "with_classes_p99_ms": median("with_classes", "p99_ms"),
        "without_classes_p99_ms": median("without_classes", "p99_ms"),
        "runs": rows,
    }
    report["with_classes_over_alone"] = report["with_classes_p99_ms"] / report["alone_p99_ms"]
    report["without_classes_over_alone"] = report["without_classes_p99_ms"] / report["alone_p99_ms"]
    for name in rows:
        print(
            f"{name}: interactive p50 {median(name, 'p50_ms'):.2f} ms p99 {median(name, 'p99_ms'):.2f} ms "
            f"({sum(r['errors'] for r in rows[name])} errors); batch {median(name, 'batch_rps'):.0f} req/s "
            f"({sum(r['batch_errors'] for r in rows[name])} errors)"
        )
    met = "met" if report["with_classes_over_alone"] <= TARGET_RATIO else "MISSED"
    print(
        f"interactive p99 with classes / alone: {report['with_classes_over_alone']:.2f}x, without classes / alone: "
        f"{report['without_classes_over_alone']:.2f}x; target <= {TARGET_RATIO}x: {met}"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    errors = sum(r["errors"] for runs in rows.values() for r in runs)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
