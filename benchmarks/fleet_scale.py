"""Fleet scale: N simulated host agents against one platform process on PostgreSQL, over the real agent API.

One platform web server (gunicorn, ``--workers`` processes, default 1, of ``--threads`` each) serves ``--hosts`` simulated agents (threads here,
each with its own host credential and ``hostagent.client.PlatformClient``). Each agent heartbeats every
``--heartbeat-every`` s (facts and its instances' log tails, as ``HostAgent`` sends them) and long-polls its
desired state (``If-None-Match`` + ``?wait=--long-poll-wait``: held until it changes; ``--long-poll-wait 0``
short-polls every ``--poll-every`` s as older agents do); its ``--instances`` fake instances answer like
Triton's load API after ``--load-ms`` (a placement is reported started, then loaded). Printed:

1. platform CPU per heartbeat (a phase with heartbeats only), and the idle fleet's CPU in % of one core
   (heartbeats + polling);
2. p50/p99 latency of the agent-API calls that are not held (heartbeats, reports, full fetches), measured at
   the agents, and how many polls were held and how long;
3. the time from a change of every host's desired state to each agent having the new state;
4. the time from one ``deploy_version`` call (what the deploy API runs) to every placement READY on
   ``--deploy-hosts`` hosts.

Bounded by ``--timeout``. A scratch PostgreSQL database (``--database-url``, dropped at the end) and a scratch
directory; nothing else is touched.

    .venv/bin/python benchmarks/fleet_scale.py [--hosts 200] [--database-url postgres://postgres@127.0.0.1:5432/fleet_scale]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import smoke  # noqa: E402
from benchmarks.rollout_drill import PRODUCTION_ENV  # noqa: E402
from hostagent.client import PlatformClient  # noqa: E402
from hostagent.protocol import PlacementReport, PlacementResult  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=200)
    parser.add_argument("--instances", type=int, default=4, help="instances per host")
    parser.add_argument("--heartbeat-every", type=float, default=10.0)
    parser.add_argument("--poll-every", type=float, default=1.0, help="short polls (and after an error)")
    parser.add_argument(
        "--long-poll-wait", type=float, default=25.0, help="0: short polls every --poll-every"
    )
    parser.add_argument("--deploy-hosts", type=int, default=50)
    parser.add_argument("--load-ms", type=float, default=0.0, help="the fake instances' model load time")
    parser.add_argument("--phase", type=float, default=30.0, help="seconds of each measured idle phase")
    parser.add_argument(
        "--threads",
        type=int,
        default=256,
        help="threads per platform web process (a held poll pins one: more than --hosts / --workers)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="platform web processes (each holds its own share of the polls)",
    )
    parser.add_argument(
        "--database-url", default=f"postgres://postgres@127.0.0.1:5432/fleet_scale_{os.getpid()}"
    )
    parser.add_argument("--timeout", type=float, default=900)
    # A handful of hosts, 2-second phases, heartbeats and long polls short enough to happen in them.
    return smoke.parse_args(
        parser, argv, hosts=3, instances=1, heartbeat_every=1.0, long_poll_wait=2.0, deploy_hosts=2,
        phase=2.0, threads=24, timeout=120,
    )  # fmt: skip


# -- the platform ------------------------------------------------------------------------------------------
def create_database(url: str) -> None:
    import psycopg

    parts = urlsplit(url)
    name = parts.path.lstrip("/")
    admin = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')


def drop_database(url: str) -> None:
    import psycopg

    parts = urlsplit(url)
    with psycopg.connect(urlunsplit(parts._replace(path="/postgres")), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{parts.path.lstrip("/")}" WITH (FORCE)')


def setup_django(args, scratch: Path) -> None:
    os.environ.update(
        DEBUG="1",
        VAR_DIR=str(scratch),
        DATABASE_URL=args.database_url,
        CELERY_BROKER_URL="filesystem://",
        CELERY_RESULT_BACKEND=f"file://{scratch / 'results'}",
        DJANGO_SETTINGS_MODULE="serving_platform.settings",
        ARTIFACT_ROOT=str(scratch / "artifacts"),
    )
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def group_cpu_seconds(pgid: int) -> float:
    """utime + stime of every process in the web server's process group (gunicorn master and worker)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # field 5 of stat: pgrp
            total += int(fields[11]) + int(fields[12])
    return total / CLOCK_TICKS


def start_web(scratch: Path, *, threads: int, workers: int = 1) -> tuple[subprocess.Popen, str]:
    """A platform web server as production runs it (gunicorn, gthread), logging to ``scratch/web.log``;
    returns it with its URL once ``/healthz`` answers. Also used by ``deploy.py``."""
    from backend_ge.runtime import free_port

    port = free_port()
    log = (scratch / "web.log").open("wb")
    env = (
        os.environ.copy()
        | PRODUCTION_ENV
        | {
            # The platform holds at most WEB_THREADS - 16 polls per process (AGENT_LONG_POLL_MAX_WAITERS).
            "WEB_THREADS": str(threads),
        }
    )
    web = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "serving_platform.wsgi", "--config", "python:serving_platform.gunicorn_hooks", "--bind", f"127.0.0.1:{port}",
         "--workers", str(workers), "--threads", str(threads), "--worker-class", "gthread", "--timeout", "120"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    import requests

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{url}/healthz", timeout=2).status_code == 200:
                return web, url
        except requests.RequestException:
            time.sleep(0.3)
    raise SystemExit(f"the platform web process did not start:\n{(scratch / 'web.log').read_text()[-2000:]}")


def make_fleet(args) -> tuple[list[tuple[str, str]], object, object]:
    """Hosts with their instances and credentials (as staff + join would make them), a team and a version."""
    from apps.fleet import services

    credentials = []
    for index in range(args.hosts):
        host, token = services.create_host(actor=None, name=f"sim-{index:04d}", address="127.0.0.1")
        for n in range(args.instances):
            port = 20000 + n * 3
            services.create_instance(
                actor=None,
                host=host,
                name=f"cpu-{n}",
                http_port=port,
                grpc_port=port + 1,
                metrics_port=port + 2,
            )
        _, credential = services.join_host(token)
        credentials.append((host.name, credential))
    return credentials, *make_version(scratch_model=Path(os.environ["VAR_DIR"]) / "src.onnx")


def make_version(scratch_model: Path):
    import numpy as np
    from django.contrib.auth import get_user_model
    from onnx import TensorProto, helper

    from apps.registry.models import ModelVersion, RegisteredModel, SourceFormat, VersionState
    from apps.teams import services as team_services
    from backend_ge.convert import prepare_onnx

    owner = get_user_model().objects.create_user("fleet-bench", password="fleet-bench-password-1")
    team = team_services.create_team(actor=owner, name="Fleet bench", slug="fleet-bench")
    team.quota_instances = 100_000
    team.save()
    weights = np.ones((4, 2), dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["input", "w"], ["output"])],
        "tiny",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", 2])],
        initializer=[helper.make_tensor("w", TensorProto.FLOAT, weights.shape, weights.flatten().tolist())],
    )
    model_proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model_proto.ir_version = 8
    scratch_model.write_bytes(model_proto.SerializeToString())
    model = RegisteredModel.objects.create(team=team, name="Tiny", slug="tiny", created_by=owner)
    version = ModelVersion.objects.create(
        model=model,
        number=1,
        state=VersionState.CONVERTING,
        source_format=SourceFormat.ONNX,
        created_by=owner,
    )
    version.servable_dir().parent.mkdir(parents=True, exist_ok=True)
    prepared = prepare_onnx(scratch_model, version.servable_dir() / "1", name=model.triton_model_name())
    version.signature = prepared.signature.to_dict()
    version.config_text = (version.servable_dir() / "config.pbtxt").read_text()
    version.state = VersionState.READY
    version.save()
    return owner, version


# -- the simulated agents ----------------------------------------------------------------------------------
class Latencies:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.samples: dict[str, list[float]] = defaultdict(list)
        self.errors: dict[str, int] = defaultdict(int)
        self.first_error: dict[str, str] = {}

    def error(self, kind: str, exc: Exception) -> None:
        with self.lock:
            self.errors[kind] += 1
            self.first_error.setdefault(kind, f"{exc.__class__.__name__}: {exc}"[:300])

    def add(self, kind: str, seconds: float) -> None:
        with self.lock:
            self.samples[kind].append(seconds * 1000)

    def reset(self) -> None:
        with self.lock:
            self.samples.clear()

    def count(self, kind: str) -> int:
        with self.lock:
            return len(self.samples.get(kind, []))

    def report(self) -> list[str]:
        lines = []
        with self.lock:
            for kind, values in sorted(self.samples.items()):
                if kind == HELD:
                    continue
                ordered = sorted(values)
                p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
                lines.append(
                    f"  {kind:<14} n={len(values):>6}  p50 {statistics.median(values):7.1f} ms  p99 {p99:7.1f} ms"
                )
            held = sorted(self.samples.get(HELD, []))
            if held:
                lines.append(
                    f"  {HELD:<14} n={len(held):>6}  held p50 {statistics.median(held) / 1000:5.1f} s, "
                    f"{sum(v < 1000 * 0.5 for v in held)} answered at once (the process held its share)"
                )
            lines += [
                f"  {kind}: {n} errors, the first: {self.first_error.get(kind, '')}"
                for kind, n in sorted(self.errors.items())
            ]
        return lines


HELD = "held poll 304"


FACTS = {"cpus": 4, "memory_mb": 16000, "platform": "sim"}


class SimulatedAgent(threading.Thread):
    """Speaks the agent API like ``HostAgent`` does, with fake instances in place of tritonserver: this thread
    heartbeats, a second one polls the desired state (held by the platform, or every --poll-every s)."""

    def __init__(self, platform: str, credential: str, args, latencies: Latencies, stop: threading.Event):
        super().__init__(daemon=True)
        self.client = PlatformClient(platform, credential, retries=0, timeout=30)
        self.args, self.latencies, self.stop_event = args, latencies, stop
        self.polling = threading.Event()
        self.etag: str | None = None
        self.applied: dict[int, int] = {}
        self.tails: list[dict] = []
        self.seen_at: float | None = None  # when a poll last brought a new state (time.monotonic())
        self.poller = threading.Thread(target=self.poll_loop, daemon=True)

    def timed(self, kind: str, call):
        started = time.perf_counter()
        try:
            return call()
        except Exception as exc:  # counted, and the agent carries on as HostAgent does
            self.latencies.error(kind, exc)
            return None
        finally:
            self.latencies.add(kind, time.perf_counter() - started)

    def run(self) -> None:
        # Spread the fleet's calls over the intervals, as agents started at different times are.
        rng = __import__("random").Random(id(self))
        next_beat = time.monotonic() + rng.uniform(0, self.args.heartbeat_every)
        state = self.timed("desired-state", lambda: self.client.desired_state(None))
        if state:
            self.etag = state[0]
            for instance in state[1]["instances"]:
                self.timed(
                    "instance",
                    lambda i=instance: self.client.report_instance(i["id"], {"state": "READY", "pid": 1}),
                )
            # What HostAgent sends: each running instance's last 30 log lines (unchanged while it idles).
            self.tails = [
                {"id": i["id"], "log_tail": "I1201 Started HTTPService at 0.0.0.0:8100\n" * 30}
                for i in state[1]["instances"]
            ]
        self.poller.start()
        while not self.stop_event.is_set():
            if time.monotonic() >= next_beat:
                body = {"facts": FACTS, "npu": None, "instances": self.tails}
                self.timed("heartbeat", lambda b=body: self.client.heartbeat(b))
                # A late agent skips what it missed, as HostAgent's loops do: no catch-up bursts.
                next_beat = max(next_beat + self.args.heartbeat_every, time.monotonic())
            self.stop_event.wait(max(0.0, next_beat - time.monotonic()))

    def poll_loop(self) -> None:
        rng = __import__("random").Random(id(self) + 1)
        wait = self.args.long_poll_wait
        while not self.stop_event.is_set():
            if not self.polling.is_set():
                self.polling.wait(0.5)
                if self.polling.is_set():  # start spread over one interval, as agents started apart are
                    self.stop_event.wait(rng.uniform(0, self.args.poll_every))
                continue
            started = time.perf_counter()
            try:
                if wait:
                    etag, state = self.client.desired_state(self.etag, wait=wait)
                else:
                    etag, state = self.client.desired_state(self.etag)
            except Exception as exc:
                self.latencies.error("desired-state", exc)
                self.stop_event.wait(self.args.poll_every)
                continue
            elapsed = time.perf_counter() - started
            if state is None:
                self.latencies.add(HELD if wait else "desired-state", elapsed)
                if not wait or elapsed < 0.5:  # short polls, or a poll the platform could not hold
                    self.stop_event.wait(max(0.0, self.args.poll_every - elapsed))
                continue
            self.seen_at = time.monotonic()
            if not wait:
                self.latencies.add("desired-state", elapsed)
            self.etag = etag
            self.apply(state)

    def apply(self, state: dict) -> None:
        report = self.client.report_placement
        for placement in state["placements"]:
            generation = placement["generation"]
            if (
                placement["applied_generation"] == generation
                or self.applied.get(placement["id"]) == generation
            ):
                continue
            if placement["undeploy"]:
                self.timed(
                    "report",
                    lambda p=placement, g=generation: report(
                        p["id"], PlacementReport(g, PlacementResult.UNLOADED)
                    ),
                )
            else:
                self.timed(
                    "report",
                    lambda p=placement, g=generation: report(
                        p["id"], PlacementReport(g, PlacementResult.STARTED)
                    ),
                )
                time.sleep(self.args.load_ms / 1000)  # the fake instance's load
                loaded = PlacementReport(generation, PlacementResult.LOADED, version=placement["target"])
                self.timed("report", lambda p=placement, b=loaded: report(p["id"], b))
            self.applied[placement["id"]] = generation


def main() -> int:
    args = parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="fleet-scale-"))
    create_database(args.database_url)
    web = None
    stop = threading.Event()
    deadline = time.monotonic() + args.timeout
    try:
        setup_django(args, scratch)
        started = time.perf_counter()
        credentials, owner, version = make_fleet(args)
        print(
            f"fleet: {args.hosts} hosts x {args.instances} instances created in {time.perf_counter() - started:.1f} s"
        )
        web, url = start_web(scratch, threads=args.threads, workers=args.workers)
        latencies = Latencies()
        agents = [SimulatedAgent(url, credential, args, latencies, stop) for _, credential in credentials]
        for agent in agents:
            agent.start()
        time.sleep(min(args.heartbeat_every, 10) + 2)  # every agent has fetched its state and said hello once
        mode = (
            f"long poll, wait {args.long_poll_wait:g} s"
            if args.long_poll_wait
            else f"short poll every {args.poll_every:g} s"
        )
        print(f"agents: {mode}; platform: {args.workers} gunicorn process(es), {args.threads} threads each")

        # Phase 1: heartbeats only.
        latencies.reset()
        cpu0, t0 = group_cpu_seconds(web.pid), time.monotonic()
        time.sleep(args.phase)
        cpu_heartbeats, seconds = group_cpu_seconds(web.pid) - cpu0, time.monotonic() - t0
        beats = len(latencies.samples.get("heartbeat", []))
        print(
            f"\nphase 1 - heartbeats only, {seconds:.0f} s: {beats} heartbeats, platform CPU {cpu_heartbeats:.2f} s"
        )
        if beats:
            print(f"  platform CPU per heartbeat: {cpu_heartbeats / beats * 1000:.2f} ms")
        print(*latencies.report(), sep="\n")

        # Phase 2: the idle fleet, polling its desired state.
        for agent in agents:
            agent.polling.set()
        time.sleep(2)
        latencies.reset()
        cpu0, t0 = group_cpu_seconds(web.pid), time.monotonic()
        time.sleep(args.phase)
        cpu_idle, seconds = group_cpu_seconds(web.pid) - cpu0, time.monotonic() - t0
        polls = latencies.count("desired-state") + latencies.count(HELD)
        print(
            f"\nphase 2 - idle fleet (heartbeat every {args.heartbeat_every:g} s, {mode}), "
            f"{seconds:.0f} s: {polls} polls answered, platform CPU {cpu_idle / seconds * 100:.1f} % of one core"
        )
        print(*latencies.report(), sep="\n")

        # Phase 2b: every host's desired state changes at once; how long until each agent has it.
        from apps.fleet.models import Host
        from apps.fleet.services import notify_hosts

        for agent in agents:
            agent.seen_at = None
        changed_at = time.monotonic()
        notify_hosts(Host.objects.values_list("pk", flat=True))
        while time.monotonic() < min(deadline, changed_at + 30) and any(a.seen_at is None for a in agents):
            time.sleep(0.05)
        delays = sorted((a.seen_at - changed_at) * 1000 for a in agents if a.seen_at is not None)
        if delays:
            print(
                f"\nphase 2b - a change for all {len(agents)} hosts: seen by {len(delays)} agents, "
                f"p50 {statistics.median(delays):.0f} ms, p99 {delays[min(len(delays) - 1, int(len(delays) * 0.99))]:.0f} ms, "
                f"max {delays[-1]:.0f} ms after the change"
            )
        time.sleep(2)

        # Phase 3: one deploy to --deploy-hosts hosts (one instance each).
        from apps.deployments import services
        from apps.deployments.models import DeploymentInstance, PlacementState
        from apps.fleet.models import TritonInstance

        instances = list(
            TritonInstance.objects.filter(
                name="cpu-0", host__name__in=[n for n, _ in credentials[: args.deploy_hosts]]
            )
        )
        latencies.reset()
        for agent in agents:
            agent.seen_at = None
        cpu0 = group_cpu_seconds(web.pid)
        started = time.perf_counter()
        deploy_called = time.monotonic()
        deployment = services.deploy_version(
            actor=owner, model=version.model, version=version, instances=instances
        )
        ready = 0
        while time.monotonic() < deadline:
            ready = DeploymentInstance.objects.filter(
                deployment=deployment, state=PlacementState.READY
            ).count()
            if ready == len(instances):
                break
            time.sleep(0.05)
        elapsed = time.perf_counter() - started
        deployment.refresh_from_db()
        print(
            f"\nphase 3 - deploy to {len(instances)} hosts: {ready}/{len(instances)} placements READY "
            f"{elapsed:.2f} s after the deploy call (fake load time {args.load_ms:g} ms), deployment {deployment.state}; "
            f"platform CPU {group_cpu_seconds(web.pid) - cpu0:.2f} s"
        )
        deployed = {name for name, _ in credentials[: args.deploy_hosts]}
        seen = sorted(
            (a.seen_at - deploy_called) * 1000
            for a, (name, _) in zip(agents, credentials, strict=True)
            if name in deployed and a.seen_at is not None
        )
        if seen:
            print(
                f"  the deploy reached the agents after p50 {statistics.median(seen):.0f} ms, max {seen[-1]:.0f} ms"
            )
        print(*latencies.report(), sep="\n")
        failures = [line for line in (scratch / "web.log").read_text().splitlines() if "Error" in line]
        if failures:
            print(f"platform log: {len(failures)} error lines, the first: {failures[0][:300]}")
        return 0 if ready == len(instances) else 1
    finally:
        stop.set()
        if web is not None:
            os.killpg(web.pid, signal.SIGINT)  # quick shutdown: held polls need no grace
            try:
                web.wait(10)
            except subprocess.TimeoutExpired:  # a worker still waits for its held polls' threads
                os.killpg(web.pid, signal.SIGKILL)
                web.wait(10)
        from django.db import connections

        connections.close_all()
        drop_database(args.database_url)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
