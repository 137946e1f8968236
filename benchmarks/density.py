"""Density benchmark: many small models with scale to zero on instances whose memory holds a few of them.

``--models`` (300) small models are deployed with ``min_replicas: 0`` into a pool of ``--hosts`` (2) CPU
instances whose memory budget holds ``--resident`` (40) of them at once (each version's footprint is set to
``--footprint-mib``, so the budget is exact), and put to sleep. A Zipf-distributed stream of requests over all
models (``--requests``, ``--rate`` per second from ``--concurrency`` clients, bounded by ``--timeout``) goes
through the HAProxy gateway: a sleeping model's request is held there while a replica loads, and a cold model
evicts the least recently used idle one when no instance has room.

Printed: requests answered / failed (target 0 failed), cold-start latency p50/p99 (the gateway's hold per
activation, from the deployments' cold-start events) beside Triton's own load time of the same model on a
separate tritonserver (so the platform's share shows), the share of requests sent while their model was
loaded (warm), the instances' peak memory above their idle size (tritonserver + stubs, RSS) against the
budget - and the same stream for the same memory with everything pinned (autoscaling off: the models that fit
load, the others cannot be served). ``--json FILE`` writes the figures.

Everything real and local, with production settings (DEBUG off): a scratch database (or ``--database-url``),
the platform's web server for the agent API (gunicorn, as the Procfile runs it), ``--hosts`` ``python -m
hostagent`` processes each with one tritonserver, the gateway (``manage.py gateway``), and the beat's scheduler
and autoscaler ticks in this process (every ``--tick`` s).

    .venv/bin/python benchmarks/density.py [--models 300] [--resident 40] [--requests 3000] [--json FILE] [--smoke]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import smoke  # noqa: E402
from benchmarks.deploy import direct_load_seconds, make_versions  # noqa: E402
from benchmarks.rollout_drill import free_port, setup_environment, wait  # noqa: E402

BODY = json.dumps(
    {"inputs": [{"name": "input", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]}
).encode()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=int, default=300)
    parser.add_argument("--hosts", type=int, default=2, help="CPU instances (one per host agent)")
    parser.add_argument("--resident", type=int, default=40, help="models the pool's memory holds at once")
    parser.add_argument("--footprint-mib", type=int, default=80, help="a small model's reserved memory")
    parser.add_argument("--requests", type=int, default=3000, help="requests in the stream (an upper bound)")
    parser.add_argument("--rate", type=float, default=10, help="requests per second")
    parser.add_argument("--concurrency", type=int, default=16, help="clients (each waits for its answer)")
    parser.add_argument("--zipf", type=float, default=1.1, help="the Zipf exponent of the model popularity")
    # A replica that served within its idle period is never evicted: the models called within one idle period
    # must fit in the memory, or cold requests queue for replicas to go idle (the working set is printed).
    # At 10 requests/s over 300 Zipf(1.1) models, 5 s hold about 28 models (at most 37) for room for 40; 20 s
    # hold about 76.
    parser.add_argument("--idle-period", type=int, default=5, help="the deployments' idle period (s)")
    parser.add_argument(
        "--eviction-floor", type=int, default=0,
        help="SCHEDULER_EVICTION_MIN_IDLE_S: under memory pressure a replica idle this long may be evicted "
        "within its idle period (0, the platform's default: only after it)",
    )  # fmt: skip
    parser.add_argument(
        "--headroom-mib", type=int, default=0,
        help="SCHEDULER_EVICTION_HEADROOM_MB: memory kept free on each instance by evicting idle replicas "
        "ahead of the wake-ups (0, the platform's default: evict only when a replica needs the room)",
    )  # fmt: skip
    parser.add_argument("--tick", type=float, default=1.0, help="scheduler and autoscaler ticks (s)")
    parser.add_argument("--skip-pinned", action="store_true", help="no second run with everything pinned")
    parser.add_argument("--seed", type=int, default=23)
    parser.add_argument(
        "--direct-loads", type=int, default=3, help="loads timed on the separate tritonserver"
    )
    parser.add_argument("--json", default="", help="write the figures to this file")
    parser.add_argument(
        "--single", action="store_true",
        help="one scale-to-zero MLP (the seed's) woken --wakeups times: each put to sleep, then called once",
    )  # fmt: skip
    parser.add_argument("--wakeups", type=int, default=20, help="--single: wake-ups timed")
    parser.add_argument("--database-url", default="", help="default: a scratch SQLite file")
    parser.add_argument(
        "--timeout", type=float, default=1800, help="the stream stops after this many seconds"
    )
    # Smoke: 4 models in room for 2, a 1 s idle period - wakes, evictions, drains and the pinned run, briefly.
    return smoke.parse_args(
        parser, argv, models=4, hosts=2, resident=2, requests=12, rate=6, concurrency=4, idle_period=1,
        timeout=240, direct_loads=1, wakeups=3,
    )  # fmt: skip


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def zipf_weights(count: int, exponent: float) -> list[float]:
    return [1 / (rank**exponent) for rank in range(1, count + 1)]


def working_set(args: argparse.Namespace, samples: int = 200) -> tuple[float, int]:
    """Models the stream calls within one idle period (mean and most over ``samples`` windows): more than
    the memory holds means cold requests wait for a replica to go idle."""
    rng = random.Random(args.seed + 1)
    weights = zipf_weights(args.models, args.zipf)
    draws = max(1, round(args.rate * args.idle_period))
    counts = [len(set(rng.choices(range(args.models), weights=weights, k=draws))) for _ in range(samples)]
    return sum(counts) / len(counts), max(counts)


def percentile(values: list[float], share: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(share * (len(ordered) - 1))))]


class Memory:
    """Samples the instances' resident memory (every process whose command line names the fleet root:
    tritonservers and their python stubs) and which models are loaded, twice a second."""

    def __init__(self, fleet_root: Path) -> None:
        self.marker = str(fleet_root).encode()
        self.peak_mib = 0.0
        self.loaded: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss_mib(self) -> float:
        total_kb = 0
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                cmdline = (proc / "cmdline").read_bytes()
                if self.marker not in cmdline or b"hostagent" in cmdline:
                    continue
                for line in (proc / "status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total_kb += int(line.split()[1])
            except (OSError, ValueError):
                continue
        return total_kb / 1024

    def _run(self) -> None:
        from django.db import connections

        from apps.deployments.models import DeploymentInstance, PlacementState

        try:
            while not self._stop.wait(0.5):
                self.peak_mib = max(self.peak_mib, self.rss_mib())
                rows = DeploymentInstance.objects.filter(state=PlacementState.READY, unload=False)
                self.loaded = set(rows.values_list("deployment__model__slug", flat=True))
        finally:
            connections.close_all()

    def start(self) -> Memory:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


# Where the machine's CPU goes during the stream: each process by what its command line names (a python
# stub's time is counted once its tritonserver reaped it, in that server's children's time).
CPU_PARTS = (
    (b"tritonserver", "tritonservers and their python stubs"),
    (b"triton_python_backend_stub", "tritonservers and their python stubs"),
    (b"hostagent", "host agents"),
    (b"gunicorn", "web (agent API)"),
    (b"haproxy", "HAProxy"),  # before the gateway command: its configuration's path names the gateway
    (b"manage.py\x00gateway", "gateway command"),
    (b"postgres", "PostgreSQL"),
)


def cpu_seconds() -> dict[str, float]:
    """CPU seconds so far (user + system, own and reaped children's) per part, ``benchmark`` for this
    process (the beat, the clients, the samplers), and ``machine`` (all of it, from /proc/stat)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = dict.fromkeys([label for _, label in CPU_PARTS] + ["benchmark"], 0.0)
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        used = sum(int(v) for v in fields[11:15]) / tick  # utime, stime, cutime, cstime
        if int(proc.name) == os.getpid():
            out["benchmark"] += used
            continue
        part = next((label for marker, label in CPU_PARTS if marker in cmdline), None)
        if part is not None:
            out[part] += used
    with open("/proc/stat") as stat:
        fields = stat.readline().split()[1:]
    out["machine"] = (
        sum(int(v) for v in fields) - int(fields[3]) - int(fields[4])
    ) / tick  # not idle, iowait
    return out


def cpu_used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {part: round(max(0.0, after[part] - before.get(part, 0.0)), 1) for part in after}


def stream(port: int, token: str, slugs: list[str], team: str, args, memory: Memory) -> dict:
    """The Zipf stream: ``args.requests`` requests at ``args.rate`` per second from ``args.concurrency``
    clients, each request with a client timeout past the gateway's activation timeout."""
    rng = random.Random(args.seed)
    order = slugs[:]
    rng.shuffle(order)  # popularity is not the deployment order
    picks = rng.choices(order, weights=zipf_weights(len(order), args.zipf), k=args.requests)
    lock = threading.Lock()
    results = {"answered": 0, "failed": 0, "warm": 0, "errors": {}, "reasons": {}, "latency_ms": []}
    next_index = [0]
    started = time.monotonic()
    deadline = started + args.timeout

    def client() -> None:
        connection = None
        while True:
            with lock:
                index = next_index[0]
                next_index[0] += 1
            if index >= len(picks):
                return
            due = started + index / args.rate
            # A stream that fell behind its pace (slow answers: cold starts) still ends at the timeout.
            if due > deadline or time.monotonic() > deadline:
                return
            time.sleep(max(0.0, due - time.monotonic()))
            slug = picks[index]
            warm = slug in memory.loaded
            sent = time.monotonic()
            status = 0
            try:
                connection = connection or http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                connection.request("POST", f"/v2/models/{team}__{slug}/infer", body=BODY, headers={
                    "Content-Type": "application/json", "Authorization": f"Bearer {token}"})  # fmt: skip
                response = connection.getresponse()
                reply = response.read()
                status = response.status
            except OSError as exc:
                connection, reply = None, repr(exc).encode()
            elapsed_ms = (time.monotonic() - sent) * 1000
            with lock:
                if status == 200:
                    results["answered"] += 1
                    results["warm"] += warm
                    results["latency_ms"].append(elapsed_ms)
                else:
                    results["failed"] += 1
                    results["errors"][status] = results["errors"].get(status, 0) + 1
                    # Why, in a few words: the gateway's 503s name the activation timeout or the failed wake.
                    reason = re.sub(r"'[^']*'|\d+", "_", reply[:200].decode(errors="replace"))[:90]
                    results["reasons"][reason] = results["reasons"].get(reason, 0) + 1

    threads = [threading.Thread(target=client, daemon=True) for _ in range(args.concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(args.timeout + 150)
    results["seconds"] = time.monotonic() - started
    return results


# --- --single: one model's cold start, hop by hop -------------------------------------------------------------

MLP_BODY = json.dumps(
    {"inputs": [{"name": "input", "shape": [1, 256], "datatype": "FP32", "data": [0.5] * 256}]}
).encode()
# Triton 2.51's log: `I0213 10:11:12.345678 123 model_lifecycle.cc:472] "loading: team__model:1"`, then
# `... successfully loaded 'team__model'`: Triton's own load time of each load of the model.
_LOG_TIME = r"^[IWE]\d{4} (\d\d):(\d\d):(\d\d\.\d+) "


def triton_loads_ms(log_text: str, name: str) -> list[float]:
    """Every load of ``name`` in a tritonserver log: ``loading:`` -> ``successfully loaded``, in ms."""
    loads, started = [], None
    for line in log_text.splitlines():
        match = re.match(_LOG_TIME, line)
        if match is None:
            continue
        at = int(match.group(1)) * 3600 + int(match.group(2)) * 60 + float(match.group(3))
        if f"loading: {name}:" in line:
            started = at
        elif f"successfully loaded '{name}'" in line and started is not None:
            loads.append(((at - started) % 86400) * 1000)
            started = None
    return loads


def single_mlp_version(team, owner, scratch: Path):
    from apps.registry.models import ModelVersion, RegisteredModel, SourceFormat, VersionState
    from backend_ge.convert import prepare_onnx
    from backend_ge.examples import build_mlp

    model = RegisteredModel.objects.create(team=team, name="mlp", slug="mlp", created_by=owner)
    version = ModelVersion.objects.create(
        model=model, number=1, state=VersionState.CONVERTING, source_format=SourceFormat.ONNX
    )
    source = scratch / "mlp.onnx"
    source.write_bytes(build_mlp().SerializeToString())
    prepared = prepare_onnx(source, version.servable_dir() / "1", name=model.triton_model_name())
    version.signature = prepared.signature.to_dict()
    version.config_text = (version.servable_dir() / "config.pbtxt").read_text()
    version.state = VersionState.READY
    version.save()
    return version


def eviction_hops(events) -> dict:
    """From each ``evicted`` event to its replica's ``drained`` (the gateway sends it nothing more) and
    ``unloaded`` (its agent reported the memory free: the room a waiting wake-up takes) events, in ms;
    ``events``: (deployment id, kind, created_at) in order."""
    evicted_at, drained_at = {}, {}
    hops = {"drained_ms": [], "unloaded_ms": [], "room_ms": []}
    for deployment_id, kind, at in events:
        if kind == "evicted":
            evicted_at[deployment_id] = at
            drained_at.pop(deployment_id, None)
        elif kind == "drained" and deployment_id in evicted_at:
            drained_at[deployment_id] = at
        elif kind == "unloaded" and deployment_id in evicted_at:
            start, drained = evicted_at.pop(deployment_id), drained_at.pop(deployment_id, None)
            hops["room_ms"].append((at - start).total_seconds() * 1000)
            if drained is not None:
                hops["drained_ms"].append((drained - start).total_seconds() * 1000)
                hops["unloaded_ms"].append((at - drained).total_seconds() * 1000)
    return {
        hop: {"p50": round(percentile(values, 0.5)), "p99": round(percentile(values, 0.99)), "n": len(values)}
        for hop, values in hops.items()
        if values
    }


EVICTION_HOPS = (
    ("drained_ms", "evicted -> drained at the gateway"),
    ("unloaded_ms", "drained -> agent reported it unloaded"),
    ("room_ms", "evicted -> its room free"),
)


def print_hops(breakdowns: list[dict], indent: str = "") -> dict:
    """p50/p99 of each hop of the cold starts' breakdowns (``apps.deployments.cold_start``); the figures."""
    try:
        from apps.deployments.cold_start import HOPS
    except ImportError:  # a platform without the breakdown
        return {}
    out = {}
    for hop, label in HOPS:
        values = [b[hop] for b in breakdowns if isinstance(b.get(hop), int | float)]
        if values:
            out[hop] = {"p50": round(percentile(values, 0.5), 1), "p99": round(percentile(values, 0.99), 1)}
            print(
                f"{indent}{label:<44} p50 {out[hop]['p50']:>7} ms  p99 {out[hop]['p99']:>7} ms  ({len(values)})"
            )
    return out


def single(args: argparse.Namespace) -> int:
    """``--single``: the seed's MLP deployed with scale to zero on one CPU instance, put to sleep and called
    ``--wakeups`` times. Prints the first answer's latency (the client's clock) beside Triton's own load time of
    the same loads (its log), and each hop's p50/p99."""
    scratch = setup_environment(args, "density-single", production=True)
    from django.contrib.auth import get_user_model

    from apps.deployments import autoscaling, services
    from apps.deployments.models import Deployment, DeploymentState, PlacementState
    from apps.fleet import services as fleet
    from apps.fleet.models import Host, InstanceState, Pool, TritonInstance
    from apps.teams import services as teams

    owner = get_user_model().objects.create_user("single", password="single-password")
    team = teams.create_team(actor=owner, name="Single", slug="single")
    team.quota_requests_per_second = 1_000_000
    team.save()
    pool = Pool.objects.create(name="cpu", memory_budget_mb=4096)
    version = single_mlp_version(team, owner, scratch)
    name = version.model.triton_model_name()
    fleet_root = scratch / "fleet"
    bench = Processes(scratch)
    latencies, breakdowns, loads = [], [], []
    try:
        web_port = bench.web()
        host, join = fleet.create_host(actor=None, name="single-0", address="127.0.0.1")
        Host.objects.filter(pk=host.pk).update(pool=pool)
        fleet.create_instance(actor=None, host=host, name="cpu-0", http_port=free_port(), grpc_port=free_port(),
                              metrics_port=free_port())  # fmt: skip
        bench.agent(0, web_port, join, fleet_root)
        wait(lambda: TritonInstance.objects.filter(host__pool=pool, state=InstanceState.READY).exists(), 240,
             "the instance")  # fmt: skip
        d = services.deploy_version(actor=owner, model=version.model, version=version, replicas=1, pool=pool)
        wait(
            lambda: Deployment.objects.filter(pk=d.pk, state=DeploymentState.SERVING).exists(), 120, "SERVING"
        )
        # A long idle period: the wake-ups and sleeps are this script's, not the autoscaler's (not run here).
        policy = {"min_replicas": 0, "max_replicas": 1, "scale_down_window_s": 0, "idle_period_s": 3600}
        autoscaling.configure(actor=owner, deployment=d, values=policy)
        bench.gateway()
        _, token = teams.create_token(actor=owner, team=team, name="single")
        port = int(os.environ["GATEWAY_BIND"].rsplit(":", 1)[1])

        def call() -> tuple[int, float]:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            sent = time.perf_counter()
            try:
                connection.request("POST", f"/v2/models/{name}/infer", body=MLP_BODY, headers={
                    "Content-Type": "application/json", "Authorization": f"Bearer {token}"})  # fmt: skip
                response = connection.getresponse()
                response.read()
                return response.status, (time.perf_counter() - sent) * 1000
            except OSError:
                return 0, 0.0
            finally:
                connection.close()

        wait(lambda: call()[0] == 200, 120, "the gateway to route the model")
        log_path = next(fleet_root.glob("**/tritonserver.log"))
        for _ in range(args.wakeups):
            autoscaling.sleep(actor=owner, deployment=Deployment.objects.get(pk=d.pk))
            wait(lambda: not d.placements.exclude(state=PlacementState.UNLOADED).exists(), 60, "the unload")
            recorded = d.events.filter(kind="cold_start").count()
            loads_before = len(triton_loads_ms(log_path.read_text(errors="replace"), name))
            status, ms = call()
            if status != 200:
                raise SystemExit(f"a woken call answered {status}; see {scratch / 'logs'}")
            latencies.append(ms)
            # The gateway records the cold start when it next reads its maps (within a poll).
            event = wait(lambda n=recorded: d.events.filter(kind="cold_start").order_by("pk")[n:].first(), 10,
                         "the cold start's record")  # fmt: skip
            breakdowns.append(event.details.get("hops") or {})
            new = triton_loads_ms(log_path.read_text(errors="replace"), name)[loads_before:]
            loads.extend(new[-1:])
    finally:
        bench.stop()
    cold_p50, load_p50 = percentile(latencies, 0.5), percentile(loads, 0.5)
    print(
        f"\nSingle cold start: the seed's MLP ({name}), {len(latencies)} wake-ups, each put to sleep then called once"
    )
    print(f"first answer (client)  p50 {cold_p50:.0f} ms  p99 {percentile(latencies, 0.99):.0f} ms")
    print(
        f"Triton's own load      p50 {load_p50:.0f} ms  p99 {percentile(loads, 0.99):.0f} ms  (same loads, its log)"
    )
    print(f"platform's share       p50 {cold_p50 - load_p50:.0f} ms  (target: first answer <= load + 300 ms)")
    hops = print_hops(breakdowns, "  ")
    result = {
        "wakeups": len(latencies),
        "cold_start_p50_ms": round(cold_p50, 1),
        "cold_start_p99_ms": round(percentile(latencies, 0.99), 1),
        "triton_load_p50_ms": round(load_p50, 1),
        "triton_load_p99_ms": round(percentile(loads, 0.99), 1),
        "hops": hops,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


class Processes:
    """The servers a run starts (web, agents, gateway), each in a session of its own, logged under
    ``<scratch>/logs``; ``stop`` ends them."""

    def __init__(self, scratch: Path) -> None:
        self.env = dict(os.environ)
        self.logs = scratch / "logs"
        self.logs.mkdir(exist_ok=True)
        self.scratch = scratch
        self.children: list[subprocess.Popen] = []

    def spawn(self, name: str, argv: list[str], extra: dict | None = None, drop: tuple = ()) -> None:
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - the child writes to it
        env = {k: v for k, v in {**self.env, **(extra or {})}.items() if k not in drop}
        self.children.append(subprocess.Popen(
            [sys.executable, *argv], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        ))  # fmt: skip

    def web(self) -> int:
        """The platform's web server as production runs it (the Procfile's gunicorn: 2 processes of 64
        threads, production settings)."""
        port = free_port()
        self.spawn("web", ["-m", "gunicorn", "serving_platform.wsgi", "--config", "python:serving_platform.gunicorn_hooks",
                           "--bind", f"127.0.0.1:{port}", "--workers", "2", "--threads", "64", "--worker-class", "gthread",
                           "--timeout", "120"])  # fmt: skip
        wait(lambda: port_open(port), 60, "the web server")
        return port

    def agent(self, index: int, web_port: int, join: str, fleet_root: Path) -> None:
        var = self.scratch / f"agent-{index}"
        var.mkdir()
        extra = {
            "VAR_DIR": str(var),
            "ARTIFACT_ROOT": str(var / "none"),
            "FLEET_ROOT": str(fleet_root / str(index)),
        }
        self.spawn(f"agent-{index}", ["-m", "hostagent", "--platform", f"http://127.0.0.1:{web_port}",
                                      "--join-token", join, "--credential-file", str(var / "credential")],
                   extra, drop=("DATABASE_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"))  # fmt: skip

    def gateway(self) -> None:
        self.spawn("gateway", ["manage.py", "gateway"])

    def stop(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.terminate()
        for child in self.children:
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()


def main() -> int:
    args = parse_args()
    if args.single:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        return single(args)
    # A stopped run stops its servers (the ``finally`` below), as deploy.py does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.resident % args.hosts:
        raise SystemExit("--resident must be a multiple of --hosts (each instance holds the same number)")
    # Before the settings are read: this process's beat and the servers it starts decide on it.
    os.environ["SCHEDULER_EVICTION_MIN_IDLE_S"] = str(args.eviction_floor)
    os.environ["SCHEDULER_EVICTION_HEADROOM_MB"] = str(args.headroom_mib)
    scratch = setup_environment(args, "density", production=True)
    from django.contrib.auth import get_user_model
    from django.db import connections

    from apps.deployments import autoscaling, healing, services
    from apps.deployments.models import Deployment, DeploymentEvent, DeploymentInstance, DeploymentState
    from apps.fleet import services as fleet
    from apps.fleet.models import Host, InstanceState, Pool, TritonInstance
    from apps.gateway import autoscaling as gateway_autoscaling
    from apps.teams import services as teams

    owner = get_user_model().objects.create_user("density", password="density-password")
    team = teams.create_team(actor=owner, name="Density", slug="density")
    team.quota_requests_per_second = 1_000_000
    team.quota_instances = 10_000
    team.quota_deployed_models = max(team.quota_deployed_models, args.models)
    team.save()
    budget_per_instance = args.footprint_mib * (args.resident // args.hosts)
    pool = Pool.objects.create(name="cpu", memory_budget_mb=budget_per_instance)
    versions = make_versions(team, owner, args.models, "m", scratch)
    for version in versions:
        version.footprint_mb = args.footprint_mib
        version.save(update_fields=["footprint_mb"])
    direct_load_ms = direct_load_seconds(versions[0], scratch, args.direct_loads) * 1000

    bench = Processes(scratch)
    env = bench.env
    fleet_root = scratch / "fleet"

    beat_stop = threading.Event()

    beat_failures: list[str] = []

    def beat() -> None:
        try:
            while not beat_stop.wait(args.tick):
                try:
                    gateway_autoscaling.autoscale()
                    healing.tick()
                except Exception as exc:  # noqa: BLE001 - as beat: a failed tick is logged, the next one runs
                    beat_failures.append(repr(exc)[:200])
                    connections.close_all()
        finally:
            connections.close_all()

    beat_thread = threading.Thread(target=beat, daemon=True)
    memory = Memory(fleet_root)
    figures: dict = {}
    try:
        web_port = bench.web()
        for index in range(args.hosts):
            host, join = fleet.create_host(actor=None, name=f"density-{index}", address="127.0.0.1")
            Host.objects.filter(pk=host.pk).update(pool=pool)
            ports = free_port(), free_port(), free_port()
            fleet.create_instance(actor=None, host=host, name="cpu-0", http_port=ports[0], grpc_port=ports[1],
                                  metrics_port=ports[2])  # fmt: skip
            bench.agent(index, web_port, join, fleet_root)
        wait(
            lambda: TritonInstance.objects.filter(host__pool=pool, state=InstanceState.READY).count() == args.hosts,
            240,
            "the instances",
        )  # fmt: skip
        memory.start()
        time.sleep(1.5)
        idle_mib = memory.rss_mib()

        # Deployed and put to sleep at once: none holds memory before its first request.
        started = time.monotonic()
        policy = {
            "min_replicas": 0,
            "max_replicas": 1,
            "scale_down_window_s": 0,
            "idle_period_s": args.idle_period,
        }
        deployments = []
        for version in versions:
            d = services.deploy_version(
                actor=owner, model=version.model, version=version, replicas=1, pool=pool
            )
            autoscaling.configure(actor=owner, deployment=d, values=policy)
            deployments.append(autoscaling.sleep(actor=owner, deployment=d))
        deploy_s = time.monotonic() - started
        bench.gateway()
        _, token = teams.create_token(actor=owner, team=team, name="density")
        gateway_port = int(env["GATEWAY_BIND"].rsplit(":", 1)[1])
        beat_thread.start()
        slugs = [v.model.slug for v in versions]

        def answered_once() -> bool:
            try:
                connection = http.client.HTTPConnection("127.0.0.1", gateway_port, timeout=90)
                connection.request("POST", f"/v2/models/density__{slugs[0]}/infer", body=BODY,
                                   headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})  # fmt: skip
                return connection.getresponse().status == 200
            except OSError:
                return False

        wait(answered_once, 120, "the gateway to route (and wake) the first model")
        memory.peak_mib = idle_mib
        cpu_before = cpu_seconds()
        run = stream(gateway_port, token, slugs, "density", args, memory)
        cpu = cpu_used(cpu_before, cpu_seconds())
        cold_events = list(DeploymentEvent.objects.filter(kind="cold_start", deployment__team=team))
        colds = [e.details.get("held_ms", 0) for e in cold_events]
        breakdowns = [e.details.get("hops") or {} for e in cold_events]
        evictions = eviction_hops(
            DeploymentEvent.objects.filter(deployment__team=team, kind__in=("evicted", "drained", "unloaded"))
            .order_by("created_at", "pk")
            .values_list("deployment_id", "kind", "created_at")
        )
        figures["scale_to_zero"] = {
            "answered": run["answered"],
            "failed": run["failed"],
            "errors": {str(k): v for k, v in run["errors"].items()},
            "reasons": run["reasons"],
            "seconds": round(run["seconds"], 1),
            "warm_share": round(run["warm"] / run["answered"], 3) if run["answered"] else 0.0,
            "activations": len(colds),
            "evictions": DeploymentEvent.objects.filter(kind="evicted", deployment__team=team).count(),
            "cold_start_p50_ms": round(percentile(colds, 0.5), 1),
            "cold_start_p99_ms": round(percentile(colds, 0.99), 1),
            "latency_p50_ms": round(percentile(run["latency_ms"], 0.5), 1),
            "latency_p99_ms": round(percentile(run["latency_ms"], 0.99), 1),
            "peak_memory_mib": round(memory.peak_mib - idle_mib, 1),
        }

        if not args.skip_pinned:
            # The same memory with everything pinned: autoscaling off; what fits loads, the rest waits.
            for d in deployments:
                autoscaling.configure(actor=owner, deployment=d, values={"min_replicas": None})
            wait(
                lambda: Deployment.objects.filter(team=team, state=DeploymentState.SERVING, placements__state="READY",
                                                  placements__unload=False).distinct().count()
                >= min(args.resident, args.models),
                300,
                "the models that fit to load",
            )  # fmt: skip
            wait(
                lambda: not DeploymentInstance.objects.filter(deployment__team=team, unload=True)
                .exclude(state="UNLOADED")
                .exists(),
                60,
                "the evicted replicas to unload",
            )  # fmt: skip
            memory.peak_mib = idle_mib
            pinned = stream(gateway_port, token, slugs, "density", args, memory)
            figures["pinned"] = {
                "answered": pinned["answered"],
                "failed": pinned["failed"],
                "seconds": round(pinned["seconds"], 1),
                "peak_memory_mib": round(memory.peak_mib - idle_mib, 1),
            }
    finally:
        beat_stop.set()
        memory.stop()
        bench.stop()

    budget_mib = budget_per_instance * args.hosts
    s2z = figures["scale_to_zero"]
    print(f"\nDensity ({args.models} small models, min_replicas 0, {args.hosts} CPU instances whose budget holds "
          f"{args.resident}; Zipf {args.zipf}, {args.requests} requests at {args.rate:g}/s, idle period "
          f"{args.idle_period} s, eviction floor {args.eviction_floor or 'off'}, headroom "
          f"{f'{args.headroom_mib} MiB' if args.headroom_mib else 'off'})")  # fmt: skip
    print(f"deployed and put to sleep: {args.models} in {deploy_s:.1f} s")
    mean_set, most_set = working_set(args)
    print(f"working set: {mean_set:.1f} models called within an idle period (at most {most_set}) for room for "
          f"{args.resident}{'' if most_set <= args.resident else ' - over: cold requests wait for idle replicas'}")  # fmt: skip
    if beat_failures:
        print(f"beat ticks that failed (and were run again): {len(beat_failures)}, e.g. {beat_failures[0]}")
    print(f"answered {s2z['answered']}, failed {s2z['failed']} {s2z['errors'] or ''} in {s2z['seconds']} s "
          f"(target 0 failed)")  # fmt: skip
    for reason, count in sorted(s2z["reasons"].items(), key=lambda item: -item[1])[:5]:
        print(f"  {count} x {reason}")
    print(f"cold start (held at the gateway, {s2z['activations']} activations, {s2z['evictions']} evictions): "
          f"p50 {s2z['cold_start_p50_ms']} ms  p99 {s2z['cold_start_p99_ms']} ms; "
          f"Triton's own load time {direct_load_ms:.0f} ms")  # fmt: skip
    hops = print_hops(breakdowns, "  ")
    print(f"CPU during the stream ({cpu['machine']} CPU-s of {os.cpu_count() * s2z['seconds']:.0f} the machine had; "
          f"per activation):")  # fmt: skip
    for part, used in sorted(cpu.items(), key=lambda item: -item[1]):
        if part != "machine":
            print(f"  {part:<44} {used:>7} s  {used / max(1, s2z['activations']):.3f} s")
    print("eviction (from the events):")
    for hop, label in EVICTION_HOPS:
        if hop in evictions:
            e = evictions[hop]
            print(f"  {label:<44} p50 {e['p50']:>7} ms  p99 {e['p99']:>7} ms  ({e['n']})")
    print(f"warm share: {s2z['warm_share'] * 100:.1f} % of answered requests; latency p50 {s2z['latency_p50_ms']} ms "
          f"p99 {s2z['latency_p99_ms']} ms")  # fmt: skip
    print(f"peak memory above idle: {s2z['peak_memory_mib']} MiB against a budget of {budget_mib} MiB "
          f"({'within' if s2z['peak_memory_mib'] <= budget_mib else 'OVER'})")  # fmt: skip
    if "pinned" in figures:
        p = figures["pinned"]
        print(f"everything pinned, same memory: answered {p['answered']}, failed {p['failed']} in {p['seconds']} s, "
              f"peak memory above idle {p['peak_memory_mib']} MiB")  # fmt: skip
    result = {
        "models": args.models,
        "hosts": args.hosts,
        "resident": args.resident,
        "requests": args.requests,
        "eviction_floor_s": args.eviction_floor,
        "headroom_mib": args.headroom_mib,
        "answered": s2z["answered"],
        "failed": s2z["failed"],
        "cold_start_p50_ms": s2z["cold_start_p50_ms"],
        "cold_start_p99_ms": s2z["cold_start_p99_ms"],
        "triton_load_ms": round(direct_load_ms, 1),
        "warm_share": s2z["warm_share"],
        "peak_memory_mib": s2z["peak_memory_mib"],
        "budget_mib": budget_mib,
        "hops": hops,
        "eviction_hops": evictions,
        "cpu_s": cpu,
        **({"pinned": figures["pinned"]} if "pinned" in figures else {}),
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
