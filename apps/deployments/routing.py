"""The gateway's half of SERVING: what each running gateway routes, as it reports after applying a sync.

A deployment's placements turn READY when its agents report Triton serves the version; a client calls it
through the gateway, which routes it only after its next sync (a poke, then ~10-150 ms). A deployment is
therefore reported SERVING (``Deployment.reported_state``) only once every gateway that reported within
``GATEWAY_ROUTES_STALE_S`` routes its active version to a server in rotation - then a call succeeds the first
time. The gateway writes its row here (this app owns deployments' state, the gateway only reports), at
least every third of ``GATEWAY_ROUTES_STALE_S`` as a heartbeat, and removes it when it stops.
"""

from __future__ import annotations

from django.utils import timezone

from apps.deployments.models import GatewayRouting


def record_gateway_routes(name: str, routes: dict[int, tuple[int, int]]) -> None:
    """``routes``: deployment id -> (version its unversioned requests reach, 0 during a switch; servers in
    rotation)."""
    GatewayRouting.objects.update_or_create(
        name=name,
        defaults={
            "routes": {str(pk): [version, servers] for pk, (version, servers) in routes.items()},
            "seen_at": timezone.now(),
        },
    )


def forget_gateway(name: str) -> None:
    """A gateway that stops is not waited for any more."""
    GatewayRouting.objects.filter(name=name).delete()
