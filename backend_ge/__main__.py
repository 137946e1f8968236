"""``python -m backend_ge``: serve a model repository, convert models, benchmark, write example models, check
an NPU host (``npu-check``)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path

from backend_ge.runtime import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, DEFAULT_METRICS_PORT


def _serve(args: argparse.Namespace) -> int:
    from backend_ge import runtime

    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="ge-serve-"))
    repository = workdir / "repository"
    try:
        models, problems = runtime.prepare_repository(args.model_repository, repository)
    except runtime.TritonError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, problem in problems.items():
        print(f"skipping {name}: {problem}", file=sys.stderr)

    server = runtime.TritonServer(
        repository,
        workdir=workdir,
        address=args.address,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        api_key=os.environ.get("GE_REPOSITORY_KEY") or None,
        # The seed's clients and the bench read model configs; repository, logging, trace and shared
        # memory still need the key.
        open_apis=(*runtime.DEFAULT_OPEN_APIS, "model-config"),
        die_with_parent=True,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.start(timeout=args.start_timeout)
    except runtime.TritonError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        failures = runtime.load_all(server, models)
        for name in models:
            status = f"FAILED: {failures[name]}" if name in failures else "READY"
            print(f"{name}: {status}", flush=True)
        print(
            f"Serving HTTP {server.http_url}  gRPC {server.grpc_url}  metrics {server.metrics_url}\n"
            f"log: {server.log_path}  (Ctrl-C stops)",
            flush=True,
        )
        while not stop.wait(0.5):
            if server.process is not None and server.process.poll() is not None:
                print(
                    f"tritonserver exited ({server.process.returncode}):\n{server.log_tail()}",
                    file=sys.stderr,
                )
                return 1
    finally:
        code = server.stop()
        print(f"tritonserver stopped ({code})", flush=True)
    return 0


def _examples(args: argparse.Namespace) -> int:
    from backend_ge import examples

    try:
        written = examples.write_examples(args.directory, args.only or examples.ALL)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name in written:
        print(Path(args.directory) / name)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # convert and bench own their options; hand them the rest of the command line untouched.
    if argv and argv[0] == "convert":
        from backend_ge import convert

        return convert.main(argv[1:]) or 0
    if argv and argv[0] == "bench":
        from backend_ge import bench

        return bench.main(argv[1:])
    if argv and argv[0] == "npu-check":
        from backend_ge import npucheck

        return npucheck.main(argv[1:])

    parser = argparse.ArgumentParser(prog="python -m backend_ge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run tritonserver with the GE backend on a model repository")
    serve.add_argument("--model-repository", required=True)
    serve.add_argument("--address", default="127.0.0.1", help="bind address (default: loopback only)")
    serve.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT, help="0 picks a free port")
    serve.add_argument("--grpc-port", type=int, default=DEFAULT_GRPC_PORT)
    serve.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT)
    serve.add_argument("--workdir", default="", help="where the backends, repository copy and log go")
    serve.add_argument("--start-timeout", type=float, default=60.0)
    serve.set_defaults(func=_serve)
    ex = sub.add_parser("examples", help="write the example model repository")
    ex.add_argument("directory")
    ex.add_argument("--only", nargs="*", help="write only these models")
    ex.set_defaults(func=_examples)
    sub.add_parser("convert", help="convert a model (ATC to .om, or ONNX preparation); see convert --help")
    sub.add_parser("bench", help="load-test a served model; see bench --help")
    sub.add_parser("npu-check", help="validate this Ascend host end to end; see npu-check --help")
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
