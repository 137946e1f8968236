"""Which replicas are lost: their instance can no longer serve them (a host unheard of past the grace while
the platform listened, a revoked host, a quarantined instance). Reads only: ``healing`` retires what this finds
and the scheduler places the replacements."""

from __future__ import annotations

from collections import defaultdict

from django.conf import settings
from django.db.models import Min, Q
from django.utils import timezone

from apps.deployments.models import DeploymentInstance, PlacementState
from apps.deployments.scheduler import GONE, grace
from apps.fleet.models import Host, InstanceState


def listening_since(now=None):
    """Since when the platform has been hearing its fleet: the earliest start of a current run of heartbeats
    (``Host.heard_since``) among the hosts heard within the grace; ``now`` when it hears none.

    A host is lost once it has been silent for the grace *while the platform listened*: after the platform
    itself was deaf (web restarted, its database down - every host's heartbeats failed at once), each host gets
    a fresh grace from when the platform hears again, instead of all being taken for lost together (as
    Kubernetes' node lifecycle stops evicting in a full disruption). A host that died meanwhile is lost one
    grace after the platform hears its other hosts again; with no host heard at all nothing is moved."""
    now = now or timezone.now()
    heard = Host.objects.filter(revoked_at__isnull=True, last_heartbeat_at__gte=now - grace())
    if not heard.exists():
        return now
    if heard.filter(heard_since__isnull=True).exists():
        return None  # a run older than anyone counted: the platform has been listening all along
    return heard.aggregate(since=Min("heard_since"))["since"]


def lost_placements(now=None) -> dict[int, list[tuple[int, str]]]:
    """Replicas of scheduled deployments whose instance can no longer serve them, per deployment:
    [(placement id, why)]. A host unheard of past the grace while the platform listened (``listening_since``),
    a revoked host, a quarantined instance."""
    now = now or timezone.now()
    since = listening_since(now)
    # Silent for the grace while the platform listened: not before it has listened for a whole grace.
    deaf = since is not None and since > now - grace()
    silence = Q(instance__host__last_heartbeat_at__lt=now - grace()) | Q(
        instance__host__last_heartbeat_at__isnull=True
    )
    if deaf:
        silence = Q(pk__in=[])
    rows = (
        DeploymentInstance.objects.filter(retiring_reason="", deployment__pinned=False)
        .exclude(state=PlacementState.UNLOADED)
        .exclude(deployment__state__in=GONE)
        .filter(
            Q(instance__host__revoked_at__isnull=False) | silence | Q(instance__state=InstanceState.QUARANTINED)
        )
        .values_list(
            "pk", "deployment_id", "instance__host__name", "instance__host__revoked_at",
            "instance__host__last_heartbeat_at", "instance__state",
        )
    )  # fmt: skip
    found: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for pk, deployment_id, host, revoked, beat, state in rows:
        if revoked is not None:
            why = f"host {host} was revoked"
        elif not deaf and (beat is None or beat < now - grace()):
            why = f"host {host} sent no heartbeat for more than {settings.SCHEDULER_HOST_GRACE_S} s"
        else:
            why = f"its instance is {state}"
        found[deployment_id].append((pk, why))
    return found
