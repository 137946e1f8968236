"""Scheduler at fleet scale: N hosts x 8 devices in one pool, M deployments of 1-4 replicas with mixed
footprints, placed by ``apps.deployments.scheduler`` on PostgreSQL; then one host is lost.

Capacity is simulated (the rows an agent's inventory and the pool template would create: one NPU instance per
device with its HBM minus the reserve as capacity); the decisions, row locks, events and reports are the
platform's own code: ``services.deploy_version`` as the deploy API runs it, ``healing.tick`` as the beat runs
it, ``reports.placement_loaded`` as the agent API runs it for a report. Printed:

1. placement decision time (``scheduler.place_replicas``: candidates locked, memory summed, chosen, rows and
   events written) p50/p99, and the whole ``deploy_version`` call's;
2. packing: devices used against a lower bound (total footprint / one device's capacity), and pending, for
   the pool policy ``spread`` (the default: least loaded first) and again - same deployments, a second pool
   of the same size - for ``binpack`` (most loaded that fits first), with that pool's decision times;
3. over capacity: how many times an instance was found holding more than its capacity (checked after the
   deploys and after every tick of the loss phase; 0 expected);
4. host loss: the host with the most replicas stops its heartbeat; its replicas are retired and placed
   elsewhere by the ticks, the simulated agents report them loaded after ``--load-ms``. The beat notices the
   loss ``grace`` after the last heartbeat, at a tick at most ``tick`` later:
   replaced_all_s = grace_s + tick_s (worst case) + measured (first tick -> every replica READY elsewhere).

A scratch PostgreSQL database (``--database-url``, dropped at the end) and a scratch directory.

    .venv/bin/python benchmarks/scheduler.py [--hosts 200 --deployments 2000] [--json figures.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import smoke  # noqa: E402
from benchmarks.fleet_scale import create_database, drop_database, setup_django  # noqa: E402

DEVICES_PER_HOST = 8
HBM_MB = 65536  # a 910B3's HBM, as npu-smi reports it
RESERVE_MB = 1024
HEARTBEAT_S = 10  # the agents' default heartbeat interval
# Footprints (MiB) and how often each occurs: many small models, a few that take half a device.
FOOTPRINTS = [(256, 30), (1024, 25), (2048, 20), (4096, 12), (8192, 8), (16384, 4), (30000, 1)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=200)
    parser.add_argument("--deployments", type=int, default=2000)
    parser.add_argument("--teams", type=int, default=30)
    parser.add_argument("--load-ms", type=float, default=2000.0, help="a simulated agent's model load time")
    parser.add_argument("--grace", type=int, default=60, help="SCHEDULER_HOST_GRACE_S")
    parser.add_argument("--tick", type=int, default=5, help="SCHEDULER_TICK_S")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.add_argument(
        "--database-url", default=f"postgres://postgres@127.0.0.1:5432/scheduler_bench_{os.getpid()}"
    )
    parser.add_argument("--timeout", type=float, default=900)
    return smoke.parse_args(parser, argv, hosts=4, deployments=12, teams=3, load_ms=50.0, timeout=120)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))] if ordered else 0.0


def make_fleet(args, policy: str = "spread"):
    from django.db import connection
    from django.utils import timezone

    from apps.fleet.models import ExecutorKind, Host, InstanceState, Pool, TritonInstance

    pool = Pool.objects.create(
        name=f"ascend-910b-{policy}", executor=ExecutorKind.NPU, devices_per_instance=1,
        hbm_reserve_mb=RESERVE_MB, placement_policy=policy,
    )  # fmt: skip
    now = timezone.now()
    hosts = Host.objects.bulk_create(
        Host(name=f"{policy}-{i:04d}", address="127.0.0.1", pool=pool, last_heartbeat_at=now, labels={"pool": pool.name})
        for i in range(args.hosts)
    )  # fmt: skip
    TritonInstance.objects.bulk_create(
        TritonInstance(
            host=host, name=f"npu-{d}-0", http_port=18000 + 3 * d, grpc_port=18001 + 3 * d,
            metrics_port=18002 + 3 * d, device_ids=[d], executor=ExecutorKind.NPU, state=InstanceState.READY,
            capacity_mb=HBM_MB - RESERVE_MB, from_template=True,
        )
        for host in hosts
        for d in range(DEVICES_PER_HOST)
    )  # fmt: skip
    with connection.cursor() as cursor:
        # Statistics as autovacuum keeps them on a live database (a scratch one has none after the bulk
        # inserts, and the planner would take 1,600 instances for one row).
        cursor.execute("ANALYZE")
    return pool


def make_versions(args, rng: random.Random, prefix: str = ""):
    from django.contrib.auth import get_user_model

    from apps.registry.models import ModelVersion, RegisteredModel, SourceFormat, VersionState
    from apps.teams.models import Team

    owner = get_user_model().objects.create_user(
        f"scheduler-bench{prefix}", password="scheduler-bench-password-1"
    )
    teams = Team.objects.bulk_create(
        Team(name=f"Team {prefix}{i}", slug=f"team{prefix}-{i}", quota_deployed_models=100_000,
             quota_instances=100_000)
        for i in range(args.teams)
    )  # fmt: skip
    models = RegisteredModel.objects.bulk_create(
        RegisteredModel(team=teams[i % len(teams)], name=f"m{i}", slug=f"m{i}", created_by=owner)
        for i in range(args.deployments)
    )
    sizes, weights = zip(*FOOTPRINTS, strict=True)
    return owner, ModelVersion.objects.bulk_create(
        ModelVersion(
            model=model, number=1, state=VersionState.READY, source_format=SourceFormat.ONNX, created_by=owner,
            footprint_mb=rng.choices(sizes, weights)[0],
        )
        for model in models
    )  # fmt: skip


def over_capacity(pool) -> int:
    """Instances of the pool holding more than their capacity now (summed over their placements, not read
    from the reserved memory the decisions read)."""
    from apps.deployments import reserved
    from apps.fleet.models import TritonInstance

    rows = list(TritonInstance.objects.filter(host__pool=pool).values_list("pk", "capacity_mb"))
    used = reserved.used_by_instance([pk for pk, _ in rows])
    return sum(1 for pk, capacity in rows if used.get(pk, 0) > capacity)


def reserved_drift(pool) -> int:
    """Instances of the pool whose reserved memory (what the decisions read) differs from the sum over their
    placements (0 expected: the writers keep it)."""
    from apps.deployments import reserved
    from apps.fleet.models import TritonInstance

    return len(
        reserved.reserved_drift(TritonInstance.objects.filter(host__pool=pool).values_list("pk", flat=True))
    )


def timed_decisions(scheduler, durations: list[float], queries: list[int] | None = None):
    """Wrap ``scheduler.place_replicas`` (services and healing call it through the module) with a timer, and
    count the SQL statements each decision sends (a figure the machine's load does not change)."""
    from django.db import connection

    original = scheduler.place_replicas

    def place_replicas(deployment):
        sent = [0]

        def count(execute, sql, params, many, context):
            sent[0] += 1
            return execute(sql, params, many, context)

        started = time.perf_counter()
        try:
            with connection.execute_wrapper(count):
                return original(deployment)
        finally:
            durations.append((time.perf_counter() - started) * 1000)
            if queries is not None:
                queries.append(sent[0])

    place_replicas.__wrapped__ = original
    scheduler.place_replicas = place_replicas


def serve_everything() -> None:
    """The simulated agents loaded every first placement (set up in bulk: not what is measured)."""
    from django.db.models import F, OuterRef, Subquery

    from apps.deployments.models import Deployment, DeploymentInstance, DeploymentState, PlacementState

    target = Deployment.objects.filter(pk=OuterRef("deployment_id")).values("target_version")[:1]
    DeploymentInstance.objects.update(
        state=PlacementState.READY, served_version=Subquery(target),
        applied_generation=F("generation"),
    )  # fmt: skip
    Deployment.objects.exclude(state=DeploymentState.PENDING).update(
        state=DeploymentState.SERVING, active_version=F("target_version"), target_version=None
    )


def report_loaded(placements) -> None:
    """What the agent API does with each agent's ``loaded`` report."""
    from apps.deployments import reports

    for placement in placements:
        version = placement.deployment.target_version or placement.deployment.active_version
        reports.placement_loaded(placement.pk, placement.generation, version)


def lose_a_host(args, pool, figures: dict) -> None:
    from datetime import timedelta

    from django.db.models import Count, Q
    from django.utils import timezone

    from apps.deployments import healing
    from apps.deployments.models import DeploymentInstance, PlacementState
    from apps.fleet.models import Host

    live = Q(instances__placements__retiring_reason="") & ~Q(
        instances__placements__state=PlacementState.UNLOADED
    )
    lost = Host.objects.annotate(n=Count("instances__placements", filter=live)).order_by("-n", "pk").first()
    affected = set(
        DeploymentInstance.objects.filter(instance__host=lost, retiring_reason="")
        .exclude(state=PlacementState.UNLOADED)
        .values_list("deployment_id", flat=True)
    )
    figures["lost_host_replicas"] = len(affected)
    others = Host.objects.exclude(pk=lost.pk)
    others.update(last_heartbeat_at=timezone.now())
    # Its last heartbeat was the grace ago: the next tick finds it lost.
    Host.objects.filter(pk=lost.pk).update(
        last_heartbeat_at=timezone.now() - timedelta(seconds=args.grace + 1)
    )
    started = time.monotonic()
    deadline = started + args.timeout
    ticks = 0
    while time.monotonic() < deadline:
        ticks += 1
        healing.tick()
        figures["over_capacity"] += over_capacity(pool)
        others.update(last_heartbeat_at=timezone.now())  # the rest of the fleet keeps beating
        pending = list(
            DeploymentInstance.objects.filter(deployment_id__in=affected, retiring_reason="")
            .exclude(state__in=[PlacementState.READY, PlacementState.UNLOADED])
            .select_related("deployment__target_version", "deployment__active_version")
        )
        ready_elsewhere = (
            DeploymentInstance.objects.filter(
                deployment_id__in=affected, retiring_reason="", state=PlacementState.READY
            )
            .exclude(instance__host=lost)
            .values("deployment_id")
            .distinct()
            .count()
        )
        if not pending and ready_elsewhere == len(affected):
            break
        time.sleep(args.load_ms / 1000)  # the agents load what they were given, in parallel
        report_loaded(pending)
    else:
        raise SystemExit(f"the lost host's replicas were not all READY elsewhere within {args.timeout:.0f} s")
    measured = time.monotonic() - started
    figures.update(
        replace_measured_s=round(measured, 2),
        replaced_all_s=round(args.grace + args.tick + measured, 2),
        loss_ticks=ticks,
    )


def deploy_all(args, pool, versions, owner, rng: random.Random) -> dict:
    """Every version deployed into ``pool`` as the deploy API does it, timed; then the packing figures."""
    from django.utils import timezone

    from apps.deployments import scheduler, services
    from apps.deployments.models import Deployment, DeploymentInstance, PlacementState
    from apps.fleet.models import Host

    decisions: list[float] = []
    queries: list[int] = []
    timed_decisions(scheduler, decisions, queries)
    calls = []
    beat_at = time.monotonic()
    for version in versions:
        if time.monotonic() - beat_at > HEARTBEAT_S:  # the simulated agents keep beating meanwhile
            Host.objects.update(last_heartbeat_at=timezone.now())
            beat_at = time.monotonic()
        replicas = rng.randint(1, 4)
        started = time.perf_counter()
        services.deploy_version(
            actor=owner, model=version.model, version=version, replicas=replicas, pool=pool
        )
        calls.append((time.perf_counter() - started) * 1000)
    scheduler.place_replicas = scheduler.place_replicas.__wrapped__
    deployments = Deployment.objects.filter(pool=pool)
    placements = DeploymentInstance.objects.filter(deployment__pool=pool)
    need = sum(mb * n for mb, n in deployments.values_list("target_version__footprint_mb", "replicas"))
    # No packing does better than the footprints' sum over one device, nor than the widest spread deployment.
    widest = max(deployments.values_list("replicas", flat=True), default=1)
    return {
        "replicas": placements.count(),
        "placement_p50_ms": round(statistics.median(decisions), 2),
        "placement_p99_ms": round(percentile(decisions, 99), 2),
        "placement_queries_max": max(queries, default=0),
        "load_average": round(os.getloadavg()[0], 1),
        "deploy_call_p50_ms": round(statistics.median(calls), 2),
        "deploy_call_p99_ms": round(percentile(calls, 99), 2),
        "pending_deployments": deployments.exclude(pending_reason="").count(),
        "over_capacity": over_capacity(pool),
        "devices_used": placements.exclude(state=PlacementState.UNLOADED)
        .values("instance")
        .distinct()
        .count(),
        "devices_lower_bound": max(widest, math.ceil(need / (HBM_MB - RESERVE_MB))),
        "footprint_total_gib": round(need / 1024, 1),
    }


def run(args, scratch: Path) -> dict:
    from django.conf import settings

    from apps.deployments import scheduler

    settings.SCHEDULER_HOST_GRACE_S = args.grace
    figures = {
        "hosts": args.hosts,
        "devices": args.hosts * DEVICES_PER_HOST,
        "deployments": args.deployments,
        "grace_s": args.grace,
        "tick_s": args.tick,
    }
    # The default policy (spread) is measured in full, the host loss included; then the same deployments
    # (same footprints and replicas) into a binpack pool of the same size, for its packing and decision time.
    rng = random.Random(args.seed)
    pool = make_fleet(args, "spread")
    owner, versions = make_versions(args, rng)
    figures.update(deploy_all(args, pool, versions, owner, rng))
    serve_everything()
    decisions: list[float] = []
    timed_decisions(scheduler, decisions)
    lose_a_host(args, pool, figures)
    scheduler.place_replicas = scheduler.place_replicas.__wrapped__
    figures["replacement_placement_p99_ms"] = round(percentile(decisions, 99), 2)
    rng = random.Random(args.seed)
    packed = make_fleet(args, "binpack")
    owner, versions = make_versions(args, rng, prefix="b")
    figures["binpack"] = deploy_all(args, packed, versions, owner, rng)
    figures["over_capacity"] += figures["binpack"]["over_capacity"] + over_capacity(pool)
    figures["reserved_drift"] = reserved_drift(pool) + reserved_drift(packed)
    return figures


def print_figures(f: dict) -> None:
    print(
        f"fleet: {f['hosts']} hosts x {DEVICES_PER_HOST} devices, {f['deployments']} deployments, {f['replicas']} replicas"
    )
    print(
        f"placement decision: p50 {f['placement_p50_ms']} ms  p99 {f['placement_p99_ms']} ms (target p99 < 50 ms)"
    )
    print(
        f"SQL statements per decision: at most {f['placement_queries_max']}; "
        f"load average during the run: {f['load_average']}"
    )
    print(f"deploy_version call: p50 {f['deploy_call_p50_ms']} ms  p99 {f['deploy_call_p99_ms']} ms")
    b = f["binpack"]
    for policy, g in (("spread", f), ("binpack", b)):
        print(
            f"packing ({policy}): {g['devices_used']} devices used, lower bound {g['devices_lower_bound']} "
            f"({g['footprint_total_gib']} GiB of footprints); pending deployments: {g['pending_deployments']}"
        )
    print(
        f"placement decision (binpack pool): p50 {b['placement_p50_ms']} ms  p99 {b['placement_p99_ms']} ms"
    )
    print(f"over capacity: {f['over_capacity']} (0 expected)")
    print(
        f"reserved memory differing from the sum over placements: {f['reserved_drift']} instances (0 expected)"
    )
    print(
        f"host loss: {f['lost_host_replicas']} replicas placed elsewhere and READY in {f['replace_measured_s']} s "
        f"after the first tick ({f['loss_ticks']} ticks); replaced_all_s = grace {f['grace_s']} + tick "
        f"{f['tick_s']} + {f['replace_measured_s']} = {f['replaced_all_s']} s (target < grace + 15 s)"
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="scheduler-bench-"))
    create_database(args.database_url)
    try:
        setup_django(args, scratch)
        figures = run(args, scratch)
        from django.db import connections

        connections.close_all()
    finally:
        drop_database(args.database_url)
        shutil.rmtree(scratch, ignore_errors=True)
    print_figures(figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 1 if figures["over_capacity"] or figures["reserved_drift"] else 0


if __name__ == "__main__":
    sys.exit(main())
