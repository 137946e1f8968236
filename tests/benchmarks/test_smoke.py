"""Every script under ``benchmarks/`` still runs to the end: its ``--smoke`` mode (tiny counts, the same code
path as a real run) exits 0 and prints its figures. The figures are not judged, only that each one is there.

Each benchmark runs as a user runs it: ``python benchmarks/<name>.py --smoke`` from the repository root with
the virtualenv's ``bin/`` first on PATH (the python stubs find numpy through it), in a scratch database and
directory of its own.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
# The suite's own database, broker and directories are not the benchmark's: each picks scratch ones.
SUITE_ONLY_ENV = ("DATABASE_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "VAR_DIR", "ARTIFACT_ROOT")

requires_haproxy = pytest.mark.skipif(
    shutil.which("haproxy") is None, reason="haproxy is not installed (apt install haproxy)"
)

# The network drills make network namespaces and iptables rules (tests/support/netns.py).
requires_netns = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("iptables") is None or shutil.which("ip") is None,
    reason="the network drills need root, ip and iptables (network namespaces)",
)


def postgres_database(name: str) -> str:
    """A database ``name`` on the PostgreSQL server the suite uses (DATABASE_URL), else on the one CI names."""
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith(("postgres://", "postgresql://")):
        url = "postgres://postgres@127.0.0.1:5432/postgres"
    return urlunsplit(urlsplit(url)._replace(path=f"/{name}"))


def postgres_arguments(script: str) -> list[str]:
    """fleet_scale.py and scheduler.py measure PostgreSQL: a scratch database on the suite's server (each drops
    it at the end)."""
    import psycopg

    try:
        psycopg.connect(postgres_database("postgres"), connect_timeout=3).close()
    except psycopg.Error as exc:
        pytest.skip(f"{script} needs PostgreSQL and {postgres_database('')} is not reachable: {exc}")
    return ["--database-url", postgres_database(f"{Path(script).stem}_smoke_{os.getpid()}")]


POSTGRES_BENCHMARKS = ("fleet_scale.py", "scheduler.py")


def run_smoke(script: str, *extra: str, timeout: float, tmpdir: Path) -> str:
    """Run one benchmark with ``--smoke``; its stdout, or a failure with its last output."""
    env = {k: v for k, v in os.environ.items() if k not in SUITE_ONLY_ENV}
    env["TMPDIR"] = str(tmpdir)  # most benchmarks leave their scratch directory (a model repository) behind
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("DEBUG", "1")
    process = subprocess.Popen(
        [sys.executable, str(BENCHMARKS / script), "--smoke", *extra],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # Ctrl-C first: the script's own clean-up stops the servers it started in sessions of their own.
        process.send_signal(signal.SIGINT)
        try:
            out, err = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
        pytest.fail(f"{script} --smoke did not finish in {timeout:.0f} s\n{out[-3000:]}\n{err[-3000:]}")
    assert process.returncode == 0, (
        f"{script} --smoke exited {process.returncode}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"
    )
    return out


def assert_figures(out: str, patterns: list[str]) -> None:
    missing = [p for p in patterns if not re.search(p, out, re.MULTILINE)]
    assert not missing, f"figure lines missing: {missing}\n--- stdout\n{out[-3000:]}"


NUMBER = r"-?[\d.]+"
SMOKES = [
    pytest.param(
        "alerts.py",
        [
            r"^seeded \d+ rules, \d+ model rows",
            rf"^first evaluation: {NUMBER} ms CPU \({NUMBER} ms wall\), \d+ queries",
            rf"^steady state over 1 runs: median {NUMBER} ms CPU",
            r"^alerts firing: \d+, pending: \d+",
            r"^target < 1 s: (met|MISSED)",
        ],
        id="alerts",
    ),
    pytest.param(
        "scrape.py",
        [
            r"^scrape cycle, 5 models x 2 instances \(10 series\), 1 cycles:",
            rf"^  CPU per cycle  median {NUMBER} ms",
            rf"^7-day chart JSON over 10080 minute rows: median {NUMBER} ms",
        ],
        marks=pytest.mark.servers,  # http.server processes playing Triton's metrics endpoints
        id="scrape",
    ),
    pytest.param(
        "upload.py",
        [
            r"^dropped the connection at byte \d+; server offset \d+",
            rf'"send_mb_per_s": {NUMBER}',
            rf'"worker_peak_growth_mib": {NUMBER}',
            r'"sha256_verified": true',
        ],
        marks=pytest.mark.servers,
        id="upload",
    ),
    pytest.param(
        "fleet_scale.py",
        [
            r"^fleet: 3 hosts x 1 instances created",
            r"^phase 1 - heartbeats only, \d+ s: \d+ heartbeats, platform CPU",
            rf"^  heartbeat +n= +\d+  p50 +{NUMBER} ms  p99 +{NUMBER} ms",
            rf"^phase 2 - idle fleet .* platform CPU {NUMBER} % of one core",
            r"^phase 3 - deploy to 2 hosts: 2/2 placements READY",
        ],
        marks=pytest.mark.servers,
        id="fleet_scale",
    ),
    pytest.param(
        "scheduler.py",
        [
            r"^fleet: 4 hosts x 8 devices, 12 deployments, \d+ replicas",
            rf"^placement decision: p50 {NUMBER} ms  p99 {NUMBER} ms",
            rf"^packing \(spread\): \d+ devices used, lower bound \d+ \({NUMBER} GiB of footprints\); "
            r"pending deployments: 0",
            rf"^packing \(binpack\): \d+ devices used, lower bound \d+ \({NUMBER} GiB of footprints\); "
            r"pending deployments: 0",
            rf"^placement decision \(binpack pool\): p50 {NUMBER} ms  p99 {NUMBER} ms",
            r"^over capacity: 0 \(0 expected\)",
            rf"^host loss: \d+ replicas placed elsewhere and READY in {NUMBER} s .* replaced_all_s = grace 60",
        ],
        id="scheduler",
    ),
    pytest.param(
        "gateway.py",
        [
            rf"^c1: direct {NUMBER} req/s p50 {NUMBER} ms \| gateway .* added p50 {NUMBER} ms, throughput {NUMBER}x",
            rf"^c2: direct {NUMBER} req/s .* throughput {NUMBER}x, gateway CPU {NUMBER} us/request",
            rf"^token lookup: p50 {NUMBER} ms with 1 token, {NUMBER} ms with 10,000",
        ],
        marks=[pytest.mark.triton, pytest.mark.servers, requires_haproxy],
        id="gateway",
    ),
    pytest.param(
        "gateway.py --protocol grpc",
        [
            rf"^c1: direct {NUMBER} req/s p50 {NUMBER} ms \| gateway .* added p50 {NUMBER} ms, throughput {NUMBER}x.*\(grpc; errors 0 direct, 0 gateway\)",
            rf"^c2: direct {NUMBER} req/s .* throughput {NUMBER}x, gateway CPU {NUMBER} us/request",
            rf"^c1 body inspection: gateway CPU {NUMBER} us/request with it, {NUMBER} without",
            rf"^c2 body inspection: gateway CPU {NUMBER} us/request with it, {NUMBER} without",
        ],
        marks=[pytest.mark.triton, pytest.mark.servers, requires_haproxy],
        id="gateway_grpc",
    ),
    pytest.param(
        "priority.py",
        [
            rf"^alone: interactive p50 {NUMBER} ms p99 {NUMBER} ms \(0 errors\)",
            rf"^with_classes: interactive p50 {NUMBER} ms p99 {NUMBER} ms \(0 errors\); batch {NUMBER} req/s",
            rf"^without_classes: interactive p50 {NUMBER} ms p99 {NUMBER} ms \(0 errors\)",
            rf"^interactive p99 with classes / alone: {NUMBER}x, without classes / alone: {NUMBER}x",
        ],
        marks=[pytest.mark.triton, pytest.mark.servers, requires_haproxy],
        id="priority",
    ),
    pytest.param(
        "tuning.py",
        [
            r"^mlp: objective the most throughput with p99 <= 10 ms",
            r"^mlp: default ([\d,.]+ req/s|none within the objective) \(",
            r"^mlp: tuned ([\d,.]+ req/s|none within the objective) \(",
            rf"^mlp: tuned / default: ({NUMBER}x|n/a)",
            rf"^mlp: batching gain at concurrency 4: {NUMBER}x \(",
            rf"^mlp: search {NUMBER} s, 3 candidates, {NUMBER} points, stopped: (candidates|done)",
            rf"^mlp: brute force over {NUMBER} candidates \({NUMBER} measured, {NUMBER} points, {NUMBER} s, "
            r"stopped: budget\): best ",
        ],
        marks=pytest.mark.triton,
        id="tuning",
    ),
    pytest.param(
        "latency_summaries.py",
        [
            rf"^concurrency 1: without {NUMBER} req/s .* ratio {NUMBER}, added p50 [+-]\d+ us",
            rf"^concurrency 2: without {NUMBER} req/s .* ratio {NUMBER}, added p50 [+-]\d+ us",
        ],
        marks=pytest.mark.triton,
        id="latency_summaries",
    ),
    pytest.param(
        "backend_overhead.py",
        [
            rf"^served mlp c=1 no batching +{NUMBER}",
            rf"^served resnet50 c=4 +{NUMBER}",
            rf"^raw onnxruntime mlp b=16 +{NUMBER}",
            rf"^resnet50 served / raw \(same batch\): +{NUMBER}x",
            rf"^mlp c=2 batching / no batching: +{NUMBER}x",
            rf"^added p50 latency, mlp c=1: +{NUMBER} ms",
            rf"^  floor p50 at c=1 without any model: +{NUMBER} ms",
            rf"^PSS per served small model \(stub, before its weights, 1 models\): {NUMBER} MiB",
        ],
        marks=pytest.mark.triton,
        id="backend_overhead",
    ),
    pytest.param(
        "deploy.py",
        [
            rf"Triton's own load time \(direct, median of 1\): +{NUMBER} ms",
            rf"deploy_version\(\) -> SERVING \(median of 1\): +{NUMBER} ms",
            rf"platform overhead: +{NUMBER} ms",
            rf"2 models deployed to one instance: +{NUMBER} s total",
            r"right after the last deploy: +2/2 ready in Triton, 2/2 SERVING, 0 differ",
            rf"instance memory \(tritonserver \+ stubs, RSS\): +{NUMBER} MiB",
            r"restart \(SIGKILL of the tritonserver\) -> all 2 models serving again",
            rf"^    4 loads at a time: +first ready +{NUMBER} s, half +{NUMBER} s, all +{NUMBER} s; every placement READY +{NUMBER} s",
            rf"^    one load at a time: +first ready +{NUMBER} s, half +{NUMBER} s, all +{NUMBER} s",
            rf"^ +CPU {NUMBER} s \(tritonserver \+ stubs {NUMBER}, agent {NUMBER}, platform web {NUMBER}\) = "
            rf"{NUMBER} s per model; floor on \d+ cores {NUMBER} s, READY at {NUMBER}x the floor",
        ],
        marks=[pytest.mark.triton, pytest.mark.servers],
        id="deploy",
    ),
    pytest.param(
        "density.py",
        [
            r"^deployed and put to sleep: 4 in",
            rf"^working set: {NUMBER} models called within an idle period \(at most \d+\) for room for 2",
            r"^answered \d+, failed \d+ .*\(target 0 failed\)",
            rf"^cold start \(held at the gateway, \d+ activations, \d+ evictions\): p50 {NUMBER} ms  p99 {NUMBER} ms; Triton's own load time {NUMBER} ms",
            rf"^warm share: {NUMBER} %",
            rf"^peak memory above idle: {NUMBER} MiB against a budget of 160 MiB",
            r"^everything pinned, same memory: answered \d+, failed \d+",
        ],
        marks=[pytest.mark.triton, pytest.mark.servers, requires_haproxy],
        id="density",
    ),
    pytest.param(
        "drills.py",
        [
            r"^postgres restart mid-deploy +\d+ +0 +- +[\d.]+ +0 +0$",
            r"^drills run: 1 in \d+ s; pytest exit 0",
        ],
        marks=[pytest.mark.triton, pytest.mark.servers, requires_haproxy, requires_netns],
        id="drills",
    ),
    pytest.param(
        "density.py --single",
        [
            rf"^first answer \(client\)  p50 {NUMBER} ms  p99 {NUMBER} ms",
            rf"^Triton's own load      p50 {NUMBER} ms  p99 {NUMBER} ms",
            rf"^  agent: Triton's load +p50 +{NUMBER} ms",
            rf"^  in rotation -> held request released +p50 +{NUMBER} ms",
            r'"cold_start_p50_ms": .*"triton_load_p50_ms"',
        ],
        marks=[pytest.mark.triton, pytest.mark.servers, requires_haproxy],
        id="density-single",
    ),
    pytest.param(
        "rollout_drill.py",
        [
            r"bad canary v2: ROLLED_BACK",
            rf"start -> rollback: {NUMBER} s",
            r"failed requests seen by clients: \d+ on the canary, 0 elsewhere",
            rf"good canary v3: PROMOTED; start -> 100 %: {NUMBER} s",
        ],
        marks=[pytest.mark.triton, pytest.mark.servers, requires_haproxy],
        id="rollout_drill",
    ),
]


def test_every_benchmark_has_a_smoke_run():
    scripts = {path.name for path in BENCHMARKS.glob("*.py")} - {"smoke.py"}
    assert scripts == {param.values[0].split()[0] for param in SMOKES}


@pytest.mark.timeout(360)
@pytest.mark.parametrize(("script", "figures"), SMOKES)
def test_benchmark_runs_to_the_end_and_prints_its_figures(script, figures):
    script, *options = script.split()  # "gateway.py --protocol grpc": a script and its options
    extra = [*options, *(postgres_arguments(script) if script in POSTGRES_BENCHMARKS else [])]
    # Short, under /tmp: the gateway's admin socket lives in it (a socket path holds at most 107 bytes).
    tmpdir = Path(tempfile.mkdtemp(prefix="bench-smoke-"))
    try:
        out = run_smoke(script, *extra, timeout=300, tmpdir=tmpdir)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    assert_figures(out, figures)
