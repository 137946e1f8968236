"""What the host agent tells the platform about placements, over the agent API (``placements/<id>/report``).

The method names are those of the platform's ``apps.deployments.reports.placement_*`` functions that receive
them, so ``hostagent.placement`` reads as the state machine does. Each call carries the generation the agent
applied; the answer says whether it was accepted (a report for an older generation is dropped there) and the
placement as it is now, which replaces this agent's copy. A report that cannot be delivered is logged and
returns False: the next reconcile pass reports again from what Triton says.
"""

from __future__ import annotations

import logging

from hostagent.client import DesiredState, PlatformClient, PlatformError, VersionSpec
from hostagent.protocol import LoadedKind, PlacementReport, PlacementResult, ProtocolError

log = logging.getLogger(__name__)


def _pk(version: VersionSpec | None) -> int | None:
    return version.pk if version is not None else None


class Reports:
    """The placement and final-count reports of one agent (its client, and its desired state to patch)."""

    def __init__(self, client: PlatformClient, desired: DesiredState) -> None:
        self.client = client
        self.desired = desired

    def _send(self, placement_id: int, report: PlacementReport) -> bool:
        try:
            accepted, entry = self.client.report_placement(placement_id, report)
        except (PlatformError, ProtocolError) as exc:
            log.warning("placement %s: report %s not delivered: %s", placement_id, report.result, exc)
            return False
        self.desired.update_placement(entry, placement_id)
        return accepted

    def placement_started(self, placement_id: int, generation: int) -> bool:
        return self._send(placement_id, PlacementReport(generation, PlacementResult.STARTED))

    def placement_waiting(self, placement_id: int, generation: int, message: str) -> bool:
        return self._send(placement_id, PlacementReport(generation, PlacementResult.WAITING, message=message))

    def placement_loaded(
        self,
        placement_id: int,
        generation: int,
        version: VersionSpec,
        *,
        kind: LoadedKind | None = LoadedKind.SERVING,
        message: str = "",
        canary: VersionSpec | None = None,
        footprint_mb: int | None = None,
        timings: dict[str, int] | None = None,
    ) -> bool:
        report = PlacementReport(
            generation,
            PlacementResult.LOADED,
            version=version.pk,
            canary=_pk(canary),
            kind=kind,
            message=message,
            footprint_mb=footprint_mb,
            timings=timings,
        )
        return self._send(placement_id, report)

    def placement_failed(
        self,
        placement_id: int,
        generation: int,
        error: str,
        *,
        version: VersionSpec,
        still_serving: VersionSpec | None,
        message: str = "",
    ) -> bool:
        report = PlacementReport(
            generation,
            PlacementResult.FAILED,
            version=version.pk,
            still_serving=_pk(still_serving),
            error=error,
            message=message,
        )
        return self._send(placement_id, report)

    def placement_unloaded(self, placement_id: int, generation: int, message: str) -> bool:
        return self._send(
            placement_id, PlacementReport(generation, PlacementResult.UNLOADED, message=message)
        )

    def placement_lost(self, placement_id: int, generation: int, reason: str, *, reloading: bool) -> bool:
        report = PlacementReport(generation, PlacementResult.LOST, error=reason, reloading=reloading)
        return self._send(placement_id, report)

    def placement_canary_loaded(
        self,
        placement_id: int,
        generation: int,
        stable: VersionSpec,
        canary: VersionSpec,
        *,
        message: str = "",
    ) -> bool:
        report = PlacementReport(
            generation, PlacementResult.CANARY_LOADED, version=stable.pk, canary=canary.pk, message=message
        )
        return self._send(placement_id, report)

    def placement_canary_failed(
        self,
        placement_id: int,
        generation: int,
        error: str,
        *,
        canary: VersionSpec,
        still_serving: VersionSpec | None,
    ) -> bool:
        report = PlacementReport(
            generation,
            PlacementResult.CANARY_FAILED,
            canary=canary.pk,
            still_serving=_pk(still_serving),
            error=error,
        )
        return self._send(placement_id, report)

    def final_counts(self, instance_id: int, counts: dict) -> None:
        """A version's last counters, read just before it is unloaded (``apps.monitoring.final_counts``)."""
        self.client.report_final_counts(instance_id, counts)
