"""``python -m backend_ge npu-check``: the whole NPU path on this host, one table, one JSON report.

Exit status: 0 every step passed; 1 a step failed or was skipped; 2 the host lacks a prerequisite (each
missing item is printed on its own line) or the command line is wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from backend_ge import fakes
from backend_ge.npucheck import environment
from backend_ge.npucheck.benchmark import run_benchmark
from backend_ge.npucheck.compile import compile_model, write_source
from backend_ge.npucheck.models import BENCH_MODEL, MODELS, SEED_IMG_S, UNBATCHED_SUFFIX
from backend_ge.npucheck.report import (
    EXIT_MISSING,
    FAIL,
    PASS,
    SKIP,
    StepResult,
    overall_exit_code,
    render_table,
    steps_json,
    write_json,
)
from backend_ge.npucheck.verify import (
    Compiled,
    check_executors,
    check_triton_model,
    start_triton,
    write_repository,
)
from backend_ge.runtime import TritonError

FAKE_BANNER = (
    "FAKE RUN (--fake): recorded ATC runs and npu-smi tables, the fake pyACL computing with onnxruntime "
    "on this CPU. It tests the command itself; nothing here ran on an NPU."
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m backend_ge npu-check", description=__doc__.split("\n")[0])
    p.add_argument(
        "--soc-version", default="", help="ATC --soc_version (default: from npu-smi, e.g. Ascend910B3)"
    )
    p.add_argument("--device", type=int, default=0, help="NPU device id for pyACL and Triton (default 0)")
    p.add_argument(
        "--keep", metavar="DIR", help="keep the ONNX sources, .om files, repository and logs in DIR"
    )
    p.add_argument("--fake", action="store_true", help="run against the project's fakes (CI; no NPU needed)")
    p.add_argument(
        "--json", metavar="PATH", default="npu-check.json", help="JSON report (default ./npu-check.json)"
    )
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--concurrency", type=int, help="benchmark concurrency (default 16; 4 with --fake)")
    p.add_argument("--requests", type=int, help="requests per benchmark phase (default 1000; 12 with --fake)")
    p.add_argument(
        "--min-speedup",
        type=float,
        default=1.0,
        help="dynamic batching must reach this many times the batch-1 throughput (default 1.0)",
    )
    p.add_argument("--atc-timeout", type=float, default=1800.0, help="seconds per ATC run (default 1800)")
    p.add_argument(
        "--fake-atc-replay",
        action="append",
        default=[],
        metavar="MODEL=RECORDING",
        help="with --fake: replay this recorded ATC run for MODEL (e.g. bert=fail_e19010)",
    )
    return p


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _parser()
    args = parser.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown or not args.models:
        parser.error(
            f"--models: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(MODELS)}"
        )
    replays = {}
    for item in args.fake_atc_replay:
        model, _, recording = item.partition("=")
        if not args.fake:
            parser.error("--fake-atc-replay needs --fake")
        if model not in MODELS or recording not in fakes.atc_exit_codes():
            parser.error(
                f"--fake-atc-replay {item!r}: use MODEL=RECORDING with a model of {', '.join(MODELS)} and "
                f"a recording of {', '.join(sorted(fakes.atc_exit_codes()))}"
            )
        replays[model] = recording
    args.replays = replays
    args.concurrency = args.concurrency or (4 if args.fake else 16)
    args.requests = args.requests or (12 if args.fake else 1000)
    if args.concurrency < 1 or args.requests < args.concurrency:
        parser.error("--concurrency must be >= 1 and --requests >= --concurrency")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check; return the exit status."""
    args = _arguments(argv)
    workdir = Path(args.keep).resolve() if args.keep else Path(tempfile.mkdtemp(prefix="npu-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        host = environment.fake_host(workdir, args.replays) if args.fake else contextlib.nullcontext()
        with host:
            return _run(args, workdir)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def _say(text: str) -> None:
    print(text, flush=True)


def _run(args: argparse.Namespace, workdir: Path) -> int:
    started_at = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    report = {
        "check": "npu-check",
        "fake": args.fake,
        "host": socket.gethostname(),
        "started_at": started_at,
        "workdir": str(workdir) if args.keep else None,
        "device": args.device,
        "seed_img_s": SEED_IMG_S,
        "tolerances": {m: MODELS[m].tolerance() for m in args.models},
    }
    if args.fake:
        _say(FAKE_BANNER)
    _say("== 1. environment")
    t0 = time.monotonic()
    env = environment.probe(args.device, args.soc_version)
    report["environment"] = env.to_dict()
    if env.missing:
        print("npu-check: this host cannot run the NPU check; missing:", file=sys.stderr)
        for item in env.missing:
            print(f"  {item}", file=sys.stderr)
        print(
            "(`python -m backend_ge npu-check --fake` runs the whole check against the project's fakes)",
            file=sys.stderr,
        )
        results = [StepResult("environment", FAIL, time.monotonic() - t0, f"{len(env.missing)} missing", {})]
        return _finish(args, report, results, EXIT_MISSING)
    results = [StepResult("environment", PASS, time.monotonic() - t0, env.summary(), {"notes": env.notes})]
    _say(f"  {env.summary()}")
    for note in env.notes:
        _say(f"  note: {note}")

    _say(f"== 2. compile with ATC ({env.atc}, --soc_version={env.soc_version})")
    repository, compiled = workdir / "repository", []
    for name in args.models:
        model = MODELS[name]
        source, signature = write_source(model, workdir / "onnx")
        result = compile_model(
            model,
            source,
            signature,
            repository / name / "1" / "model",
            soc_version=env.soc_version,
            atc=env.atc,
            timeout=args.atc_timeout,
            cwd=workdir / "atc",
            say=_say,
        )
        results.append(result)
        if result.status == PASS:
            compiled.append(Compiled(model, Path(result.data["om"]), source, signature))
    not_compiled = [n for n in args.models if n not in {c.model.name for c in compiled}]

    _say("== 3. pyACL executor vs onnxruntime")
    acl_module = None
    if args.fake:
        from backend_ge.fakes.pyacl import FakeAcl

        acl_module = FakeAcl(device_count=fakes.FAKE_HOST_DEVICES)
    results += check_executors(compiled, args.device, acl_module, _say)
    results += [StepResult(f"executor {n}", SKIP, summary="not compiled") for n in not_compiled]

    _say("== 4. tritonserver with the ge backend (dynamic batching) vs onnxruntime, then the benchmark")
    results += _serve_and_measure(args, workdir, repository, compiled, not_compiled)
    return _finish(args, report, _in_model_order(results, args.models), overall_exit_code(results))


def _in_model_order(results: list[StepResult], names: list[str]) -> list[StepResult]:
    """Rows grouped by step kind in the order they ran, models in the order given (skipped ones included)."""
    kinds = list(dict.fromkeys(r.step.split()[0] for r in results))

    def key(r: StepResult) -> tuple[int, int]:
        kind, _, model = r.step.partition(" ")
        return kinds.index(kind), names.index(model) if model in names else len(names)

    return sorted(results, key=key)


def _serve_and_measure(args, workdir: Path, repository: Path, compiled: list[Compiled], not_compiled) -> list:
    results = [StepResult(f"triton {n}", SKIP, summary="not compiled") for n in not_compiled]
    bench_step = f"benchmark {BENCH_MODEL}"
    bench = next((c for c in compiled if c.model.name == BENCH_MODEL), None)
    if not compiled:
        return [*results, StepResult(bench_step, SKIP, summary="nothing compiled")]
    names = write_repository(repository, compiled, args.device, BENCH_MODEL)
    server = None
    try:
        t0 = time.monotonic()
        try:
            server, failures = start_triton(repository, workdir / "triton", names)
        except TritonError as exc:
            first = str(exc).splitlines()[0]
            failed = [
                StepResult(f"triton {c.model.name}", FAIL, time.monotonic() - t0, first, {"error": str(exc)})
                for c in compiled
            ]
            return [*results, *failed, StepResult(bench_step, SKIP, summary="tritonserver did not start")]
        for c in compiled:
            result = check_triton_model(server, c, failures.get(c.model.name))
            _say(f"  {result.step}: {result.status} {result.summary}")
            results.append(result)
        served = (
            bench is not None
            and not failures.get(BENCH_MODEL)
            and not failures.get(BENCH_MODEL + UNBATCHED_SUFFIX)
        )
        if not served:
            why = (
                f"{BENCH_MODEL} not checked"
                if BENCH_MODEL not in args.models
                else f"{BENCH_MODEL} is not served"
            )
            results.append(StepResult(bench_step, SKIP, summary=why))
        else:
            results.append(
                run_benchmark(
                    server,
                    bench,
                    device=args.device,
                    concurrency=args.concurrency,
                    requests=args.requests,
                    min_speedup=args.min_speedup,
                    interval=0.2 if args.fake else 1.0,
                    fake=args.fake,
                    say=_say,
                )
            )
    finally:
        if server is not None:
            server.stop()
    return results


def _finish(args, report: dict, results: list[StepResult], code: int) -> int:
    report.update(
        finished_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        ok=code == 0,
        exit_code=code,
        steps=steps_json(results),
    )
    if code != EXIT_MISSING:  # the missing items, one per line, already said it all
        print(render_table(results), flush=True)
    if args.fake:
        print("(--fake: the table checks the command, not an NPU)", flush=True)
    path = write_json(args.json, report)
    print(f"JSON report: {path}", flush=True)
    return code
