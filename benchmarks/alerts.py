"""How long one alert evaluation takes for 1,000 rules over seeded rollups (target: < 1 s).

Seeds a throwaway database: 50 teams (``--teams``), each with 10 models deployed on a shared host (10
instances, 8 NPUs), an hour of minute rows per model (30,000 ModelMetrics rows; every fifth model fails 8% of
its requests, every seventh has gone quiet for 20 minutes), an hour of NPU rows, some failed placements, a
quarantined instance and failed conversions; then 20 rules per team (1,000 rules) over every kind, windows of
5, 10 and 15 minutes, some narrowed to one deployment. It times ``evaluate_rules()``: the first run (opens the
alerts) and the steady state after it (``--runs``), with the number of SQL queries of each. The figure judged
is the CPU time of this process on SQLite (``time.process_time``; the database work runs in it too), because
the wall time on a shared machine measures the neighbours; on PostgreSQL it is the wall time. Both are
printed.

The database is a throwaway SQLite file, or with ``--postgres URL`` a scratch database on that server.
Usage: ``python benchmarks/alerts.py [--runs 5] [--teams 50] [--postgres URL] [--smoke]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import smoke  # noqa: E402

MODELS_PER_TEAM = 10
RULES_PER_TEAM = 20
INSTANCES = 10
DEVICES = 8
MINUTES = 60


def seed(now, teams: int) -> None:
    from apps.alerts.models import AlertKind, AlertRule
    from apps.conversions.models import ConversionJob, JobState
    from apps.deployments.models import Deployment, DeploymentInstance, DeploymentState, PlacementState
    from apps.fleet.models import Device, Host, InstanceState, TritonInstance
    from apps.monitoring.models import DeviceMetrics, ModelMetrics
    from apps.registry.models import ModelVersion, RegisteredModel, VersionState
    from apps.teams.models import Team

    host = Host.objects.create(name="bench-host", address="127.0.0.1", last_heartbeat_at=now)
    instances = [
        TritonInstance.objects.create(
            host=host, name=f"npu-{i}", http_port=20000 + 3 * i, grpc_port=20001 + 3 * i,
            metrics_port=20002 + 3 * i, state=InstanceState.QUARANTINED if i == 9 else InstanceState.READY,
        )
        for i in range(INSTANCES)
    ]  # fmt: skip
    devices = [
        Device.objects.create(host=host, npu_id=i, name="310P3", hbm_total_mb=21000) for i in range(DEVICES)
    ]
    DeviceMetrics.objects.bulk_create(
        DeviceMetrics(
            bucket=now - timedelta(minutes=m), device=device, samples=4, hbm_samples=4,
            hbm_used_mb_sum=4 * (20000 if device.npu_id == 0 else 9000), hbm_total_mb=21000,
        )
        for device in devices
        for m in range(1, MINUTES + 1)
    )  # fmt: skip
    metric_rows = []
    kinds = list(AlertKind.values)
    for t in range(teams):
        team = Team.objects.create(name=f"Team {t}", slug=f"team-{t}")
        deployments = []
        for m in range(MODELS_PER_TEAM):
            model = RegisteredModel.objects.create(team=team, name=f"Model {m}", slug=f"model-{m}")
            version = ModelVersion.objects.create(model=model, number=1, state=VersionState.READY)
            deployment = Deployment.objects.create(
                team=team, model=model, active_version=version, state=DeploymentState.SERVING
            )
            Deployment.objects.filter(pk=deployment.pk).update(created_at=now - timedelta(days=1))
            instance = instances[(t + m) % INSTANCES]
            DeploymentInstance.objects.create(
                deployment=deployment, instance=instance, served_version=version,
                state=PlacementState.FAILED if m == 3 and t % 4 == 0 else PlacementState.READY,
            )  # fmt: skip
            deployments.append(deployment)
            index = t * MODELS_PER_TEAM + m
            quiet = 20 if index % 7 == 0 else 0
            for minute in range(1 + quiet, MINUTES + 1):
                failure = 8 if index % 5 == 0 else 0
                metric_rows.append(
                    ModelMetrics(
                        bucket=now - timedelta(minutes=minute), team=team, model=model, version=version,
                        instance=instance, success=100 - failure, failure=failure, inferences=100,
                        executions=50, request_us=100 * 4000.0, p99_us=9000.0 if index % 3 == 0 else 3000.0,
                        quantile_requests=100,
                    )
                )  # fmt: skip
            if m == 9 and t % 5 == 0:
                failed = ModelVersion.objects.create(model=model, number=2, state=VersionState.FAILED)
                ConversionJob.objects.create(
                    version=failed, state=JobState.FAILED, error="bad graph", finished_at=now
                )
        rules = []
        for r in range(RULES_PER_TEAM):
            kind = kinds[r % len(kinds)]
            rules.append(
                AlertRule(
                    team=team, name=f"{kind} {r}", kind=kind, threshold={"error_rate": 5, "p99_latency": 5,
                    "npu_hbm": 90}.get(kind, 0), window_minutes=(5, 10, 15)[r % 3], for_seconds=(r % 2) * 60,
                    deployment=deployments[r % MODELS_PER_TEAM] if r >= 16 and kind in ("error_rate",
                    "p99_latency", "no_traffic") else None,
                )
            )  # fmt: skip
        AlertRule.objects.bulk_create(rules)
    ModelMetrics.objects.bulk_create(metric_rows, batch_size=2000)


def run(args) -> int:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from apps.alerts.models import Alert, AlertRule, AlertState
    from apps.alerts.services import evaluate_rules
    from apps.monitoring.models import ModelMetrics

    now = timezone.now().replace(second=0, microsecond=0)
    started = time.perf_counter()
    seed(now, args.teams)
    print(
        f"seeded {AlertRule.objects.count()} rules, {ModelMetrics.objects.count()} model rows "
        f"in {time.perf_counter() - started:.1f} s"
    )

    def timed(at) -> tuple[float, float, int, object]:
        with CaptureQueriesContext(connection) as queries:
            wall, cpu = time.perf_counter(), time.process_time()
            result = evaluate_rules(now=at)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        return wall, cpu, len(queries), result

    first_wall, first, first_queries, result = timed(now)
    print(
        f"first evaluation: {first * 1000:.0f} ms CPU ({first_wall * 1000:.0f} ms wall), "
        f"{first_queries} queries, {result}"
    )
    times, walls, counts = [], [], []
    for i in range(1, args.runs + 1):
        wall, cpu, count, result = timed(now + timedelta(minutes=i))
        times.append(cpu)
        walls.append(wall)
        counts.append(count)
    print(
        f"steady state over {args.runs} runs: median {statistics.median(times) * 1000:.0f} ms CPU "
        f"({statistics.median(walls) * 1000:.0f} ms wall), max {max(times) * 1000:.0f} ms CPU, "
        f"{max(counts)} queries; last: {result}"
    )
    print(
        f"alerts firing: {Alert.objects.filter(state=AlertState.FIRING).count()}, "
        f"pending: {Alert.objects.filter(state=AlertState.PENDING).count()}"
    )
    # PostgreSQL works in its own processes: there the wall time is the honest figure.
    worst, measure = (max(first_wall, *walls), "wall") if args.postgres else (max(first, *times), "CPU")
    print(f"target < 1 s: {'met' if worst < 1 else 'MISSED'} (worst {worst * 1000:.0f} ms {measure})")
    return 0 if worst < 1 or args.smoke else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--teams", type=int, default=50, help="teams seeded, each with 10 models and 20 rules"
    )
    parser.add_argument("--postgres", default="", help="server URL: benchmark in a scratch database there")
    args = smoke.parse_args(parser, teams=2, runs=1)
    tmp = Path(tempfile.mkdtemp(prefix="alerts-bench-"))
    scratch = f"alerts_bench_{os.getpid()}"
    if args.postgres:
        _admin(args.postgres, f"CREATE DATABASE {scratch}")
        os.environ["DATABASE_URL"] = f"{args.postgres.rstrip('/')}/{scratch}"
    else:
        os.environ["DATABASE_URL"] = f"sqlite:///{tmp / 'bench.sqlite3'}"
    os.environ.setdefault("DEBUG", "1")
    os.environ["VAR_DIR"] = str(tmp / "var")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "serving_platform.settings")
    import django

    django.setup()
    from django.core.management import call_command

    try:
        call_command("migrate", verbosity=0)
        return run(args)
    finally:
        if args.postgres:
            from django.db import connections

            connections.close_all()
            _admin(args.postgres, f"DROP DATABASE IF EXISTS {scratch}")


def _admin(server_url: str, statement: str) -> None:
    import psycopg

    with psycopg.connect(f"{server_url.rstrip('/')}/postgres", autocommit=True) as conn:
        conn.execute(statement)


if __name__ == "__main__":
    sys.exit(main())
