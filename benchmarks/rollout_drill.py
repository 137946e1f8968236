"""Rollout drill: a bad canary under steady load is rolled back by its gates; then a good one goes to 100 %.

Everything real and local: a scratch database (or ``--database-url``), the platform's web server for the agent
API (``manage.py runserver``), a ``python -m hostagent`` with one CPU tritonserver, the HAProxy gateway
(``manage.py gateway``), and the rollout beat task ticking in this process (``rollouts.check_rollouts`` every
0.25 s, as celery beat runs it). A bounded client sends ``--rate`` unversioned requests per second through the
gateway on keep-alive connections without retries, and records which version answered each one.

1. The stable version v1 serves. v2 - the scaler with a ~30 % failure rate on real inputs (it passes the smoke
   test) - is rolled out with steps 20/50/100 %, a ``--interval`` s check, 3 failed checks to roll back.
   Printed: time from start to rollback (and from the canary's first traffic), requests that reached the
   canary, failed requests the clients saw (on the canary, and on the stable version: target 0), and the
   bound max_failed_checks x interval.
2. v3, a good canary, rolled out with steps 10/25/50/100 %: time to 100 % and to promoted (serving alone),
   failed requests (target 0).

    .venv/bin/python benchmarks/rollout_drill.py [--rate 60] [--interval 2] [--database-url postgres://...] [--smoke]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import smoke  # noqa: E402

BODY = json.dumps(
    {"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [1.0, 2.0, 3.0, 4.0]}]}
).encode()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=60, help="client requests per second (steady)")
    parser.add_argument("--interval", type=int, default=2, help="the rollouts' check interval (s)")
    parser.add_argument("--database-url", default="", help="default: a scratch SQLite file")
    parser.add_argument("--timeout", type=float, default=600, help="give up after this many seconds")
    # The drill's length is set by the rollouts' steps and the shortest interval they allow, not by counts.
    return smoke.parse_args(parser, argv, timeout=240)


def free_port() -> int:
    from backend_ge.runtime import free_port as pick

    return pick()


# Production settings for a run's processes: DEBUG off (it keeps every query in memory and wraps each
# cursor), plain HTTP on loopback.
PRODUCTION_ENV = {
    "DEBUG": "0",
    "SECRET_KEY": "benchmark-" + "x" * 50,
    "ALLOWED_HOSTS": "127.0.0.1,localhost",
    "SECURE_SSL_REDIRECT": "0",
    "SESSION_COOKIE_SECURE": "0",
    "CSRF_COOKIE_SECURE": "0",
    "STATIC_MANIFEST": "0",
}


def setup_environment(
    args: argparse.Namespace, name: str = "rollout-drill", production: bool = False
) -> Path:
    """A scratch directory and the settings of a run (``production``: ``PRODUCTION_ENV``, else DEBUG on)."""
    scratch = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    os.environ.update(PRODUCTION_ENV if production else {"DEBUG": "1"})
    os.environ.update(
        VAR_DIR=str(scratch),
        DATABASE_URL=args.database_url or f"sqlite:///{scratch / 'db.sqlite3'}",
        CELERY_BROKER_URL="filesystem://",
        CELERY_RESULT_BACKEND=f"file://{scratch / 'results'}",
        DJANGO_SETTINGS_MODULE="serving_platform.settings",
        ARTIFACT_ROOT=str(scratch / "artifacts"),
        GATEWAY_DIR=str(scratch / "gateway"),
        GATEWAY_BIND=f"127.0.0.1:{free_port()}",
        GATEWAY_GRPC_BIND=f"127.0.0.1:{free_port()}",
        GATEWAY_STATS_BIND=f"127.0.0.1:{free_port()}",
        GATEWAY_SYNC_INTERVAL_MS="500",
        GATEWAY_CHECK_INTERVAL_MS="300",
    )
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    if args.database_url:  # a reused database: start from an empty one
        call_command("flush", interactive=False, verbosity=0)
    return scratch


def make_version(model, onnx_bytes: bytes, scratch: Path):
    from apps.registry.models import ModelVersion, SourceFormat, VersionState
    from backend_ge.convert import prepare_onnx

    number = (model.versions.order_by("-number").values_list("number", flat=True).first() or 0) + 1
    version = ModelVersion.objects.create(
        model=model, number=number, state=VersionState.CONVERTING, source_format=SourceFormat.ONNX
    )
    source = scratch / f"v{number}.onnx"
    source.write_bytes(onnx_bytes)
    prepared = prepare_onnx(
        source, version.servable_dir() / "1", name=model.triton_model_name(), max_batch_size=8,
        preferred_batch_sizes=(4, 8), max_queue_delay_us=100,
    )  # fmt: skip
    version.signature = prepared.signature.to_dict()
    version.config_text = (version.servable_dir() / "config.pbtxt").read_text()
    version.state, version.toolchain = VersionState.READY, "onnx"
    version.save()
    return version


def wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise SystemExit(f"timed out after {timeout:g}s waiting for {what}")


class Client:
    """Steady, bounded load: ``rate`` requests per second over a few keep-alive connections, no retries."""

    def __init__(
        self, port: int, token: str, rate: float, threads: int = 4, max_seconds: float = 600
    ) -> None:
        self.port, self.token = port, token
        self.period = threads / rate
        self.deadline = time.monotonic() + max_seconds
        self.by_version: Counter = Counter()  # answered by version
        self.failed: Counter = Counter()  # failed, by version when the error names it ("canary" / "stable")
        self.samples: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def start(self) -> Client:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def snapshot(self) -> tuple[Counter, Counter]:
        with self._lock:
            return Counter(self.by_version), Counter(self.failed)

    def _run(self) -> None:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.token}"}
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        next_at = time.monotonic()
        while not self._stop.is_set() and time.monotonic() < self.deadline:
            next_at += self.period
            try:
                connection.request("POST", "/v2/models/drill__scaler/infer", body=BODY, headers=headers)
                response = connection.getresponse()
                raw, status = response.read(), response.status
                if response.will_close:
                    connection.close()
                    connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            except (OSError, http.client.HTTPException) as exc:
                connection.close()
                connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                status, raw = 0, repr(exc).encode()
            with self._lock:
                if status == 200:
                    self.by_version[json.loads(raw)["model_version"]] += 1
                else:
                    # Only the flaky canary has a Gather node: its errors name it.
                    self.failed["canary" if b"Gather" in raw else "other"] += 1
                    if len(self.samples) < 5:
                        self.samples.append(f"{status}: {raw[:160]!r}")
            time.sleep(max(0.0, next_at - time.monotonic()))
        connection.close()


def main() -> int:
    args = parse_args()
    scratch = setup_environment(args)
    from django.contrib.auth import get_user_model
    from django.db import connections

    from apps.deployments import rollouts, services
    from apps.deployments.models import Deployment, DeploymentState, Rollout, RolloutState
    from apps.fleet import services as fleet
    from apps.fleet.models import InstanceState, TritonInstance
    from apps.registry.models import RegisteredModel
    from apps.teams import services as teams
    from tests.deployments.rollout_models import flaky_scaler_onnx
    from tests.support.models import scaler_onnx

    owner = get_user_model().objects.create_user("drill", password="drill-password")
    team = teams.create_team(actor=owner, name="Drill", slug="drill")
    team.quota_requests_per_second = 1_000_000
    team.save()
    model = RegisteredModel.objects.create(team=team, name="Scaler", slug="scaler", created_by=owner)
    v1 = make_version(model, scaler_onnx(2.0), scratch)
    bad = make_version(model, flaky_scaler_onnx(3.0), scratch)
    good = make_version(model, scaler_onnx(4.0), scratch)

    env = dict(os.environ)
    web_port = free_port()
    processes: list[subprocess.Popen] = []
    logs = scratch / "logs"
    logs.mkdir()

    def spawn(name: str, argv: list[str], extra: dict | None = None, drop: tuple = ()) -> subprocess.Popen:
        """``argv`` after the interpreter: ``manage.py ...`` for the platform, ``-m hostagent ...`` for the agent."""
        log = open(logs / f"{name}.log", "ab")  # noqa: SIM115 - the child writes to it
        child_env = {k: v for k, v in {**env, **(extra or {})}.items() if k not in drop}
        process = subprocess.Popen(
            [sys.executable, *argv], cwd=ROOT, env=child_env, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        processes.append(process)
        return process

    beat_stop = threading.Event()

    def beat() -> None:
        try:
            while not beat_stop.wait(0.25):
                rollouts.check_rollouts()
        finally:
            connections.close_all()

    beat_thread = threading.Thread(target=beat, daemon=True)
    client = None
    try:
        spawn("web", ["manage.py", "runserver", f"127.0.0.1:{web_port}", "--noreload"])
        host, join = fleet.create_host(actor=None, name="drill-host", address="127.0.0.1")
        ports = free_port(), free_port(), free_port()
        fleet.create_instance(
            actor=None, host=host, name="cpu-0", http_port=ports[0], grpc_port=ports[1], metrics_port=ports[2]
        )
        agent_var = scratch / "agent"
        agent_var.mkdir()
        # An inference host knows the platform's URL and its credential: no database, no broker.
        agent_env = {"VAR_DIR": str(agent_var), "ARTIFACT_ROOT": str(agent_var / "none"),
                     "FLEET_ROOT": str(scratch / "fleet")}  # fmt: skip
        time.sleep(2)  # the web server binds
        spawn("agent", ["-m", "hostagent", "--platform", f"http://127.0.0.1:{web_port}", "--join-token", join,
                        "--credential-file", str(agent_var / "credential")], agent_env,
              drop=("DATABASE_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"))  # fmt: skip
        instance = wait(
            lambda: TritonInstance.objects.filter(host=host, state=InstanceState.READY).first(),
            180,
            "the instance",
        )
        deployment = services.deploy_version(actor=owner, model=model, version=v1, instances=[instance])
        wait(
            lambda: Deployment.objects.filter(pk=deployment.pk, state=DeploymentState.SERVING).exists(),
            180,
            "v1 to serve",
        )
        spawn("gateway", ["manage.py", "gateway"])
        _, token = teams.create_token(actor=owner, team=team, name="drill")
        gateway_port = int(env["GATEWAY_BIND"].rsplit(":", 1)[1])

        def answers() -> bool:
            try:
                connection = http.client.HTTPConnection("127.0.0.1", gateway_port, timeout=5)
                connection.request("POST", "/v2/models/drill__scaler/infer", body=BODY, headers={
                    "Content-Type": "application/json", "Authorization": f"Bearer {token}"})  # fmt: skip
                return connection.getresponse().status == 200
            except OSError:
                return False

        wait(answers, 60, "the gateway to route v1")
        beat_thread.start()
        client = Client(gateway_port, token, rate=args.rate, max_seconds=args.timeout).start()
        time.sleep(3)

        # 1. The bad canary.
        interval, failures = args.interval, 3
        before, failed_before = client.snapshot()
        started = time.monotonic()
        rollout = rollouts.start_rollout(
            actor=owner, deployment=deployment, canary=bad, steps=[20, 50, 100], step_interval_s=interval,
            min_requests=10, max_failed_checks=failures, traffic_deadline_s=60,
        )  # fmt: skip
        rollout = wait(
            lambda: Rollout.objects.filter(pk=rollout.pk).exclude(state=RolloutState.RUNNING).first(),
            args.timeout,
            "the bad canary to end",
        )
        to_rollback = time.monotonic() - started
        # Let the gateway's weight 0 and the canary's unload settle, then count everything the clients saw.
        wait(
            lambda: not deployment.placements.filter(canary_version__isnull=False).exists(), 60, "the unload"
        )
        time.sleep(2)
        after, failed_after = client.snapshot()
        canary_ok = after[str(bad.number)] - before[str(bad.number)]
        canary_failed = failed_after["canary"] - failed_before["canary"]
        other_failed = failed_after["other"] - failed_before["other"]
        from_traffic = (
            (rollout.finished_at - rollout.step_started_at).total_seconds()
            if rollout.step_started_at
            else None
        )
        total = sum((after - before).values()) + canary_failed + other_failed
        print("\nRollout drill (one CPU instance, real tritonserver, host agent and HAProxy gateway)")
        print(
            f"  client load: {args.rate:g} req/s steady; check interval {interval} s, {failures} failed checks roll back"
        )
        print(f"  bad canary v{bad.number}: {rollout.state} - {rollout.reason}")
        print(f"    start -> rollback: {to_rollback:.1f} s (canary loaded and first traffic after "
              f"{(rollout.step_started_at - rollout.created_at).total_seconds():.1f} s); "
              f"first traffic -> rollback {from_traffic:.1f} s (bound {failures} x {interval} = {failures * interval} s)")  # fmt: skip
        print(f"    requests during the drill: {total}; reached the canary: {canary_ok + canary_failed} "
              f"({canary_ok} answered, {canary_failed} failed)")  # fmt: skip
        print(f"    failed requests seen by clients: {canary_failed} on the canary, {other_failed} elsewhere "
              f"(stable answered {after[str(v1.number)] - before[str(v1.number)]}, none failed)" if not other_failed
              else f"    failed requests seen by clients: {canary_failed} on the canary, {other_failed} ELSEWHERE: {client.samples}")  # fmt: skip

        # 2. The good canary.
        before, failed_before = client.snapshot()
        started = time.monotonic()
        rollout = rollouts.start_rollout(
            actor=owner, deployment=deployment, canary=good, steps=[10, 25, 50, 100], step_interval_s=interval,
            min_requests=10, max_failed_checks=failures, traffic_deadline_s=60,
        )  # fmt: skip
        wait(lambda: Rollout.objects.filter(pk=rollout.pk, current_weight=100).exists() or
             Rollout.objects.filter(pk=rollout.pk).exclude(state=RolloutState.RUNNING).exists(),
             args.timeout, "the good canary at 100 %")  # fmt: skip
        to_full = time.monotonic() - started
        rollout = wait(
            lambda: Rollout.objects.filter(pk=rollout.pk).exclude(state=RolloutState.RUNNING).first(),
            args.timeout,
            "the good canary to end",
        )
        wait(
            lambda: Deployment.objects.filter(pk=deployment.pk, active_version=good, state=DeploymentState.SERVING)
            .exists(),
            120,
            "v3 serving alone",
        )  # fmt: skip
        to_promoted = time.monotonic() - started
        time.sleep(2)
        after, failed_after = client.snapshot()
        failed = sum((failed_after - failed_before).values())
        print(f"  good canary v{good.number}: {rollout.state}; start -> 100 %: {to_full:.1f} s, -> serving alone: "
              f"{to_promoted:.1f} s (4 steps x {interval} s + load); failed requests: {failed}; answered "
              f"{dict(after - before)}")  # fmt: skip
        return 0 if rollout.state == RolloutState.PROMOTED and not failed else 1
    finally:
        if client is not None:
            client.stop()
        beat_stop.set()
        if beat_thread.is_alive():
            beat_thread.join(10)
        for process in reversed(processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)


if __name__ == "__main__":
    raise SystemExit(main())
