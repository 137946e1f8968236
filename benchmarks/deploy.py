"""Deploy benchmark: platform overhead of a deploy, and the seed's "100 models at once" on one instance.

1. Deploy latency: ``deploy_version()`` (what the deploy API calls) until the deployment is SERVING, minus
   Triton's own load time for the same model measured directly on a separate tritonserver (target: platform
   overhead <= 1 s).
2. N small models (default 100) deployed to one instance: total time, the instance's memory (tritonserver
   plus its python backend stubs), and whether every model is ready in Triton exactly when the database says
   SERVING - right after the last deploy and again ``--recheck-after`` (30) s later, so a reconcile that undoes
   a load shows. Exits 1 when a check differs.
3. Restart to serving: the instance's tritonserver is killed with SIGKILL and the time until the first, half
   and all N models answer ready again (the agent restarts the server and reloads them, ``--parallel-loads``
   at a time) is printed, and until the platform says every placement READY again (target: all under 60 s for
   100 small models). With ``--compare-serial`` (the default) the agent is then restarted with
   ``--parallel-loads 1`` and the same kill is timed again, so both figures come from one run, side by side.

Everything runs here: a scratch database and Celery's filesystem broker under a temp directory (or
``--database-url``), a platform web process, a real ``python -m hostagent`` process talking to it over the agent
API, real tritonservers. Bounded by ``--timeout``.

    .venv/bin/python benchmarks/deploy.py [--models 100] [--parallel-loads 4] [--no-compare-serial]
                                          [--database-url postgres://...] [--smoke]
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import smoke  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=int, default=100, help="models deployed to one instance")
    parser.add_argument("--latency-runs", type=int, default=3)
    parser.add_argument("--database-url", default="", help="default: a scratch SQLite file")
    parser.add_argument("--timeout", type=float, default=1200, help="give up after this many seconds")
    parser.add_argument(
        "--recheck-after", type=float, default=30, help="check readiness again after this many seconds"
    )
    parser.add_argument("--parallel-loads", type=int, default=4, help="the agent's --parallel-loads")
    parser.add_argument(
        "--compare-serial",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time the restart again with the agent loading one model at a time",
    )
    return smoke.parse_args(parser, argv, models=2, latency_runs=1, recheck_after=1, timeout=240)


def setup_environment(args: argparse.Namespace) -> Path:
    scratch = Path(tempfile.mkdtemp(prefix="deploy-bench-"))
    os.environ.update(
        DEBUG="1",
        VAR_DIR=str(scratch),
        DATABASE_URL=args.database_url or f"sqlite:///{scratch / 'db.sqlite3'}",
        CELERY_BROKER_URL="filesystem://",
        CELERY_RESULT_BACKEND=f"file://{scratch / 'results'}",
        DJANGO_SETTINGS_MODULE="serving_platform.settings",
    )
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    if args.database_url:  # a reused database: start from an empty fleet
        from apps.fleet.models import Host
        from apps.registry.models import RegisteredModel

        RegisteredModel.objects.all().delete()
        Host.objects.all().delete()
    return scratch


def small_model_bytes(seed: int) -> bytes:
    import numpy as np
    from onnx import TensorProto, helper

    rng = np.random.default_rng(seed)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["input", "w"], ["output"])],
        "small",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", 8])],
        initializer=[helper.make_tensor("w", TensorProto.FLOAT, w.shape, w.flatten().tolist())],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model.SerializeToString()


def make_versions(team, owner, count: int, prefix: str, scratch: Path) -> list:
    from apps.registry.models import ModelVersion, RegisteredModel, SourceFormat, VersionState
    from backend_ge.convert import prepare_onnx

    versions = []
    for i in range(count):
        model = RegisteredModel.objects.create(
            team=team, name=f"{prefix} {i}", slug=f"{prefix}-{i}", created_by=owner
        )
        version = ModelVersion.objects.create(
            model=model, number=1, state=VersionState.CONVERTING, source_format=SourceFormat.ONNX
        )
        source = scratch / f"{prefix}-{i}.onnx"
        source.write_bytes(small_model_bytes(i))
        prepared = prepare_onnx(source, version.servable_dir() / "1", name=model.triton_model_name())
        version.signature = prepared.signature.to_dict()
        version.config_text = (version.servable_dir() / "config.pbtxt").read_text()
        version.state = VersionState.READY
        version.save()
        versions.append(version)
    return versions


def direct_load_seconds(version, scratch: Path, runs: int) -> float:
    """Triton's own time to load the model: a separate tritonserver, the same files, load -> READY."""
    from backend_ge.runtime import TritonServer
    from hostagent.repository import materialize_model

    repository = scratch / "direct-repository"
    name = version.model.triton_model_name()
    materialize_model(repository, name, {version.number: version.servable_dir()}, version.config_text)
    timings = []
    # Served as the agent serves it (complete configs, no auto-complete stub).
    with TritonServer(repository, workdir=scratch / "direct", auto_complete_config=False) as server:
        server.start()
        for _ in range(runs):
            started = time.perf_counter()
            server.load_model(name)
            while not server.is_model_ready(name, str(version.number)):
                time.sleep(0.01)
            timings.append(time.perf_counter() - started)
            server.unload_model(name)
            while server.is_model_ready(name):
                time.sleep(0.05)
    return statistics.median(timings)


def wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}")


def group_rss_mb(pid: int) -> float:
    """Resident memory of a process and everything in its process group (tritonserver + stubs)."""
    total_kb = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.getpgid(int(proc.name)) != pid:
                continue
            for line in (proc / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
        except (OSError, ProcessLookupError, ValueError):
            continue
    return total_kb / 1024


def readiness(url: str, versions: list) -> dict:
    """Triton's answer for every model next to the database's: SERVING must mean ready at that version."""
    import tritonclient.http as httpclient

    from apps.deployments.models import Deployment, DeploymentState

    client = httpclient.InferenceServerClient(url)
    ready = serving = 0
    differ = []
    try:
        for version in versions:
            name = version.model.triton_model_name()
            deployment = Deployment.objects.filter(model=version.model).order_by("-id").first()
            is_serving = deployment is not None and deployment.state == DeploymentState.SERVING
            is_ready = client.is_model_ready(name, str(version.number))
            ready += is_ready
            serving += is_serving
            if is_ready != is_serving:
                differ.append(
                    f"{name}: {deployment.state if deployment else 'not deployed'} in the database, "
                    f"{'ready' if is_ready else 'not ready'} in Triton"
                )
    finally:
        client.close()
    return {"ready": ready, "serving": serving, "differ": differ}


def start_agent(platform_url: str, token: str, scratch: Path, parallel_loads: int, log_name: str):
    # The agent talks to a platform web process over the agent API, with neither database nor broker.
    agent_env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "CELERY_BROKER_URL")}
    return subprocess.Popen(
        [sys.executable, "-m", "hostagent", "--platform", platform_url, "--join-token", token,
         "--credential-file", str(scratch / "host-credential"), "--parallel-loads", str(parallel_loads)],
        cwd=ROOT, env=agent_env, stdout=(scratch / log_name).open("wb"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip


def stop_agent(agent: subprocess.Popen) -> None:
    agent.send_signal(signal.SIGTERM)
    try:
        agent.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait(10)


def ready_times(url: str, key_headers: dict, names: list[str], started: float, timeout: float) -> list[float]:
    """Seconds after ``started`` at which each model was ready, from Triton's repository index (one request
    per sweep, every 50 ms: asking each model in turn would cost the machine under test more CPU than the
    agent does); raises SystemExit when not all were ready within ``timeout``."""
    import requests

    wanted = set(names)
    seen: dict[str, float] = {}
    with requests.Session() as session:
        while len(seen) < len(wanted):
            if time.perf_counter() - started > timeout:
                raise SystemExit(f"only {len(seen)}/{len(names)} models ready {timeout:.0f}s after the kill")
            try:
                index = session.post(
                    f"http://{url}/v2/repository/index", json={}, headers=key_headers, timeout=2
                )
                entries = index.json() if index.status_code == 200 else []
            except (requests.RequestException, ValueError):  # the server is down or starting
                entries = []
            now = time.perf_counter() - started
            for entry in entries:
                name = entry.get("name")
                if name in wanted and name not in seen and entry.get("state") == "READY":
                    seen[name] = now
            time.sleep(0.05)
    return sorted(seen.values())


TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pgid: int, *, reaped: bool) -> float:
    """CPU (user + system) of every live process in a process group so far; with ``reaped`` also what its
    processes reaped (python stubs that ended). Not for the agent: it reaps the killed server, whose whole
    life would then count."""
    total = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) == pgid:  # fields[2] is the process group
                # utime, stime (, cutime, cstime: children waited for)
                total += sum(int(x) for x in fields[11 : 15 if reaped else 13])
        except (OSError, ValueError):
            continue
    return total / TICKS


def count_ready(url: str, versions: list) -> int:
    """Models ready in Triton; 0 while the server does not answer (it is being started)."""
    try:
        return readiness(url, versions)["ready"]
    except Exception:  # connection refused, reset: not up yet
        return 0


def restart_to_serving(instance_pk: int, url: str, versions: list, timeout: float, others: dict) -> dict:
    """SIGKILL the instance's tritonserver; seconds until the first, half and all models answer ready, and
    until the platform has every placement READY again (what the gateway routes on).

    Also the CPU seconds the reload cost: the new tritonserver and its stubs (a new process group), and the
    ``others`` (name -> process group: the agent, the platform's web process) over the same window. With
    ``os.cpu_count()`` cores the reload cannot take less than that CPU / cores: the floor."""
    from apps.deployments.models import DeploymentInstance, PlacementState
    from apps.fleet.models import TritonInstance

    instance = TritonInstance.objects.get(pk=instance_pk)
    pid = instance.pid
    deployments = [v.model.deployments.order_by("-id").first().pk for v in versions]
    before = {name: cpu_seconds(pgid, reaped=False) for name, pgid in others.items()}
    wall_before = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    started = time.perf_counter()

    def restarted_pid() -> int | None:
        now = TritonInstance.objects.get(pk=instance_pk).pid
        return now if now not in (pid, None) else None

    new_pid = wait(restarted_pid, 60, "the server to be restarted")
    names = [v.model.triton_model_name() for v in versions]
    times = ready_times(url, instance.key_headers(), names, started, timeout)
    cpu = {"tritonserver + stubs": cpu_seconds(new_pid, reaped=True)}
    wait(
        lambda: (
            DeploymentInstance.objects.filter(
                deployment_id__in=deployments, state=PlacementState.READY
            ).count()
            == len(deployments)
        ),
        max(10.0, timeout - (time.perf_counter() - started)),
        "every placement READY after the restart",
    )
    platform = time.perf_counter() - started
    cpu |= {name: cpu_seconds(pgid, reaped=False) - before[name] for name, pgid in others.items()}
    return {
        "first": times[0],
        "half": times[(len(times) - 1) // 2],
        "all": times[-1],
        "platform": platform,
        "cpu": cpu,
        "window": time.perf_counter() - wall_before,
        "load": os.getloadavg()[0],
    }


def print_restart(parallel: int, figures: dict, models: int) -> None:
    label = f"{parallel} loads at a time:" if parallel > 1 else "one load at a time:"
    cores = os.cpu_count() or 1
    total_cpu = sum(figures["cpu"].values())
    floor = total_cpu / cores
    print(
        f"    {label:<24}first ready {figures['first']:6.1f} s, half {figures['half']:6.1f} s, "
        f"all {figures['all']:6.1f} s; every placement READY {figures['platform']:6.1f} s",
        flush=True,
    )
    split = ", ".join(f"{name} {seconds:.1f}" for name, seconds in figures["cpu"].items())
    print(
        f"    {'':<24}CPU {total_cpu:.1f} s ({split}) = {total_cpu / models:.3f} s per model; "
        f"floor on {cores} cores {floor:.1f} s, READY at {figures['platform'] / max(floor, 1e-9):.1f}x the "
        f"floor (load average {figures['load']:.1f})",
        flush=True,
    )


def main() -> int:
    args = parse_args()
    # A stopped run still stops its agent, servers and web process (the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    scratch = setup_environment(args)
    from django.contrib.auth import get_user_model
    from django.db import transaction

    from apps.deployments import services
    from apps.deployments.models import Deployment, DeploymentState
    from apps.fleet.models import InstanceState, TritonInstance
    from apps.teams import services as team_services
    from backend_ge.runtime import free_port

    owner = get_user_model().objects.create_user("bench", password="bench-password-1")
    team = team_services.create_team(actor=owner, name="Bench", slug=f"bench-{os.getpid()}")
    team.quota_deployed_models = args.models + args.latency_runs + 10
    team.save()
    from apps.fleet import services as fleet_services
    from benchmarks.fleet_scale import start_web

    ports = [free_port() for _ in range(3)]
    host, token = fleet_services.create_host(actor=None, name="bench", address="127.0.0.1")
    fleet_services.create_instance(
        actor=None, host=host, name="cpu-0", http_port=ports[0], grpc_port=ports[1], metrics_port=ports[2]
    )
    web, platform_url = start_web(scratch, threads=8)
    agent = start_agent(platform_url, token, scratch, args.parallel_loads, "agent.log")
    deadline = time.monotonic() + args.timeout
    try:
        instance = wait(
            lambda: TritonInstance.objects.filter(host__name="bench", state=InstanceState.READY).first(),
            120,
            "the agent's instance",
        )

        def deploy_and_wait(versions) -> float:
            started = time.perf_counter()
            deployments = []
            for version in versions:
                with transaction.atomic():
                    deployments.append(
                        services.deploy_version(
                            actor=owner, model=version.model, version=version, instances=[instance]
                        )
                    )
            ids = [d.pk for d in deployments]
            wait(
                lambda: (
                    Deployment.objects.filter(pk__in=ids, state=DeploymentState.SERVING).count() == len(ids)
                    or Deployment.objects.filter(pk__in=ids, state=DeploymentState.FAILED).exists()
                    and "failed"
                ),
                max(10.0, deadline - time.monotonic()),
                f"{len(ids)} deployment(s) to be SERVING",
            )
            failed = Deployment.objects.filter(pk__in=ids, state=DeploymentState.FAILED)
            if failed.exists():
                raise SystemExit(f"deploy failed: {failed.first().last_error}")
            return time.perf_counter() - started

        latency_versions = make_versions(team, owner, args.latency_runs, "latency", scratch)
        direct = direct_load_seconds(latency_versions[0], scratch, args.latency_runs)
        deploy_times = [deploy_and_wait([version]) for version in latency_versions]
        deploy_median = statistics.median(deploy_times)

        many = make_versions(team, owner, args.models, "many", scratch)
        total = deploy_and_wait(many)
        print(f"{args.models} models deployed in {total:.1f} s", flush=True)
        at_end = readiness(f"127.0.0.1:{ports[0]}", many)
        time.sleep(args.recheck_after)  # several reconcile intervals: nothing may be undone afterwards
        later = readiness(f"127.0.0.1:{ports[0]}", many)
        pid = TritonInstance.objects.get(pk=instance.pk).pid
        rss = group_rss_mb(pid)
        url = f"127.0.0.1:{ports[0]}"
        others = {"agent": agent.pid, "platform web": web.pid}
        restarts = {
            args.parallel_loads: restart_to_serving(
                instance.pk, url, many, deadline - time.monotonic(), others
            )
        }
        print(f"restart with {args.parallel_loads} loads at a time measured:", flush=True)
        print_restart(args.parallel_loads, restarts[args.parallel_loads], args.models)
        if args.compare_serial and args.parallel_loads != 1:
            stop_agent(agent)
            agent = start_agent(platform_url, token, scratch, 1, "agent-serial.log")
            # The new agent starts the server and loads every model one at a time; then the same kill.
            wait(
                lambda: count_ready(url, many) == args.models,
                max(10.0, deadline - time.monotonic()),
                "every model ready under the serial agent",
            )
            others["agent"] = agent.pid
            restarts[1] = restart_to_serving(instance.pk, url, many, deadline - time.monotonic(), others)

        print("\nDeploy benchmark (one CPU instance, real tritonserver + host agent)")
        print(f"  Triton's own load time (direct, median of {args.latency_runs}):   {direct * 1000:8.0f} ms")
        print(
            f"  deploy_version() -> SERVING (median of {len(deploy_times)}):       {deploy_median * 1000:8.0f} ms"
        )
        print(
            f"  platform overhead:                                  {(deploy_median - direct) * 1000:8.0f} ms  (target <= 1000 ms)"
        )
        print(
            f"  {args.models} models deployed to one instance:          {total:8.1f} s total, {total / args.models * 1000:.0f} ms per model"
        )
        for label, check in (
            ("right after the last deploy", at_end),
            (f"{args.recheck_after:.0f} s later", later),
        ):
            print(
                f"  {label + ':':<52}{check['ready']}/{args.models} ready in Triton, "
                f"{check['serving']}/{args.models} SERVING, {len(check['differ'])} differ"
            )
            for line in check["differ"][:10]:
                print(f"    {line}")
        print(
            f"  instance memory (tritonserver + stubs, RSS):        {rss:8.0f} MiB ({rss / max(1, args.models + args.latency_runs):.1f} MiB per model)"
        )
        print(
            f"  restart (SIGKILL of the tritonserver) -> all {args.models} models serving again (target < 60 s):"
        )
        for parallel, figures in restarts.items():
            print_restart(parallel, figures, args.models)
        return (
            0
            if all(c["ready"] == c["serving"] == args.models and not c["differ"] for c in (at_end, later))
            else 1
        )
    finally:
        stop_agent(agent)
        os.killpg(web.pid, signal.SIGTERM)
        web.wait(30)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
