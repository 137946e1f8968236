"""Replicas follow the traffic: the autoscaler's settings, its evaluation, sleep and wake.

``evaluate`` is handed what the gateway sees per deployment (requests in flight and the cumulative count;
``apps.gateway.autoscaling`` reads them from HAProxy every ``AUTOSCALE_TICK_S``) and applies
``apps.deployments.scaling_policy.decide`` to each autoscaled deployment under its row lock: more replicas
are placed by the scheduler where they fit (a deployment that cannot grow says why: the quota, or the
scheduler's pending reason); fewer are unloaded (``scheduler.remove_replicas``); zero puts it to sleep.
``wake`` is called by the gateway when a request for a sleeping deployment is held there.

Under memory pressure (``make_room``, which the scheduler asks when a pool has no room for a replica): the
least recently used replica of a scale-to-zero deployment on the pool that has served nothing for its idle
period (or for ``SCHEDULER_EVICTION_MIN_IDLE_S``, if an operator set it shorter) is evicted - its deployment goes to sleep
now instead of at the next evaluation, and wakes like any sleeping one. A replica that served more recently,
one not READY, one woken for a request the gateway still holds, and a deployment with ``min_replicas`` above
zero are never evicted. The room counts once the evicted
replicas are reported unloaded (memory is never overcommitted; the evicted placement records whom it was
evicted for, so another waiting replica evicts for itself); that report places the waiting replica at once.
With ``SCHEDULER_EVICTION_HEADROOM_MB`` set, ``keep_headroom`` evicts by the same rules ahead of the
wake-ups, at every tick, so that each instance keeps that much free.

Writes: the deployment's replica count, its autoscaling settings and memory, asleep_since and the cold
start, one event per decision with its figures, and a replica sample (desired, ready) when they changed - an
owner beside ``services`` and ``scheduler`` (``tests/deployments/test_one_writer.py``). Placements are the
scheduler's.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction

from apps.audit.services import record
from apps.deployments import cold_start, room, scheduler
from apps.deployments.models import (
    ACTIVE_STATES,
    Deployment,
    DeploymentInstance,
    DeploymentState,
    PlacementState,
    ReplicaSample,
    Rollout,
)
from apps.deployments.room import Ledger, footprints
from apps.deployments.scaling_policy import Memory, Observation, Policy, decide
from apps.fleet.models import Pool

FIELDS = ("min_replicas", "max_replicas", "target_in_flight", "scale_down_window_s", "idle_period_s")
BOUNDS = {
    "target_in_flight": (0.1, 10_000.0),
    "scale_down_window_s": (0, 86_400),
    "idle_period_s": (1, 7 * 86_400),
}
DECIDED_IN = (DeploymentState.SERVING, DeploymentState.DEPLOYING, DeploymentState.PENDING)


def policy_of(deployment: Deployment) -> Policy:
    return Policy(
        min_replicas=deployment.min_replicas or 0,
        max_replicas=max(1, deployment.max_replicas or 1),
        target=deployment.target_in_flight,
        down_window_s=deployment.scale_down_window_s,
        idle_period_s=deployment.idle_period_s,
    )


def quota_room(deployment: Deployment) -> int:
    """Instances the team's quota leaves for this deployment's replicas: the quota less the instances its
    pinned deployments use and the replicas (or, autoscaled, the maximum) its other scheduled ones ask for."""
    team = deployment.team
    others = Deployment.objects.filter(team=team, state__in=ACTIVE_STATES).exclude(pk=deployment.pk)
    pinned = (
        DeploymentInstance.objects.filter(deployment__in=others.filter(pinned=True))
        .values_list("instance_id", flat=True)
        .distinct()
        .count()
    )
    scheduled = sum(
        max(replicas, high or 0) if low is not None else replicas
        for replicas, low, high in others.filter(pinned=False).values_list(
            "replicas", "min_replicas", "max_replicas"
        )
    )
    return team.quota_instances - pinned - scheduled


def check_settings(deployment: Deployment, values: dict) -> dict:
    """The settings a request gives, merged over the deployment's; a 400 naming the field otherwise.
    ``min_replicas: null`` turns autoscaling off."""
    merged = {name: values.get(name, getattr(deployment, name)) for name in FIELDS}
    if deployment.pinned:
        raise ValidationError({"min_replicas": ["A pinned deployment (instances picked by hand) is not autoscaled; deploy it with replicas."]})  # fmt: skip
    if merged["min_replicas"] is None:
        return merged
    limit = settings.SCHEDULER_MAX_REPLICAS
    low, high = merged["min_replicas"], merged["max_replicas"]
    if not isinstance(low, int) or isinstance(low, bool) or not 0 <= low <= limit:
        raise ValidationError(
            {"min_replicas": [f"Give 0 to {limit} (got {low!r}); 0 scales to zero when idle."]}
        )
    if high is None:
        high = merged["max_replicas"] = max(low, deployment.replicas, 1)
    if not isinstance(high, int) or isinstance(high, bool) or not 1 <= high <= limit:
        raise ValidationError({"max_replicas": [f"Give 1 to {limit} (got {high!r})."]})
    if high < low:
        raise ValidationError({"max_replicas": [f"max_replicas ({high}) is below min_replicas ({low})."]})
    room = quota_room(deployment)
    if high > room:
        raise ValidationError({"max_replicas": [f"Team quota: {deployment.team.name} may use {deployment.team.quota_instances} instances; {max(room, 0)} are left for this deployment."]})  # fmt: skip
    for name, (least, most) in BOUNDS.items():
        value = merged[name]
        if isinstance(value, bool) or not isinstance(value, int | float) or not least <= value <= most:
            raise ValidationError({name: [f"Give {least:g} to {most:g} (got {value!r})."]})
    return merged


def configure(*, actor, deployment: Deployment, values: dict) -> Deployment:
    """Set (or turn off) autoscaling. The next evaluation applies the bounds."""
    with transaction.atomic():
        deployment = (
            Deployment.objects.select_for_update(of=("self",)).select_related("team").get(pk=deployment.pk)
        )
        if deployment.state not in ACTIVE_STATES:
            raise ValidationError({"non_field_errors": [f"The deployment is {deployment.state}."]})
        merged = check_settings(deployment, values)
        for name, value in merged.items():
            setattr(deployment, name, value)
        fields = [*FIELDS, "updated_at"]
        if merged["min_replicas"] is None and deployment.replicas == 0:
            # Autoscaling off while asleep: it serves again with one replica.
            deployment.replicas, deployment.asleep_since = 1, None
            fields += ["replicas", "asleep_since"]
        deployment.save(update_fields=fields)
        summary = (
            "autoscaling off"
            if merged["min_replicas"] is None
            else "autoscaling {min_replicas}..{max_replicas} replicas, target {target_in_flight:g} in flight per "
            "replica, down after {scale_down_window_s} s, idle period {idle_period_s} s".format(**merged)
        )
        deployment.events.create(kind="autoscaling", message=summary, details=merged)
        record(
            actor=actor,
            team=deployment.team,
            action="deployment.autoscaling",
            target=deployment,
            details=merged,
        )
        placed = scheduler.place_replicas(deployment)
        transaction.on_commit(lambda: scheduler.enqueue(placed))
    return deployment


def sleep(*, actor, deployment: Deployment, now: float | None = None) -> Deployment:
    """Put a scale-to-zero deployment to sleep now (its replicas unload; the next request wakes it) - e.g.
    right after deploying many models that are called rarely, so none holds memory before its first call."""
    now = time.time() if now is None else now
    with transaction.atomic():
        deployment = (
            Deployment.objects.select_for_update(of=("self",)).select_related("team").get(pk=deployment.pk)
        )
        if not deployment.autoscaled() or deployment.min_replicas != 0:
            raise ValidationError({"min_replicas": ["Only a deployment with min_replicas 0 can sleep."]})
        if deployment.state not in DECIDED_IN:
            raise ValidationError({"non_field_errors": [f"The deployment is {deployment.state}."]})
        if deployment.replicas == 0:
            return deployment
        current = deployment.replicas
        memory = Memory.load(deployment.scaling_memory)
        memory.recommendations, memory.last_traffic_at = [], now
        deployment.scaling_memory = {**deployment.scaling_memory, **memory.dump()}
        deployment.replicas, deployment.asleep_since = 0, datetime.fromtimestamp(now, UTC)
        deployment.save(update_fields=["replicas", "asleep_since", "scaling_memory", "updated_at"])
        deployment.events.create(kind="autoscaled", message=f"{current} -> 0 replicas: put to sleep",
                                 details={"from": current, "to": 0})  # fmt: skip
        record(actor=actor, team=deployment.team, action="deployment.sleep", target=deployment, details={})
        removed = scheduler.remove_replicas(deployment, 0, "asleep (put to sleep)")
        scheduler.place_replicas(deployment)  # nothing is missing now: clears a pending reason
        transaction.on_commit(lambda: scheduler.enqueue(removed))
    return deployment


def _autoscaled() -> list[tuple[int, bool]]:
    """(id, settled asleep) of every autoscaled deployment. Settled asleep: no replica wanted and none
    serving as of its last sample - an evaluation without a request in flight has nothing to decide or chart
    for it (most of a dense pool's deployments sleep at any moment)."""
    rollouts = Rollout.objects.live().values_list("deployment_id", flat=True)
    rows = (
        Deployment.objects.filter(min_replicas__isnull=False, pinned=False, state__in=DECIDED_IN)
        .exclude(pk__in=rollouts)
        .order_by("pk")
        .values_list("pk", "replicas", "scaling_memory__sampled")
    )
    return [(pk, replicas == 0 and sampled == [0, 0]) for pk, replicas, sampled in rows]


def evaluate(load: dict[int, tuple], now: float | None = None) -> dict[str, int]:
    """One evaluation: ``load`` is deployment id -> (in flight, cumulative requests[, average seconds per
    request]) as the gateway sees it. A deployment the gateway did not report on is left alone (no decision
    on missing figures)."""
    now = time.time() if now is None else now
    counts = {"up": 0, "down": 0, "asleep": 0, "unchanged": 0}
    for deployment_id, settled_asleep in _autoscaled():
        if deployment_id not in load:
            continue
        in_flight, total, *rest = load[deployment_id]
        avg_time_s = rest[0] if rest else None
        if settled_asleep and in_flight <= 0:
            counts["unchanged"] += 1  # a request for it is held at the gateway, which wakes it (``wake``)
            continue
        with transaction.atomic():
            deployment = (
                Deployment.objects.select_for_update(of=("self",))
                .select_related("team")
                .filter(pk=deployment_id)
                .first()
            )
            if deployment is None or not deployment.autoscaled() or deployment.state not in DECIDED_IN:
                continue
            outcome = _apply(deployment, Observation(now, in_flight, total, avg_time_s))
        counts[outcome] += 1
    return counts


def _apply(deployment: Deployment, observation: Observation) -> str:
    memory = Memory.load(deployment.scaling_memory)
    decision = decide(policy_of(deployment), deployment.replicas, observation, memory)
    current, wanted = deployment.replicas, decision.replicas
    figures = {
        "in_flight": round(decision.in_flight, 2),
        "snapshot": observation.in_flight,
        "per_replica": round(decision.per_replica, 2),
        "target": deployment.target_in_flight,
        "recommended": decision.recommended,
    }
    if wanted == 0 < current and (
        _holds_a_request(deployment.scaling_memory, observation.at)
        or not scheduler.counted(deployment).filter(state=PlacementState.READY).exists()
    ):
        # Woken and still loading, or serving but the request that woke it not released yet (the gateway
        # routes it at its next sync): that request is held at the gateway, where the backend's figures do
        # not see it. Its idle period counts from when it went on - under a stream a wake-up can wait for
        # room and load for longer than the idle period, and sleeping at once made it load twice.
        decision.memory.last_traffic_at, wanted = observation.at, current
    saved = decision.memory.dump()
    saved["figures"] = {**figures, "at": observation.at, "replicas": current}
    saved["sampled"] = deployment.scaling_memory.get("sampled")
    if "cold" in deployment.scaling_memory:  # a cold start still being timed (``wake``)
        saved["cold"] = deployment.scaling_memory["cold"]
    deployment.scaling_memory = saved
    fields = ["scaling_memory"]
    outcome = "unchanged"
    if wanted > current:
        room = quota_room(deployment)
        if wanted > room:
            reason = f"cannot grow to {wanted} replicas: team quota leaves {max(room, 0)} instances"
            if saved.get("capped") != reason:
                deployment.events.create(kind="autoscale_capped", message=reason, details=figures)
            saved["capped"] = reason
            wanted = max(current, room)
    if wanted != current:
        deployment.replicas = wanted
        fields += ["replicas", "updated_at"]
        message = (
            decision.message if wanted == decision.replicas else f"{current} -> {wanted} replicas (quota)"
        )
        if wanted == 0:
            deployment.asleep_since = datetime.fromtimestamp(observation.at, UTC)
            fields.append("asleep_since")
        _sample(deployment, observation.at)
        deployment.save(update_fields=fields)
        deployment.events.create(
            kind="autoscaled", message=message, details={**figures, "from": current, "to": wanted}
        )
        if wanted > current:
            decided = scheduler.place_replicas(deployment, make_room=make_room)
            outcome = "up"
        else:
            reason = "asleep (scaled to zero)" if wanted == 0 else "scaled down"
            decided = scheduler.remove_replicas(deployment, wanted, reason)
            outcome = "asleep" if wanted == 0 else "down"
        transaction.on_commit(lambda: scheduler.enqueue(decided))
        return outcome
    _sample(deployment, observation.at)
    deployment.save(update_fields=fields)
    return outcome


def _sample(deployment: Deployment, at: float) -> None:
    """A replica sample when desired or ready changed since the last one (the chart's steps). What was
    sampled last is kept in the scaling memory, which the caller saves: no extra read per tick."""
    ready = scheduler.counted(deployment).filter(state=PlacementState.READY).count()
    now = [deployment.replicas, ready]
    if deployment.scaling_memory.get("sampled") == now:
        return
    ReplicaSample.objects.create(
        deployment=deployment, at=datetime.fromtimestamp(at, UTC), desired=now[0], ready=now[1]
    )
    deployment.scaling_memory["sampled"] = now


def wake(
    deployment_id: int,
    now: float | None = None,
    held_at_ms: int | None = None,
    placed: list[DeploymentInstance] | None = None,
) -> bool:
    """A request for a sleeping deployment is held at the gateway (since ``held_at_ms``, epoch): place its
    replicas now. Returns whether it was asleep (a second signal for the same wake-up changes nothing). The
    cold start's first marks are kept in the scaling memory (``cold``) until the gateway records it.
    ``placed``: the caller collects the placements and tells their hosts itself (``scheduler.enqueue``) - the
    wake-ups read together reach each host as one change of its desired state, one fetch."""
    now = time.time() if now is None else now
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().filter(pk=deployment_id).first()
        if deployment is None or not deployment.autoscaled() or deployment.replicas > 0:
            return False
        if deployment.state not in DECIDED_IN:
            return False
        wanted = max(1, deployment.min_replicas or 0)
        memory = Memory.load(deployment.scaling_memory)
        # It just served: the idle period counts from now, so it does not go back to sleep at once.
        memory.last_traffic_at, memory.recommendations = now, [[now, wanted]]
        deployment.scaling_memory = {**deployment.scaling_memory, **memory.dump(), "woken_at": now}
        asleep = deployment.asleep_since
        deployment.replicas, deployment.asleep_since = wanted, None
        ended = scheduler.end_wait(deployment)  # a wait from before its sleep: this wake-up's begins now
        deployment.save(update_fields=["replicas", "asleep_since", "scaling_memory", "updated_at", *ended])
        slept = f" (asleep since {asleep:%Y-%m-%d %H:%M:%S} UTC)" if asleep else ""
        deployment.events.create(
            kind="woken",
            message=f"0 -> {wanted} replicas: a request is held at the gateway{slept}",
            details={"to": wanted},
        )
        decided = scheduler.place_replicas(deployment, make_room=make_room)
        marks = {"signal_at": round(now * 1000)}
        if decided:  # else it waits for room: ``note_placed`` marks when the scheduler places it
            marks["placed_at"] = round(time.time() * 1000)
        if held_at_ms is not None:
            marks["held_at"] = held_at_ms
        deployment.scaling_memory["cold"] = marks
        deployment.save(update_fields=["scaling_memory"])
        if placed is not None:
            placed.extend(decided)
        else:
            transaction.on_commit(lambda: scheduler.enqueue(decided))
    return True


def note_placed(deployment: Deployment, placed: list[DeploymentInstance]) -> None:
    """The scheduler placed a replica of a deployment woken while no instance had room (the caller holds its
    row lock): the cold start's "placed" mark is now, so the wait for room shows in that hop."""
    marks = (deployment.scaling_memory or {}).get("cold")
    if placed and isinstance(marks, dict) and "placed_at" not in marks:
        marks["placed_at"] = round(time.time() * 1000)
        deployment.save(update_fields=["scaling_memory"])


def note_loaded(
    deployment_id: int, timings: dict[str, int], arrived_at: float, now: float | None = None
) -> None:
    """An agent's report that a version loaded, with its steps' times, arrived at ``arrived_at`` and was
    recorded: part of a cold start being timed, if any."""
    now = time.time() if now is None else now
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().filter(pk=deployment_id).first()
        marks = (deployment.scaling_memory or {}).get("cold") if deployment is not None else None
        if not isinstance(marks, dict) or "reported_at" in marks:
            return  # not woken (a deploy, a scale-up), or another replica reported first
        marks.update(
            arrived_at=round(arrived_at * 1000), reported_at=round(now * 1000), timings=dict(timings)
        )
        deployment.save(update_fields=["scaling_memory"])


def record_cold_start(deployment_id: int, held_ms: int, routed_at_ms: float | None = None) -> None:
    """The gateway held the request that woke the deployment this long (its extra latency); it routed the
    deployment's first server at ``routed_at_ms`` (epoch, when known). Stores the breakdown
    (``apps.deployments.cold_start``) beside the figure and on the event."""
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().filter(pk=deployment_id).first()
        if deployment is None:
            return
        marks = deployment.scaling_memory.pop("cold", None)
        hops = cold_start.breakdown(marks if isinstance(marks, dict) else {}, held_ms, routed_at_ms)
        deployment.last_cold_start_ms = max(0, int(held_ms))
        deployment.last_cold_start = hops
        deployment.save(
            update_fields=["last_cold_start_ms", "last_cold_start", "scaling_memory", "updated_at"]
        )
        deployment.events.create(
            kind="cold_start",
            message=f"the first request waited {held_ms / 1000:.1f} s at the gateway while a replica loaded",
            details={"held_ms": held_ms, "hops": hops},
        )


# --- Eviction under memory pressure ---------------------------------------------------------------------


@dataclass(frozen=True)
class Resident:
    """A replica on a pool's instance, as eviction sees it."""

    deployment_id: int
    instance_id: int
    need_mb: int
    last_served_at: float | None  # the autoscaler's last sight of traffic (None: not evaluated yet)
    idle_period_s: int
    min_replicas: int | None
    # Under memory pressure a replica idle this long may go even within its idle period (None: only after it).
    min_idle_s: float | None = None

    def evictable(self, now: float) -> bool:
        """Only a scale-to-zero deployment idle for its idle period, or for ``min_idle_s`` if shorter
        (unknown traffic: kept)."""
        protected = (
            self.idle_period_s if self.min_idle_s is None else min(self.idle_period_s, self.min_idle_s)
        )
        return (
            self.min_replicas == 0
            and self.last_served_at is not None
            and now - self.last_served_at >= protected
        )


def choose_evictions(
    residents: list[Resident], free_mb: dict[int, int], need_mb: int, now: float
) -> list[Resident]:
    """The replicas to evict so that one instance has ``need_mb`` free: the least recently used evictable
    ones first, all on the first instance where they make enough room. ``free_mb``: per instance the
    replica may go to, what is free plus what is already being unloaded there. Nothing when an instance
    has (or will have) the room anyway, or when no instance can be freed enough. Pure."""
    if any(free >= need_mb for free in free_mb.values()):
        return []
    gained: dict[int, int] = defaultdict(int)
    taken: dict[int, list[Resident]] = defaultdict(list)
    ordered = sorted(
        (r for r in residents if r.instance_id in free_mb and r.evictable(now)),
        key=lambda r: (r.last_served_at, r.deployment_id),
    )
    for resident in ordered:
        gained[resident.instance_id] += resident.need_mb
        taken[resident.instance_id].append(resident)
        if free_mb[resident.instance_id] + gained[resident.instance_id] >= need_mb:
            return taken[resident.instance_id]
    return []


def _holds_a_request(memory: dict | None, now: float) -> bool:
    """Woken for a request the gateway still holds (its cold start, ``cold``, not recorded yet; within the
    activation timeout): its replica is about to serve it, whatever the idle period says."""
    marks = (memory or {}).get("cold")
    signal_at = marks.get("signal_at") if isinstance(marks, dict) else None
    return (
        isinstance(signal_at, int | float)
        and abs(now - signal_at / 1000) < settings.GATEWAY_ACTIVATION_TIMEOUT_S
    )


def _residents(pool, instance_ids: list[int], exclude: int | None, now: float) -> list[Resident]:
    live_rollouts = Rollout.objects.live().values_list("deployment_id", flat=True)
    rows = list(
        DeploymentInstance.objects.filter(
            instance_id__in=instance_ids,
            retiring_reason="",
            # Serving: a replica still loading was woken by a request held at the gateway, however long ago
            # its last traffic was (under a stream a load can outlast the idle period).
            state=PlacementState.READY,
            deployment__min_replicas=0,
            deployment__pinned=False,
            deployment__state=DeploymentState.SERVING,
        )
        .exclude(deployment_id=exclude)
        .exclude(deployment_id__in=live_rollouts)
        .values_list(
            "deployment_id", "instance_id", "deployment__active_version_id", "deployment__target_version_id",
            "deployment__scaling_memory", "deployment__idle_period_s", "deployment__min_replicas",
        )
    )  # fmt: skip
    sizes = footprints([v for row in rows for v in row[2:4]])
    return [
        Resident(
            deployment_id=deployment_id,
            instance_id=instance_id,
            need_mb=sum(sizes.get(v, 0) for v in {active, target} if v),
            last_served_at=(memory or {}).get("last_traffic_at"),
            idle_period_s=idle,
            min_replicas=low,
            # 0 (the default): never a replica that served within its idle period.
            min_idle_s=settings.SCHEDULER_EVICTION_MIN_IDLE_S or None,
        )
        for deployment_id, instance_id, active, target, memory, idle, low in rows
        if not _holds_a_request(memory, now)
    ]


def make_room(deployment: Deployment, pool, candidates: list[scheduler.Candidate], need_mb: int,
              ledger: Ledger, now: float | None = None) -> str:  # fmt: skip
    """The scheduler found no room for a replica of ``deployment`` in ``pool``: evict what
    ``choose_evictions`` picks, unless the room being unloaded that is this deployment's (``ledger``: room
    evicted for it, or nobody's that the ones waiting longer do not take) will do. Returns a note for the
    pending reason."""
    now = time.time() if now is None else now
    taken = set(scheduler.counted(deployment).values_list("instance_id", flat=True))
    open_ = [c for c in candidates if c.instance_id not in taken]
    ids = [c.instance_id for c in open_]
    free = {c.instance_id: c.free_mb + ledger.coming.get(c.instance_id, 0) for c in open_}
    if any(f >= need_mb for f in free.values()):
        return "waiting for evicted replicas to unload"
    victims = choose_evictions(_residents(pool, ids, deployment.pk, now), free, need_mb, now)
    evicted = [v for v in victims if _evict(v, deployment, pool, now)]
    if not evicted:
        return ""
    return f"evicting {len(evicted)} idle replica(s) of scale-to-zero deployments to make room"


def _evict(resident: Resident, for_deployment: Deployment | None, pool, now: float) -> bool:
    """Put the resident's deployment to sleep now, for ``for_deployment`` (None: to keep the headroom). Its
    row is taken only if nobody holds it (a deployment being woken or decided at this moment is not idle)."""
    victim = (
        Deployment.objects.select_for_update(skip_locked=True, of=("self",))
        .select_related("model")
        .filter(pk=resident.deployment_id, state=DeploymentState.SERVING, min_replicas=0, pinned=False)
        .first()
    )
    if victim is None or victim.replicas == 0:
        return False
    memory = Memory.load(victim.scaling_memory)
    fresh = Resident(resident.deployment_id, resident.instance_id, resident.need_mb, memory.last_traffic_at,
                     victim.idle_period_s, victim.min_replicas, settings.SCHEDULER_EVICTION_MIN_IDLE_S)  # fmt: skip
    if not fresh.evictable(now) or _holds_a_request(victim.scaling_memory, now):
        return False
    current = victim.replicas
    memory.recommendations = []
    victim.scaling_memory = {**victim.scaling_memory, **memory.dump()}
    victim.replicas, victim.asleep_since = 0, datetime.fromtimestamp(now, UTC)
    victim.save(update_fields=["replicas", "asleep_since", "scaling_memory", "updated_at"])
    idle_s = now - (memory.last_traffic_at or now)
    why = (
        f"to make room for {for_deployment.model.slug}"
        if for_deployment is not None
        else f"to keep {settings.SCHEDULER_EVICTION_HEADROOM_MB} MiB free for wake-ups"
    )
    victim.events.create(
        kind="evicted",
        message=(
            f"{current} -> 0 replicas: evicted {why} in {pool.name} "
            f"(least recently used; no request for {idle_s:.0f} s, idle period {victim.idle_period_s} s)"
        ),
        instance_id=resident.instance_id,
        details={
            "from": current,
            "to": 0,
            "for_deployment": for_deployment.pk if for_deployment is not None else None,
            "idle_s": round(idle_s),
        },
    )
    removed = scheduler.remove_replicas(
        victim, 0, "asleep (evicted under memory pressure)", evicted_for=for_deployment
    )
    transaction.on_commit(lambda: scheduler.enqueue(removed))
    return True


def keep_headroom(now: float | None = None) -> int:
    """Evict ahead of the wake-ups: on every instance that will have less than
    ``SCHEDULER_EVICTION_HEADROOM_MB`` free, the least recently used replicas ``make_room`` could evict go
    now, so that the next wake-up finds room instead of waiting for an eviction (the drain and an unload,
    about 2 s) - under a stream of wake-ups into a full pool, that wait was half of a cold start. What they
    free is nobody's: it goes to the replicas waiting longest, then to whoever asks (``room``). Returns the
    replicas evicted. 0 (the default): evict only when a replica needs the room."""
    headroom = settings.SCHEDULER_EVICTION_HEADROOM_MB
    if headroom <= 0:
        return 0
    now = time.time() if now is None else now
    evicted = 0
    for pool in Pool.objects.filter(hosts__isnull=False).distinct().order_by("pk"):
        with transaction.atomic():
            short = room.headroom_short(pool, scheduler.candidates_in(pool, lock=True), headroom)
            if not short:
                continue
            residents = _residents(pool, sorted(short), None, now)
            for instance_id, lack in sorted(short.items()):
                ordered = sorted(
                    (r for r in residents if r.instance_id == instance_id and r.evictable(now)),
                    key=lambda r: (r.last_served_at, r.deployment_id),
                )
                for resident in ordered:
                    if lack <= 0:
                        break
                    if _evict(resident, None, pool, now):
                        lack -= resident.need_mb
                        evicted += 1
    return evicted
