"""What Triton's per-version latency percentiles cost: the MLP example on two tritonservers started the same
way, one with ``--metrics-config=summary_latencies=true`` (an instance's ``latency_summaries``, what a rollout's
p99 gate reads) and one without, measured alternately with the same raw keep-alive client in the same run.

Reported per concurrency: throughput and p50/p99 of each server (medians of the rounds), the throughput ratio,
the added p50, and tritonserver's CPU per request (``/proc/<pid>/stat``). Bounded: ``--requests`` per
measurement, ``--rounds`` rounds.

Usage: ``python benchmarks/latency_summaries.py [--requests 3000] [--rounds 3] [--concurrency 1,8] [--json FILE]
[--smoke]``
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gateway import MODEL, concurrencies, measure, request_bytes  # noqa: E402

from backend_ge import examples  # noqa: E402
from backend_ge.runtime import API_KEY_HEADER, TritonServer, prepare_repository  # noqa: E402
from benchmarks import smoke  # noqa: E402


def start_server(work: Path, name: str, models: list[str], summaries: bool) -> TritonServer:
    extra = ["--metrics-config=summary_latencies=true"] if summaries else []
    server = TritonServer(
        work / "repository", workdir=work / name, api_key=secrets.token_hex(24), open_apis=("health", "inference"),
        load_models=models, exit_timeout=10, die_with_parent=True, extra_args=extra,
    )  # fmt: skip
    return server.start(timeout=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000, help="requests per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (median)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--concurrency", type=concurrencies, default="1,8", help="client streams, e.g. 1,8")
    args = smoke.parse_args(parser, argv, requests=100, rounds=1, concurrency="1,2")

    work = Path(tempfile.mkdtemp(prefix="summaries-bench-"))
    src = work / "src"
    examples.write_examples(src, ["mlp"])
    (src / "mlp").rename(src / MODEL)
    config = src / MODEL / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "mlp"', f'name: "{MODEL}"'))
    models, problems = prepare_repository(src, work / "repository")
    assert not problems, problems
    servers = {
        "without": start_server(work, "plain", models, False),
        "with": start_server(work, "summaries", models, True),
    }
    report: dict = {"requests": args.requests, "rounds": args.rounds, "runs": {}}
    try:
        for concurrency in args.concurrency:
            rows: dict[str, list[dict]] = {"without": [], "with": []}
            for _ in range(args.rounds):
                for label, server in servers.items():
                    request = request_bytes(server.http_port, f"{API_KEY_HEADER}: {server.api_key}")
                    rows[label].append(
                        measure(
                            server.http_port, request, concurrency, args.requests, cpu_pid=server.process.pid
                        )
                    )
            summary = {
                label: {k: float(np.median([r[k] for r in runs])) for k in runs[0] if runs[0][k] is not None}
                for label, runs in rows.items()
            }
            plain, with_summaries = summary["without"], summary["with"]
            summary["throughput_ratio"] = with_summaries["throughput_rps"] / plain["throughput_rps"]
            summary["added_p50_ms"] = with_summaries["p50_ms"] - plain["p50_ms"]
            summary["added_server_cpu_us_per_request"] = (
                with_summaries["gateway_cpu_us_per_request"] - plain["gateway_cpu_us_per_request"]
            )
            report["runs"][f"concurrency_{concurrency}"] = summary
            print(
                f"concurrency {concurrency}: without {plain['throughput_rps']:.0f} req/s p50 {plain['p50_ms']:.3f} ms "
                f"p99 {plain['p99_ms']:.3f} ms, tritonserver CPU {plain['gateway_cpu_us_per_request']:.0f} us/req; "
                f"with summaries {with_summaries['throughput_rps']:.0f} req/s p50 {with_summaries['p50_ms']:.3f} ms "
                f"p99 {with_summaries['p99_ms']:.3f} ms, {with_summaries['gateway_cpu_us_per_request']:.0f} us/req; "
                f"ratio {summary['throughput_ratio']:.3f}, added p50 {summary['added_p50_ms'] * 1000:+.0f} us, "
                f"added CPU {summary['added_server_cpu_us_per_request']:+.0f} us/req"
            )
    finally:
        for server in servers.values():
            server.stop()
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
