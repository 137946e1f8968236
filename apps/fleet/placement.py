"""What an agent does to put deployments on its instances (runs inside the host agent).

Switching version without failed requests: the new version is first loaded under a candidate name and
smoke-tested with inputs generated from its signature, so a broken version never touches the served model.
Then the served model is reloaded with both versions (the old one keeps answering while the new one loads),
and finally with only the new one (Triton lets in-flight requests on the old one finish). Clients keep calling
the same model name throughout.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from django.conf import settings
from django.db import transaction

from apps.core.errors import public_error
from apps.deployments.models import Deployment, DeploymentInstance, DeploymentState, PlacementState
from apps.fleet.agent import InstanceProcess, current_agent
from apps.fleet.models import TritonInstance
from apps.fleet.repository import RepositoryError, materialize_model, remove_model
from apps.registry.models import ModelVersion
from backend_ge import samples
from backend_ge.config import ModelSignature
from backend_ge.runtime import TritonError, TritonServer

log = logging.getLogger(__name__)

CANDIDATE_SUFFIX = "__candidate"
# A model that failed to load is retried by reconcile after this long, not every few seconds - unless the
# server restarted meanwhile (the key holds its pid): a fresh server gets one attempt at every model.
LOAD_RETRY_AFTER = 60.0
_failed_loads: dict[tuple[int, int, str, int], float] = {}


class SmokeTestError(RuntimeError):
    """The candidate version loaded but could not answer an inference request."""


def servable_dir(version: ModelVersion) -> Path:
    """The version's converted model directory on this machine: the platform's artifact store when it is
    mounted here, else a verified download into the agent's cache."""
    local = version.servable_dir()
    if (local / "config.pbtxt").is_file():
        return local
    from apps.fleet.artifacts import download_servable

    return download_servable(version, Path(settings.FLEET_ROOT) / "cache")


def _materialize(proc: InstanceProcess, name: str, versions: list[ModelVersion]) -> None:
    newest = max(versions, key=lambda v: v.number)
    materialize_model(
        proc.repository, name, {v.number: servable_dir(v) for v in versions}, newest.config_text
    )


def smoke_test(server: TritonServer, name: str, version: ModelVersion) -> float:
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
        result = client.infer(name, inputs, model_version=str(version.number))
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


def _event(placement: DeploymentInstance, kind: str, message: str, version=None, **details) -> None:
    placement.deployment.events.create(
        kind=kind, message=message, instance=placement.instance, version=version, details=details
    )


def _finish(placement: DeploymentInstance, **fields) -> None:
    from apps.deployments.services import placement_finished

    DeploymentInstance.objects.filter(pk=placement.pk).update(**fields)
    placement.refresh_from_db()
    placement_finished(placement)


def _undeploy(proc: InstanceProcess, placement: DeploymentInstance, name: str) -> None:
    server = proc.server
    if server is not None and server.is_model_ready(name):
        try:
            server.unload_model(name)
        except TritonError as exc:
            log.warning("unloading %s: %s", name, exc)
    remove_model(proc.repository, name)
    _event(placement, "unloaded", f"{name} unloaded from {placement.instance}")
    _finish(placement, state=PlacementState.UNLOADED, served_version=None, last_error="")


def apply_placement(placement_id: int) -> None:
    """Make this placement's instance serve the deployment's target version, or undeploy it."""
    placement = (
        DeploymentInstance.objects.select_related("deployment__model__team", "instance", "served_version")
        .filter(pk=placement_id)
        .first()
    )
    if placement is None:
        return  # deleted meanwhile: nothing to do
    agent = current_agent()
    proc = agent.processes.get(placement.instance_id)
    if proc is None or not proc.running():
        # The instance is down; reconcile applies the placement as soon as it runs again.
        DeploymentInstance.objects.filter(pk=placement.pk).update(
            last_error=f"{placement.instance} is not running; the placement is applied when it is READY"
        )
        return
    deployment: Deployment = placement.deployment
    name = deployment.triton_model_name()
    with proc.lock:
        if deployment.state in (DeploymentState.UNDEPLOYING, DeploymentState.UNDEPLOYED):
            _undeploy(proc, placement, name)
            return
        target = deployment.target_version or deployment.active_version
        if target is None:
            return
        current = placement.served_version
        server = proc.server
        if current == target and server.is_model_ready(name, str(target.number)):
            _finish(placement, state=PlacementState.READY, last_error="")
            return
        DeploymentInstance.objects.filter(pk=placement.pk).update(state=PlacementState.LOADING)
        try:
            switch_version(
                proc,
                name,
                current if current and server.is_model_ready(name, str(current.number)) else None,
                target,
            )
        except (TritonError, RepositoryError, SmokeTestError, OSError) as exc:
            message = public_error(exc)
            _event(
                placement,
                "load_failed",
                f"{target} failed on {placement.instance}: {message}",
                version=target,
            )
            _finish(placement, state=PlacementState.FAILED, last_error=message)
            return
        _event(placement, "serving", f"{placement.instance} serves {target}", version=target)
        _finish(placement, state=PlacementState.READY, served_version=target, last_error="")


def switch_version(
    proc: InstanceProcess, name: str, current: ModelVersion | None, target: ModelVersion
) -> None:
    """Candidate load + smoke test, then old+new, then new only. Leaves the old version serving on failure.

    A first deploy (nothing served under ``name`` yet) has no traffic to protect: it loads under the served name
    directly and is smoke-tested there, which halves the cost of deploying many models.
    """
    server = proc.server
    if current is None:
        try:
            _materialize(proc, name, [target])
            server.load_model(name)
            _wait_model_ready(server, name, target.number)
            smoke_test(server, name, target)
        except BaseException:
            try:
                server.unload_model(name)
            except TritonError as exc:
                log.info("unloading %s after a failed first deploy: %s", name, exc)
            finally:
                remove_model(proc.repository, name)
            raise
        return
    candidate = name + CANDIDATE_SUFFIX
    try:
        _materialize(proc, candidate, [target])
        server.load_model(candidate)
        _wait_model_ready(server, candidate, target.number)
        smoke_test(server, candidate, target)
    finally:
        # Also after a failed load: Triton keeps an UNAVAILABLE entry for the candidate until it is unloaded.
        try:
            server.unload_model(candidate)
        except TritonError as exc:
            log.info("unloading candidate %s: %s", candidate, exc)
        finally:
            remove_model(proc.repository, candidate)
    if current is not None and current != target:
        try:
            _materialize(proc, name, [current, target])
            server.load_model(name)
            _wait_model_ready(server, name, target.number)
        except BaseException:
            # Put the repository back as it was so a later reload (e.g. after a restart) serves the old version.
            _materialize(proc, name, [current])
            raise
    _materialize(proc, name, [target])
    server.load_model(name)
    _wait_model_ready(server, name, target.number)


def reconcile_instance(instance: TritonInstance, proc: InstanceProcess) -> None:
    """Make the loaded models match the placements: load what is missing (e.g. after a restart), unload
    what is no longer deployed. The caller holds ``proc.lock``."""
    server = proc.server
    desired: dict[str, DeploymentInstance] = {}
    placements = DeploymentInstance.objects.filter(
        instance=instance, served_version__isnull=False
    ).select_related("deployment__model__team", "served_version")
    for placement in placements:
        if placement.deployment.state not in (DeploymentState.UNDEPLOYING, DeploymentState.UNDEPLOYED):
            desired[placement.deployment.triton_model_name()] = placement
    # Placements whose task never ran here (the instance was down) are applied now.
    for placement in DeploymentInstance.objects.filter(
        instance=instance, state=PlacementState.PENDING
    ).exclude(deployment__state__in=(DeploymentState.UNDEPLOYED,)):
        apply_placement(placement.pk)
    try:
        index = server.repository_index()
    except TritonError as exc:
        log.warning("%s: repository index failed: %s", instance, exc)
        return
    loaded = {entry["name"] for entry in index if entry.get("state") == "READY"}
    for name, placement in desired.items():
        version = placement.served_version
        if server.is_model_ready(name, str(version.number)):
            continue
        key = (instance.pk, server.process.pid, name, version.number)
        if time.monotonic() < _failed_loads.get(key, 0):
            continue
        try:
            _materialize(proc, name, [version])
            server.load_model(name)
        except (TritonError, RepositoryError, OSError) as exc:
            _failed_loads[key] = time.monotonic() + LOAD_RETRY_AFTER
            message = public_error(exc)
            with transaction.atomic():
                DeploymentInstance.objects.filter(pk=placement.pk).update(
                    state=PlacementState.FAILED, last_error=message
                )
                _event(
                    placement,
                    "reload_failed",
                    f"reloading {version} on {instance} failed: {message}",
                    version=version,
                )
            continue
        _failed_loads.pop(key, None)
        DeploymentInstance.objects.filter(pk=placement.pk).update(state=PlacementState.READY, last_error="")
        _event(placement, "reloaded", f"{instance} reloaded {version} (it was not loaded)", version=version)
    for name in loaded - set(desired):
        try:
            server.unload_model(name)
        except TritonError as exc:
            log.warning("%s: unloading %s: %s", instance, name, exc)
    for stale in proc.repository.iterdir() if proc.repository.is_dir() else []:
        if stale.name not in desired and not stale.name.startswith("."):
            shutil.rmtree(stale, ignore_errors=True)
