"""What an agent does to put deployments on its instances (runs inside the host agent).

It reads the host's desired state (``hostagent.client.DesiredState``, fetched over the agent API) and reports
every result over the same API (``hostagent.reports``): no database here. Every function gets the agent it
works for (``AgentState``: its configuration, client, desired state and reports), never a global.

Switching version without failed requests: the new version is first loaded under a candidate name and
smoke-tested with inputs generated from its signature, so a broken version never touches the served model.
Then the served model is reloaded with both versions (the old one keeps answering while the new one loads),
and finally with only the new one (Triton lets in-flight requests on the old one finish). Clients keep calling
the same model name throughout.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from backend_ge import config as ge_config
from backend_ge import naming, samples
from backend_ge.config import ModelSignature
from backend_ge.errors import public_error
from backend_ge.final_counts import read_final_counts
from backend_ge.runtime import TritonError, TritonServer
from backend_ge.served_config import host_instance_limit
from hostagent import footprint
from hostagent.client import (
    DeploymentSpec,
    DesiredState,
    InstanceSpec,
    PlacementSpec,
    PlatformClient,
    PlatformError,
    VersionSpec,
)
from hostagent.config import AgentConfig
from hostagent.instances import InstanceProcess
from hostagent.protocol import LoadedKind, PlacementState
from hostagent.reports import Reports
from hostagent.repository import RepositoryError, materialize_model, remove_model

log = logging.getLogger(__name__)

# A model that failed to load is retried by reconcile after this long, not every few seconds - unless the
# server restarted meanwhile (the key holds its pid): a fresh server gets one attempt at every model.
LOAD_RETRY_AFTER = 60.0


class AgentState(Protocol):
    """What placement code needs of the agent it works for (``hostagent.supervisor.HostAgent``)."""

    config: AgentConfig
    client: PlatformClient
    desired: DesiredState
    reports: Reports
    # (instance, server pid, model, version) -> (retry after, last failure) of loads that failed
    failed_loads: dict[tuple[int, int, str, int], tuple[float, str]]


class SmokeTestError(RuntimeError):
    """The candidate version loaded but could not answer an inference request."""


def servable_dir(agent: AgentState, version: VersionSpec) -> Path:
    """The version's converted model directory on this machine: downloaded over the agent API into the agent's
    cache (once per version), every file checked against the manifest's sha256."""
    return agent.client.download_version(version, agent.config.cache_dir)


def _materialize(agent: AgentState, proc: InstanceProcess, name: str, versions: list[VersionSpec]) -> None:
    newest = max(versions, key=lambda v: v.number)
    # The devices are the placing instance's, never the tenant's config.
    instance = agent.desired.instance(proc.instance_id)
    device_ids = instance.device_ids if instance is not None else []
    limit, limit_name = host_instance_limit(newest.instance_limit, agent.config.max_model_instances)
    materialize_model(
        proc.repository,
        name,
        {v.number: servable_dir(agent, v) for v in versions},
        newest.config_text,
        device_ids=list(device_ids or ()),
        max_instance_count=limit,
        instance_limit=limit_name,
        steps=newest.steps,
    )


def smoke_test(server: TritonServer, name: str, version: VersionSpec) -> float:
    """One inference with generated inputs; returns the latency in ms."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    signature = ModelSignature.from_dict(version.signature)
    arrays = samples.example_inputs(signature)
    inputs = []
    for tensor in signature.inputs:
        item = httpclient.InferInput(tensor.name, list(arrays[tensor.name].shape), tensor.dtype)
        item.set_data_from_numpy(arrays[tensor.name])
        inputs.append(item)
    client = httpclient.InferenceServerClient(server.http_url, network_timeout=60)
    started = time.perf_counter()
    try:
        result = client.infer(name, inputs, model_version=str(version.number), headers=server.key_headers())
    except InferenceServerException as exc:
        raise SmokeTestError(f"smoke inference on {version} failed: {exc.message()}") from None
    finally:
        client.close()
    for tensor in signature.outputs:
        if result.as_numpy(tensor.name) is None:
            raise SmokeTestError(f"smoke inference on {version} returned no output '{tensor.name}'")
    return (time.perf_counter() - started) * 1000


def _wait_model_ready(server: TritonServer, name: str, version: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.is_model_ready(name, str(version)):
            return
        time.sleep(0.1)
    raise TritonError(f"{name} version {version} did not become ready within {timeout:.0f}s")


def wait_model_unloaded(server: TritonServer, name: str, timeout: float = 60.0) -> None:
    """Triton's unload call returns at once and the model stays UNLOADING while its instances finalize (a
    python stub exits about a second later): its memory is free only once it has left READY and UNLOADING.
    The unload is reported after that - the platform places a waiting replica in the room as soon as it hears
    (an instance's memory budget is never exceeded). Bounded: past ``timeout`` it is reported anyway."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            entry = next((e for e in server.repository_index() if e.get("name") == name), None)
        except (TritonError, OSError):
            return
        if entry is None or entry.get("state") not in ("READY", "UNLOADING"):
            return
        time.sleep(0.05)
    log.warning("%s still unloading after %.0f s; reporting it unloaded", name, timeout)


def _apply_locked(
    agent: AgentState, proc: InstanceProcess, placement_id: int, generation: int | None = None
) -> None:
    """Apply the placement's latest decision. The caller holds ``proc.lock``, so the placement is read here,
    after every earlier load or unload on this instance finished: nothing decided before is acted on stale."""
    placement = agent.desired.placement(placement_id)
    if placement is None:
        return  # deleted meanwhile: nothing to do
    if generation is not None and placement.generation != generation:
        return  # a newer decision was made; its own task (or reconcile) applies it
    if placement.is_applied():
        return  # applied already (by reconcile, or an earlier delivery of this task)
    generation = placement.generation
    deployment: DeploymentSpec = placement.deployment
    name = deployment.triton_model_name()
    server = proc.server
    if placement.undeploy:
        _undeploy(agent, proc, placement, name)
        return
    target = deployment.target_version or deployment.active_version
    if target is None:
        return
    canary = _rollout_canary(deployment)
    if canary is not None and canary != target:
        if placement.canary_version != canary and _waits_for_steps(agent, proc, placement, canary):
            return
        _apply_canary(agent, proc, placement, name, target, canary)
        return
    current = placement.served_version
    if current == target and server.is_model_ready(name, str(target.number)):
        others = _other_versions_ready(server, name, target)
        if not others:
            agent.reports.placement_loaded(placement.pk, generation, target, kind=None)
            return
        # A rollout ended: serve the stable version alone (Triton lets in-flight canary requests finish).
        try:
            _materialize(agent, proc, name, [target])
            with final_counts_reported(agent, proc, name, others):
                _load(proc, name)
            _wait_model_ready(server, name, target.number)
        except (TritonError, RepositoryError, OSError) as exc:
            log.warning("%s: unloading versions %s of %s: %s", placement.instance, others, name, exc)
        agent.reports.placement_loaded(
            placement.pk,
            generation,
            target,
            kind=LoadedKind.CANARY_UNLOADED,
            message=f"{placement.instance} serves {target} alone (unloaded version {', '.join(others)})",
        )
        return
    if _waits_for_steps(agent, proc, placement, target):
        return
    began = time.monotonic()
    if not agent.reports.placement_started(placement.pk, generation):
        return
    served = current if current and server.is_model_ready(name, str(current.number)) else None
    # Promoting a canary this placement already serves beside the stable version: it passed its smoke test
    # when it was loaded, and answered real traffic since.
    tested = (
        served is not None
        and placement.canary_version_id == target.pk
        and server.is_model_ready(name, str(target.number))
    )
    timings: dict[str, int] = {}
    try:
        measured = switch_version(agent, proc, name, served, target, tested=tested, timings=timings)
    except (TritonError, RepositoryError, SmokeTestError, OSError) as exc:
        message = public_error(exc)
        # Report what Triton really serves after the failure, not what it served before. Re-applying the
        # active version (no rollout in flight) keeps it as the placement's version, so reconcile retries it.
        still = served if served and server.is_model_ready(name, str(served.number)) else None
        if still is None and deployment.target_version is None:
            still = target
        agent.reports.placement_failed(
            placement.pk,
            generation,
            message,
            version=target,
            still_serving=still,
            message=f"{target} failed on {placement.instance}: {message}",
        )
        return
    _forget_failed_loads(agent, name)
    if timings:
        seen = agent.desired.seen_at(placement.pk, generation) or began
        timings["queued_ms"] = _ms(began - seen)
        timings["total_ms"] = _ms(time.monotonic() - seen)
    agent.reports.placement_loaded(
        placement.pk,
        generation,
        target,
        message=f"{placement.instance} serves {target}",
        footprint_mb=measured,
        timings=timings or None,
    )


def _ms(seconds: float) -> int:
    return max(0, round(seconds * 1000))


def steps_not_ready(server: TritonServer, version: VersionSpec) -> list[str]:
    """The steps of an ensemble version whose pinned version is not ready on this server ([] for a model)."""
    if not version.steps:
        return []
    try:
        cfg = ge_config.parse_config(version.config_text)
    except ge_config.ConfigError:
        return []  # the load itself reports what is wrong with it
    return [
        f"{step.model_name} v{step.model_version}" if step.model_version > 0 else step.model_name
        for step in cfg.ensemble_scheduling.step
        if not server.is_model_ready(
            step.model_name, str(step.model_version) if step.model_version > 0 else ""
        )
    ]


def _waits_for_steps(
    agent: AgentState, proc: InstanceProcess, placement: PlacementSpec, version: VersionSpec
) -> bool:
    """An ensemble version loads once every step version it calls is ready on the server: its steps'
    placements (a companion loaded beside a step's own version) may still be loading. Reports waiting (the
    placement stays pending; reconcile applies it again) and returns True while one is missing."""
    missing = steps_not_ready(proc.server, version)
    if missing:
        agent.reports.placement_waiting(
            placement.pk,
            placement.generation,
            f"{version} waits for its steps on {placement.instance}: {', '.join(missing)} not ready yet",
        )
    return bool(missing)


def _rollout_canary(deployment: DeploymentSpec) -> VersionSpec | None:
    """The canary to serve beside the active version: a live rollout's, unless a switch is in flight (the
    platform leaves it out of the desired state then)."""
    return deployment.canary


def _other_versions_ready(server: TritonServer, name: str, keep: VersionSpec) -> list[str]:
    try:
        index = server.repository_index()
    except TritonError:
        return []
    return sorted(
        str(entry.get("version"))
        for entry in index
        if entry.get("name") == name
        and entry.get("state") == "READY"
        and str(entry.get("version")) != str(keep.number)
    )


def _apply_canary(
    agent: AgentState,
    proc: InstanceProcess,
    placement: PlacementSpec,
    name: str,
    stable: VersionSpec,
    canary: VersionSpec,
) -> None:
    """A rollout is live: serve the canary beside the stable version (smoke-tested under the candidate name
    first, as a switch does), then report both. The stable version keeps answering throughout."""
    server, generation = proc.server, placement.generation

    def ready(version: VersionSpec) -> bool:
        return server.is_model_ready(name, str(version.number))

    if (
        placement.served_version == stable
        and placement.canary_version == canary
        and ready(stable)
        and ready(canary)
    ):
        agent.reports.placement_canary_loaded(placement.pk, generation, stable, canary)
        return
    try:
        load_canary(agent, proc, name, stable if ready(stable) else None, stable, canary)
    except (TritonError, RepositoryError, SmokeTestError, OSError) as exc:
        agent.reports.placement_canary_failed(
            placement.pk,
            generation,
            f"{canary} failed on {placement.instance}: {public_error(exc)}",
            canary=canary,
            still_serving=stable if ready(stable) else None,
        )
        return
    _forget_failed_loads(agent, name)
    agent.reports.placement_canary_loaded(
        placement.pk,
        generation,
        stable,
        canary,
        message=f"{placement.instance} serves {canary} beside {stable}",
    )


def load_canary(
    agent: AgentState,
    proc: InstanceProcess,
    name: str,
    served: VersionSpec | None,
    stable: VersionSpec,
    canary: VersionSpec,
) -> None:
    """Candidate load + smoke test of the canary, then the served model reloaded with both versions. On a
    failure the repository holds the stable version alone again (and Triton serves it, when it did before)."""
    server = proc.server
    _smoke_test_candidate(agent, proc, name, canary)
    try:
        _materialize(agent, proc, name, [stable, canary])
        _load(proc, name)
        _wait_model_ready(server, name, stable.number)
        _wait_model_ready(server, name, canary.number)
    except BaseException:
        _materialize(agent, proc, name, [stable])
        if served is not None:
            try:
                _load(proc, name)
            except TritonError as exc:
                log.warning("restoring %s after a failed canary load: %s", name, exc)
        raise


def _undeploy(agent: AgentState, proc: InstanceProcess, placement: PlacementSpec, name: str) -> None:
    # A newer live deployment of the same model uses the same Triton name: leave its model alone.
    reused = placement.keep_model
    server = proc.server
    if not reused:
        if server is not None and server.is_model_ready(name):
            try:
                # Memory leaving the server while a load beside it is metered: that load's footprint is not
                # its own (unloads run beside loads, in a lane of their own).
                with proc.loads.loading():
                    with final_counts_reported(agent, proc, name):
                        server.unload_model(name)
                    wait_model_unloaded(server, name)
            except TritonError as exc:
                log.warning("unloading %s: %s", name, exc)
        remove_model(proc.repository, name)
    agent.reports.placement_unloaded(
        placement.pk, placement.generation, f"{name} unloaded from {placement.instance}"
    )


def _load(proc: InstanceProcess, name: str) -> None:
    """Load (or reload) ``name`` from the instance's repository; counted for the footprint meters."""
    with proc.loads.loading():
        proc.server.load_model(name)


def _meter(agent: AgentState, proc: InstanceProcess, name: str) -> footprint.Meter | None:
    """Readings before ``name`` loads alone on the instance (its first deploy, or a candidate): what the load
    adds is the version's footprint (``hostagent.footprint``)."""
    instance = agent.desired.instance(proc.instance_id)
    process = getattr(proc.server, "process", None)
    return footprint.start(getattr(process, "pid", None), name, instance.device_ids if instance else None)


def _smoke_test_candidate(
    agent: AgentState, proc: InstanceProcess, name: str, version: VersionSpec
) -> int | None:
    """Load the version under the candidate name, smoke-test it, unload it; returns its measured footprint."""
    server = proc.server
    candidate = naming.candidate_name(name)
    try:
        _materialize(agent, proc, candidate, [version])
        meter, mark = _meter(agent, proc, candidate), proc.loads.mark()
        _load(proc, candidate)
        _wait_model_ready(server, candidate, version.number)
        measured = meter.finish(proc.loads.alone_since(mark)) if meter else None
        smoke_test(server, candidate, version)
        return measured
    finally:
        # Also after a failed load: Triton keeps an UNAVAILABLE entry for the candidate until it is unloaded.
        try:
            server.unload_model(candidate)
        except TritonError as exc:
            log.info("unloading candidate %s: %s", candidate, exc)
        finally:
            remove_model(proc.repository, candidate)


def switch_version(
    agent: AgentState,
    proc: InstanceProcess,
    name: str,
    current: VersionSpec | None,
    target: VersionSpec,
    *,
    tested: bool = False,
    timings: dict[str, int] | None = None,
) -> int | None:
    """Candidate load + smoke test, then old+new, then new only. Leaves the old version serving on failure.
    Returns the target's footprint when it was measured (it loaded alone: a first deploy or a candidate).

    A first deploy (nothing served under ``name`` yet) has no traffic to protect: it loads under the served name
    directly and is smoke-tested there, which halves the cost of deploying many models. Its steps' times go
    into ``timings`` (``hostagent.protocol.LOAD_TIMINGS``): a scale-to-zero wake-up is such a load.
    """
    server = proc.server
    measured = None
    timings = {} if timings is None else timings
    if current is None:
        try:
            mark_s = time.monotonic()
            _materialize(agent, proc, name, [target])
            files_s = time.monotonic()
            meter, mark = _meter(agent, proc, name), proc.loads.mark()
            _load(proc, name)
            _wait_model_ready(server, name, target.number)
            loaded_s = time.monotonic()
            measured = meter.finish(proc.loads.alone_since(mark)) if meter else None
            smoke_test(server, name, target)
            timings["files_ms"] = _ms(files_s - mark_s)
            timings["load_ms"] = _ms(loaded_s - files_s)
            timings["smoke_ms"] = _ms(time.monotonic() - loaded_s)
        except BaseException:
            try:
                server.unload_model(name)
            except TritonError as exc:
                log.info("unloading %s after a failed first deploy: %s", name, exc)
            finally:
                remove_model(proc.repository, name)
            raise
        return measured
    if not tested:
        measured = _smoke_test_candidate(agent, proc, name, target)
    if current is not None and current != target:
        try:
            _materialize(agent, proc, name, [current, target])
            _load(proc, name)
            _wait_model_ready(server, name, target.number)
        except BaseException:
            # Put the repository back as it was so a later reload (e.g. after a restart) serves the old version.
            _materialize(agent, proc, name, [current])
            raise
    _materialize(agent, proc, name, [target])
    with final_counts_reported(agent, proc, name, [current.number] if current != target else []):
        _load(proc, name)
    _wait_model_ready(server, name, target.number)
    return measured


@contextlib.contextmanager
def final_counts_reported(
    agent: AgentState, proc: InstanceProcess, name: str, versions: list[int | str] | None = None
):
    """Read what Triton counted for ``versions`` of ``name`` (all loaded ones when None) on entering, and
    report it on leaving: the block is the reload or unload that drops them (a switch's last step, a rollout's
    promote or abort, an undeploy), whose traffic since the last scrape would otherwise never be counted.
    Reading last and reporting after leaves the fewest requests between the reading and the unload (requests
    in flight then finish uncounted); the platform folds a late report exactly once. A failed read or report
    is logged and never stops the unload."""
    counts = None
    if versions != []:
        numbers = None if versions is None else [int(v) for v in versions]
        try:
            counts = read_final_counts(proc.server, name, numbers)
        except (TritonError, OSError, ValueError) as exc:
            log.warning("final counts of %s %s: %s", name, numbers or "(all versions)", exc)
    try:
        yield
    finally:
        if counts is not None:
            try:
                agent.reports.final_counts(proc.instance_id, counts)
            except (OSError, ValueError, PlatformError) as exc:
                log.warning("reporting the final counts of %s: %s", name, exc)


def _forget_failed_loads(agent: AgentState, name: str) -> None:
    for key in [key for key in list(agent.failed_loads) if key[2] == name]:
        agent.failed_loads.pop(key, None)


def _triton_reason(entry: dict | None) -> str:
    if entry is None:
        return "Triton does not have it loaded"
    reason = entry.get("reason") or ""
    return f"Triton reports it {entry.get('state') or 'not loaded'}" + (f": {reason}" if reason else "")


def _verify(
    agent: AgentState, proc: InstanceProcess, placement: PlacementSpec, name: str, entry: dict | None
) -> None:
    """Make the placement's state say what Triton says about its served version, reloading it if it is gone."""
    server, version, instance = proc.server, placement.served_version, placement.instance
    generation, canary = placement.generation, placement.canary_version
    served = [version, canary] if canary is not None else [version]
    if entry is not None and entry.get("state") == "READY":
        if placement.state != PlacementState.READY:
            agent.reports.placement_loaded(
                placement.pk, generation, version, message=f"{instance} serves {version} again", canary=canary
            )
        return
    key = (instance.pk, server.process.pid, name, version.number)
    retry_at, last_failure = agent.failed_loads.get(key, (0.0, ""))
    if time.monotonic() < retry_at:
        agent.reports.placement_lost(placement.pk, generation, last_failure, reloading=False)
        return
    agent.reports.placement_lost(
        placement.pk,
        generation,
        f"{version} was not ready on {instance} ({_triton_reason(entry)}); reloading it",
        reloading=True,
    )
    try:
        _materialize(agent, proc, name, served)
        _load(proc, name)
        for each in served:
            _wait_model_ready(server, name, each.number)
    except (TritonError, RepositoryError, OSError) as exc:
        failure = f"reloading {version} on {instance} failed: {public_error(exc)}"
        agent.failed_loads[key] = (time.monotonic() + LOAD_RETRY_AFTER, failure)
        agent.reports.placement_lost(placement.pk, generation, failure, reloading=False)
        return
    agent.failed_loads.pop(key, None)
    agent.reports.placement_loaded(
        placement.pk,
        generation,
        version,
        kind=LoadedKind.RELOADED,
        message=f"{instance} reloaded {' and '.join(map(str, served))} (it was not loaded)",
        canary=canary,
    )


@dataclass(frozen=True)
class ModelJob:
    """One step of work on one Triton model of an instance (apply a decision, reload what is missing)."""

    key: tuple  # its identity within one pass: a job runs at most once per pass
    model: str  # the Triton model name it loads or unloads
    run: Callable[[], None]
    after: frozenset[str] = frozenset()  # models to load first (an ensemble's steps)
    unload: bool = False  # an unload: it runs in the unloads' own lane, never taking a load's slot


def _version_steps(version: VersionSpec | None) -> frozenset[str]:
    return frozenset(version.steps) if version is not None else frozenset()


def _run_job(job: ModelJob) -> None:
    try:
        job.run()
    except Exception:  # one model's unexpected failure must not stop the others' loads
        log.exception("%s: %s failed", job.model, job.key)


def run_per_model(
    agent: AgentState,
    proc: InstanceProcess,
    jobs: Callable[[], list[ModelJob]],
    *,
    until: float | None = None,
    extend: Callable[[frozenset[str]], float | None] | None = None,
) -> int:
    """Run the jobs ``jobs()`` lists, up to ``--parallel-loads`` loads at once: Triton loads models on its own
    threads (``--model-load-thread-count``, the same figure), and on a CPU host most of a load is a python
    stub starting, which runs beside the others. Unloads have a lane of their own of the same width: most of
    an unload is waiting for Triton to finalize the model (a python stub exits about a second later), and a
    load queued behind it would wait for nothing - while the unload frees the room another load waits for.
    Never two jobs of one model at once (a switch's steps, an undeploy and a deploy of the same Triton name
    stay in order), never an ensemble before the models it chains. ``jobs()`` is asked again whenever one
    finishes, so a decision made meanwhile (a burst of activations) starts as soon as a slot frees instead of
    after the whole batch.

    No job starts after ``until`` (monotonic) or once the server died; the running ones finish. At ``until``
    the pass may go on instead: ``extend(busy)`` (the models whose jobs run) returns the next deadline, or
    None to end - so under a stream of decisions the slots stay full instead of draining at each deadline.
    Returns how many ran.

    Each job reads its placement when it starts and reports its own result with that placement's generation,
    so a decision superseded meanwhile is dropped as in a serial pass. The caller holds ``proc.lock``."""
    limit = max(1, agent.config.parallel_loads)
    running: dict[str, tuple[Future, bool]] = {}  # model -> (its job, an unload)
    seen: set[tuple] = set()
    ran = 0
    with ThreadPoolExecutor(max_workers=2 * limit, thread_name_prefix=f"load-{proc.instance_id}") as pool:
        while True:
            if until is not None and time.monotonic() >= until and extend is not None and proc.running():
                later = extend(frozenset(running))
                if later is None:
                    extend = None  # the pass ends: the deadline stands
                else:
                    until = later
            submitted = False
            in_lane = {False: 0, True: 0}
            for _, unload in running.values():
                in_lane[unload] += 1
            may_start = (until is None or time.monotonic() < until) and proc.running()
            if may_start and min(in_lane.values()) < limit:
                waiting = [job for job in jobs() if job.key not in seen]
                waiting_models = {job.model for job in waiting}
                passed: set[str] = set()  # models a job of which waits: their later jobs wait behind it
                for job in waiting:
                    if (
                        in_lane[job.unload] >= limit
                        or job.model in running
                        or job.model in passed
                        or job.after & (set(running) | (waiting_models - {job.model}))
                    ):
                        passed.add(job.model)
                        continue
                    seen.add(job.key)
                    running[job.model] = (pool.submit(_run_job, job), job.unload)
                    in_lane[job.unload] += 1
                    submitted, ran = True, ran + 1
                if not running and not submitted:
                    break  # nothing left that may start (or only jobs blocked on each other): next pass
            elif not running:
                break
            futures = [future for future, _ in running.values()]
            wait(futures, timeout=0.25, return_when=FIRST_COMPLETED)
            for model in [model for model, (future, _) in running.items() if future.done()]:
                del running[model]
    return ran


def reconcile_instance(
    agent: AgentState,
    instance: InstanceSpec,
    proc: InstanceProcess,
    *,
    hold: Callable[[], bool] | None = None,
) -> None:
    """Make Triton match the placements, and the placements say what Triton serves: apply decisions not yet
    applied (e.g. made while the instance was down), check every served version against Triton's repository
    index (reload what is missing, report what cannot be), unload what no live placement wants. Loads of
    different models run in parallel (``run_per_model``): after a restart of the server every model comes
    back in a fraction of the time one after another would take.

    The decisions are applied for one reconcile interval; while ``hold()`` says the instance may keep the
    agent's attention (nothing else waits for it: see ``HostAgent.reconcile``), the pass goes on for another
    interval with the check run beside the jobs in flight, so a stream of decisions (wake-ups and the
    evictions that make room for them) never waits for the slots to drain at each interval.

    The caller holds ``proc.lock``, so no other pass loads or unloads meanwhile; everything is read after the
    pending decisions were applied. A decision made concurrently (by the platform) is left to its own task."""
    if not proc.running():
        return  # stopped while the caller waited for the lock; the next pass reports it down
    desired = agent.desired
    interval = agent.config.reconcile_interval_ms / 1000

    def pending() -> list[ModelJob]:
        jobs = []
        for placement in desired.placements_on(instance.pk):
            if placement.is_applied():
                continue
            deployment = placement.deployment
            target = deployment.target_version or deployment.active_version
            jobs.append(
                ModelJob(
                    key=("apply", placement.pk, placement.generation),
                    model=deployment.triton_model_name(),
                    run=functools.partial(_apply_locked, agent, proc, placement.pk),
                    after=frozenset() if placement.undeploy else _version_steps(target),
                    unload=placement.undeploy,
                )
            )
        return jobs

    reloads: list[ModelJob] = []

    def go_on(busy: frozenset[str]) -> float | None:
        if hold is None or not hold():
            return None
        reloads.extend(_check(agent, instance, proc, busy) or [])
        return time.monotonic() + interval

    # Bounded: with a long queue of deploys the check must still run about once per interval (beside the
    # jobs while the pass is extended, after them at its end). What is left stays pending (kept loaded,
    # never unloaded) for its own task or the next pass.
    run_per_model(agent, proc, lambda: pending() + reloads, until=time.monotonic() + interval, extend=go_on)
    found = _check(agent, instance, proc, frozenset())
    if found:
        run_per_model(agent, proc, lambda: found)


def _check(
    agent: AgentState, instance: InstanceSpec, proc: InstanceProcess, busy: frozenset[str]
) -> list[ModelJob] | None:
    """Compare Triton's repository index with the applied placements: report what it serves, unload what no
    live placement wants, remove stale model directories; returns the reloads of what is missing (None when
    the index cannot be read). Models in ``busy`` (a job of theirs runs) are left alone."""
    try:
        index = proc.server.repository_index()
    except TritonError as exc:
        log.warning("%s: repository index failed: %s", instance, exc)
        return None
    entries = {(entry.get("name"), str(entry.get("version", ""))): entry for entry in index}
    keep: set[str] = set(busy)
    reloads: list[ModelJob] = []
    live = [p for p in agent.desired.placements_on(instance.pk) if not p.undeploy]
    for placement in live:
        name = placement.deployment.triton_model_name()
        if not placement.is_applied():
            keep.add(name)  # decided meanwhile: its task applies it
            continue
        if placement.served_version is None:
            continue  # nothing to serve (a first deploy that failed)
        keep.add(name)
        if name in busy:
            continue  # a job of its model runs: its state is that job's to report
        entry = entries.get((name, str(placement.served_version.number)))
        if placement.canary_version is not None:
            canary_entry = entries.get((name, str(placement.canary_version.number)))
            if canary_entry is None or canary_entry.get("state") != "READY":
                entry = canary_entry  # the canary is gone: reload both
        if entry is not None and entry.get("state") == "READY":
            _verify(agent, proc, placement, name, entry)  # no load: at once
            continue
        reloads.append(
            ModelJob(
                key=("reload", placement.pk, placement.generation),
                model=name,
                run=functools.partial(_reload_if_current, agent, proc, placement, name, entry),
                after=_version_steps(placement.served_version) | _version_steps(placement.canary_version),
            )
        )
    tuning = getattr(agent, "tuning", None)  # a tuning job's scratch replica is its own to unload
    keep |= tuning.names_on(instance.pk) if tuning is not None else set()
    for name in {entry.get("name") for entry in index if entry.get("state") == "READY"} - keep:
        try:
            proc.server.unload_model(name)
        except TritonError as exc:
            log.warning("%s: unloading %s: %s", instance, name, exc)
    for stale in proc.repository.iterdir() if proc.repository.is_dir() else []:
        if stale.name not in keep and not stale.name.startswith("."):
            shutil.rmtree(stale, ignore_errors=True)
    return reloads


def _reload_if_current(
    agent: AgentState, proc: InstanceProcess, placement: PlacementSpec, name: str, entry: dict | None
) -> None:
    """``_verify`` of what a check found missing, unless a decision about the placement came since (it may
    have unloaded the model on purpose: a reload would bring back what the platform just took away)."""
    now = agent.desired.placement(placement.pk)
    if now is None or now.generation != placement.generation or not now.is_applied() or now.undeploy:
        return
    _verify(agent, proc, placement, name, entry)


def report_instance_down(agent: AgentState, instance: InstanceSpec, state: str, last_error: str) -> None:
    """The instance's server is not running: none of its placements is READY until reconcile reloads them."""
    reason = f"{instance} is {state}" + (f": {last_error}" if last_error else "")
    placements = agent.desired.placements_on(instance.pk)
    for placement in [p for p in placements if p.state == PlacementState.READY and not p.undeploy]:
        agent.reports.placement_lost(placement.pk, placement.generation, reason, reloading=False)
