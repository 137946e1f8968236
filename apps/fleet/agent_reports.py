"""What the host agent tells the platform about placements, over the agent API (``placements/<id>/report``).

The same names as the platform's ``apps.deployments.services.placement_*`` functions that receive them, so
``apps.fleet.placement`` reads as before. Each call carries the generation the agent applied; the answer
says whether it was accepted (a report for an older generation is dropped there) and the placement as it is
now, which replaces this agent's copy. A report that cannot be delivered is logged and returns False: the
next reconcile pass reports again from what Triton says.
"""

from __future__ import annotations

import logging

from apps.fleet.agent import current_agent
from apps.fleet.agent_client import PlatformError, VersionSpec

log = logging.getLogger(__name__)


def _send(placement_id: int, generation: int, result: str, **fields) -> bool:
    agent = current_agent()
    body = {"generation": generation, "result": result}
    for key, value in fields.items():
        body[key] = value.pk if isinstance(value, VersionSpec) else value
    try:
        answer = agent.client.report_placement(placement_id, body)
    except PlatformError as exc:
        log.warning("placement %s: report %s not delivered: %s", placement_id, result, exc)
        return False
    agent.desired.update_placement(answer.get("placement"), placement_id)
    return bool(answer.get("accepted"))


def placement_started(placement_id: int, generation: int) -> bool:
    return _send(placement_id, generation, "started")


def placement_waiting(placement_id: int, generation: int, message: str) -> bool:
    return _send(placement_id, generation, "waiting", message=message)


def placement_loaded(
    placement_id: int,
    generation: int,
    version: VersionSpec,
    *,
    kind: str | None = "serving",
    message: str = "",
    canary: VersionSpec | None = None,
) -> bool:
    return _send(
        placement_id, generation, "loaded", version=version, kind=kind, message=message, canary=canary
    )


def placement_failed(
    placement_id: int,
    generation: int,
    error: str,
    *,
    version: VersionSpec,
    still_serving: VersionSpec | None,
    message: str = "",
) -> bool:
    return _send(
        placement_id,
        generation,
        "failed",
        error=error,
        version=version,
        still_serving=still_serving,
        message=message,
    )


def placement_unloaded(placement_id: int, generation: int, message: str) -> bool:
    return _send(placement_id, generation, "unloaded", message=message)


def placement_lost(placement_id: int, generation: int, reason: str, *, reloading: bool) -> bool:
    return _send(placement_id, generation, "lost", error=reason, reloading=reloading)


def placement_canary_loaded(
    placement_id: int, generation: int, stable: VersionSpec, canary: VersionSpec, *, message: str = ""
) -> bool:
    return _send(placement_id, generation, "canary_loaded", version=stable, canary=canary, message=message)


def placement_canary_failed(
    placement_id: int, generation: int, error: str, *, canary: VersionSpec, still_serving: VersionSpec | None
) -> bool:
    return _send(
        placement_id, generation, "canary_failed", error=error, canary=canary, still_serving=still_serving
    )


def final_counts(instance_id: int, counts: dict) -> None:
    """A version's last counters, read just before it is unloaded (``apps.monitoring.final_counts``)."""
    current_agent().client.report_final_counts(instance_id, counts)
