"""Drain, then unload: a replica the gateway routes to is unloaded only once the gateway sends it nothing more.

A replica told to unload (scaled down, put to sleep, evicted under memory pressure, replaced, or its
deployment undeployed) leaves the gateway's rotation in the same commit (``apps.gateway.state``), but the
gateway applies that at its next sync while the agent hears of the decision at its next poll - which could
come first: a request then met an instance whose model was being unloaded (Triton's "version 1 is not at
ready state"). So:

* the gateway marks a replica ``routed`` before it first puts it in rotation (``placements_routed``: only
  while it is not told to unload, one conditional UPDATE, so a concurrent unload decision and the mark never
  both win);
* an unload decision (``tell_to_unload``) hands a routed replica to its agent later: it sets
  ``draining_since`` and leaves the replica's generation alone, so the agent keeps serving it;
* the gateway, once its servers for the replica are out of rotation with no request in flight, confirms it
  (``placements_drained``): the replica's generation moves on and its agent unloads it. A replica no gateway
  confirms (no gateway running, or it stopped) is handed over after ``GATEWAY_DRAIN_TIMEOUT_S`` by the
  scheduler's beat (``release_undrained``).

A replica no gateway ever routed (no gateway, or not READY yet) is unloaded at once, as before.

An undeployed deployment's routes and servers leave the gateway at once (its requests get the gateway's 404);
the gateway confirms its routed replicas once the servers it removed hold no request any more (HAProxy keeps a
deleted server with connections until they finished: ``apps.gateway.services.Gateway``).

Its memory counts until its agent reports it unloaded, as every unloading replica's does (the scheduler never
overcommits an instance). Writes placements and their events - an owner beside ``services`` and ``scheduler``
(``tests/deployments/test_one_writer.py``).
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from apps.deployments.models import DeploymentEvent, DeploymentInstance, PlacementState
from apps.fleet.services import notify_hosts


def tell_to_unload(pks: list[int], **fields) -> None:
    """The placements are to unload (``fields``: more columns to set, e.g. the retiring reason). The caller
    holds their deployment's row lock and hands the placements to ``scheduler.enqueue`` after commit.

    A routed one drains first; any other is handed to its agent now - one already unloaded too, whatever its
    mark says (no gateway routes to what its agent no longer serves, and nothing would confirm it)."""
    rows = DeploymentInstance.objects.filter(pk__in=pks)
    drains = Q(routed=True) & ~Q(state=PlacementState.UNLOADED)
    rows.exclude(drains).update(
        generation=F("generation") + 1, unload=True, routed=False, draining_since=None, **fields
    )
    rows.filter(drains).update(
        unload=True, draining_since=Coalesce(F("draining_since"), Value(timezone.now())), **fields
    )


def placements_routed(pks: set[int]) -> set[int]:
    """The gateway is about to put these placements in rotation: mark those not told to unload meanwhile.
    Returns the marked ones (the gateway leaves the others out of rotation)."""
    if not pks:
        return set()
    with transaction.atomic():
        # Only the placements' rows are locked (``of``; no ordering joins): a deployment's or an instance's row
        # locked here would wait behind - and deadlock with - a scheduling decision holding its pool.
        rows = (
            DeploymentInstance.objects.select_for_update(of=("self",))
            .filter(pk__in=pks, unload=False)
            .order_by("pk")
        )
        marked = set(rows.values_list("pk", flat=True))
        DeploymentInstance.objects.filter(pk__in=marked).update(routed=True)
    return marked


def placements_drained(pks: set[int], why: str) -> int:
    """The gateway sends these placements nothing more (``why`` says how that is known): their agents unload
    them now. Only placements still told to unload (one woken again meanwhile stays in service)."""
    if not pks:
        return 0
    with transaction.atomic():
        rows = list(
            DeploymentInstance.objects.select_for_update(of=("self",))
            .filter(pk__in=pks, unload=True, routed=True)
            .order_by("pk")
            .exclude(state=PlacementState.UNLOADED)
            .select_related("instance__host")
        )
        if not rows:
            return 0
        DeploymentInstance.objects.filter(pk__in=[p.pk for p in rows]).update(
            routed=False, draining_since=None, generation=F("generation") + 1
        )
        DeploymentEvent.objects.bulk_create(
            DeploymentEvent(
                deployment_id=p.deployment_id,
                kind="drained",
                message=f"the replica on {p.instance} is out of the gateway's rotation ({why}): unloading it",
                instance_id=p.instance_id,
                details={"why": why},
            )
            for p in rows
        )
        hosts = {p.instance.host_id for p in rows}
        transaction.on_commit(lambda: notify_hosts(hosts))
    return len(rows)


def release_undrained(now=None) -> int:
    """Placements no gateway confirmed drained within ``GATEWAY_DRAIN_TIMEOUT_S`` (no gateway runs, or it
    stopped): their agents unload them now (the beat's tick)."""
    now = now or timezone.now()
    late = DeploymentInstance.objects.filter(
        unload=True,
        routed=True,
        draining_since__lt=now - timedelta(seconds=settings.GATEWAY_DRAIN_TIMEOUT_S),
    ).exclude(state=PlacementState.UNLOADED)
    pks = set(late.values_list("pk", flat=True))
    why = f"no gateway confirmed it within {settings.GATEWAY_DRAIN_TIMEOUT_S} s"
    return placements_drained(pks, why) if pks else 0
