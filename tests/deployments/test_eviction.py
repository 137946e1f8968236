"""Eviction under memory pressure (``apps.deployments.autoscaling.make_room``): a replica that must load where
no instance has room evicts the least recently used idle replica of a scale-to-zero deployment on the pool -
never one that served within its idle period, never one of a deployment with ``min_replicas`` above zero. The
choice is pure (``choose_evictions``); the rows are tested through the scheduler's tick as it runs."""

from __future__ import annotations

import pytest
from django.utils import timezone

from apps.deployments import agent_api, autoscaling, healing, reports, reserved, services
from apps.deployments.autoscaling import Resident, choose_evictions
from apps.deployments.models import Deployment, DeploymentEvent, DeploymentState, PlacementState
from apps.fleet.models import Host, Pool
from apps.registry.models import RegisteredModel
from tests.support.models import add_instance, make_version

NOW = 10_000.0


def resident(deployment, instance=1, mb=100, served=NOW - 1000, idle=300, low=0) -> Resident:
    return Resident(deployment, instance, mb, served, idle, low)


# --- The choice: pure ------------------------------------------------------------------------------------


def test_the_least_recently_used_idle_replica_is_evicted():
    residents = [resident(1, served=NOW - 400), resident(2, served=NOW - 900), resident(3, served=NOW - 600)]
    assert [r.deployment_id for r in choose_evictions(residents, {1: 50}, 100, NOW)] == [2]


def test_a_replica_that_served_within_its_idle_period_is_never_evicted():
    residents = [resident(1, served=NOW - 100, idle=300), resident(2, served=NOW - 30, idle=60)]
    assert choose_evictions(residents, {1: 0}, 100, NOW) == []
    # Idle for exactly its period: evictable.
    assert choose_evictions([resident(3, served=NOW - 300, idle=300)], {1: 0}, 100, NOW)[0].deployment_id == 3


def test_under_pressure_a_replica_idle_for_the_floor_goes_within_its_idle_period():
    # Idle 30 s of a 300 s idle period: kept without a floor, evictable with a 10 s one; never before it.
    residents = [resident(1, served=NOW - 30, idle=300)]
    assert choose_evictions(residents, {1: 0}, 100, NOW) == []
    floor = [Resident(1, 1, 100, NOW - 30, 300, 0, min_idle_s=10)]
    assert [r.deployment_id for r in choose_evictions(floor, {1: 0}, 100, NOW)] == [1]
    assert choose_evictions([Resident(1, 1, 100, NOW - 5, 300, 0, min_idle_s=10)], {1: 0}, 100, NOW) == []


def test_a_deployment_that_does_not_scale_to_zero_is_never_evicted():
    residents = [resident(1, low=1, served=NOW - 9000), resident(2, low=None, served=NOW - 9000)]
    assert choose_evictions(residents, {1: 0}, 100, NOW) == []


def test_unknown_traffic_is_not_idle():
    assert choose_evictions([resident(1, served=None)], {1: 0}, 100, NOW) == []


def test_enough_room_on_one_instance_evicts_several_there_and_nothing_when_room_is_coming():
    residents = [
        resident(1, instance=1, mb=60, served=NOW - 900),
        resident(2, instance=2, mb=60, served=NOW - 800),
        resident(3, instance=1, mb=60, served=NOW - 700),
    ]
    # 150 MiB needed: instance 1 has 40 free; its two LRU replicas make 160.
    assert [r.deployment_id for r in choose_evictions(residents, {1: 40, 2: 0}, 150, NOW)] == [1, 3]
    # An instance already has (or will have, once its unloads finish) the room: no eviction.
    assert choose_evictions(residents, {1: 40, 2: 150}, 150, NOW) == []
    # Not enough can be freed anywhere: no eviction for nothing.
    assert choose_evictions(residents, {1: 0, 2: 0}, 500, NOW) == []
    # Only instances the replica may go to count.
    assert [r.deployment_id for r in choose_evictions(residents, {2: 100}, 150, NOW)] == [2]


# --- Through the scheduler's tick --------------------------------------------------------------------------


@pytest.fixture
def full_pool(owner, team):
    """One instance with room for two 100 MiB replicas, both taken by scale-to-zero deployments."""
    pool = Pool.objects.create(name="cpu", memory_budget_mb=250)
    host = Host.objects.create(name="h0", address="127.0.0.1", last_heartbeat_at=timezone.now(), pool=pool)
    add_instance(host, "cpu-0", 18300)
    deployments = {}
    for slug in ("old", "recent", "cold"):
        model = RegisteredModel.objects.create(team=team, name=slug, slug=slug, created_by=owner)
        version = make_version(model)
        version.footprint_mb = 100
        version.save(update_fields=["footprint_mb"])
        if slug != "cold":
            d = services.deploy_version(actor=owner, model=model, version=version, replicas=1, pool=pool)
            Deployment.objects.filter(pk=d.pk).update(state=DeploymentState.SERVING)
            d.placements.update(state=PlacementState.READY, served_version=version)
            autoscaling.configure(actor=owner, deployment=d, values={
                "min_replicas": 0, "max_replicas": 1, "idle_period_s": 60})  # fmt: skip
            deployments[slug] = d
        else:
            deployments[slug] = version
    return pool, deployments


def small_model(team, owner, slug: str):
    model = RegisteredModel.objects.create(team=team, name=slug, slug=slug, created_by=owner)
    version = make_version(model)
    version.footprint_mb = 100
    version.save(update_fields=["footprint_mb"])
    return model, version


def served(deployment, seconds_ago: float) -> None:
    memory = {**deployment.scaling_memory, "last_traffic_at": timezone.now().timestamp() - seconds_ago}
    Deployment.objects.filter(pk=deployment.pk).update(scaling_memory=memory)


def test_a_cold_model_evicts_the_lru_idle_replica_and_is_placed_once_it_unloaded(owner, full_pool):
    pool, d = full_pool
    served(d["old"], 600)
    served(d["recent"], 120)
    version = d["cold"]
    cold = services.deploy_version(actor=owner, model=version.model, version=version, replicas=1, pool=pool)
    assert cold.state == DeploymentState.PENDING and not cold.placements.exists()
    healing.tick()
    old, recent = Deployment.objects.get(pk=d["old"].pk), Deployment.objects.get(pk=d["recent"].pk)
    # Both were idle past their period; the least recently used one goes.
    assert old.replicas == 0 and old.asleep_since is not None
    assert (
        recent.replicas == 1 and recent.placements.filter(unload=False, state=PlacementState.READY).exists()
    )
    event = old.events.get(kind="evicted")
    assert "evicted to make room for cold in cpu" in event.message and "least recently used" in event.message
    assert old.placements.get().unload is True
    # Its memory counts until it is unloaded: still pending, and no second eviction meanwhile.
    healing.tick()
    assert not Deployment.objects.get(pk=cold.pk).placements.exists()
    assert Deployment.objects.get(pk=d["recent"].pk).replicas == 1
    assert "waiting for evicted replicas to unload" in Deployment.objects.get(pk=cold.pk).pending_reason
    old.placements.update(state=PlacementState.UNLOADED)
    healing.tick()
    assert Deployment.objects.get(pk=cold.pk).placements.filter(state=PlacementState.PENDING).count() == 1


def test_nothing_is_evicted_while_every_replica_served_within_the_eviction_floor(owner, full_pool, settings):
    settings.SCHEDULER_EVICTION_MIN_IDLE_S = 5
    pool, d = full_pool
    served(d["old"], 4)
    served(d["recent"], 2)
    version = d["cold"]
    cold = services.deploy_version(actor=owner, model=version.model, version=version, replicas=1, pool=pool)
    healing.tick()
    assert Deployment.objects.filter(pk__in=[d["old"].pk, d["recent"].pk], replicas=1).count() == 2
    assert not Deployment.objects.get(pk=cold.pk).placements.exists()
    assert "has 0.1 GiB free" in Deployment.objects.get(pk=cold.pk).pending_reason


def test_a_deployment_with_min_replicas_above_zero_is_never_evicted(owner, full_pool):
    pool, d = full_pool
    for key in ("old", "recent"):
        autoscaling.configure(actor=owner, deployment=d[key], values={"min_replicas": 1})
        served(Deployment.objects.get(pk=d[key].pk), 6000)
    version = d["cold"]
    cold = services.deploy_version(actor=owner, model=version.model, version=version, replicas=1, pool=pool)
    healing.tick()
    assert Deployment.objects.filter(pk__in=[d["old"].pk, d["recent"].pk], replicas=1).count() == 2
    assert not Deployment.objects.get(pk=cold.pk).placements.exists()
    assert not Deployment.objects.filter(events__kind="evicted").exists()


def test_the_models_list_and_the_deployment_page_say_which_models_are_loaded_and_which_sleep(
    client, owner, full_pool
):
    pool, d = full_pool
    served(d["old"], 600)
    version = d["cold"]
    services.deploy_version(actor=owner, model=version.model, version=version, replicas=1, pool=pool)
    healing.tick()  # "old" is evicted: asleep; "recent" stays loaded; "cold" waits for the room
    client.force_login(owner)
    html = client.get("/teams/vision/models/").content.decode()
    rows = {
        slug: html.split(f'data-model="{slug}"')[1].split("</tr>")[0] for slug in ("old", "recent", "cold")
    }
    assert 'data-residency="asleep"' in rows["old"]
    assert 'data-residency="loaded"' in rows["recent"]
    assert 'data-residency="waking"' in rows["cold"]
    page = client.get(f"/teams/vision/deployments/{d['old'].pk}/").content.decode()
    assert "asleep (not in memory)" in page and "evicted to make room for cold" in page
    assert "loaded now" in client.get(f"/teams/vision/deployments/{d['recent'].pk}/").content.decode()


def test_a_pending_scale_to_zero_deployment_can_be_put_to_sleep_and_wakes_into_evicted_room(owner, full_pool):
    pool, d = full_pool
    version = d["cold"]
    cold = services.deploy_version(actor=owner, model=version.model, version=version, replicas=1, pool=pool)
    autoscaling.configure(actor=owner, deployment=cold, values={"min_replicas": 0, "max_replicas": 1})
    autoscaling.sleep(actor=owner, deployment=cold)
    cold = Deployment.objects.get(pk=cold.pk)
    assert cold.replicas == 0 and cold.asleep_since is not None and cold.pending_reason == ""
    served(d["old"], 600)
    served(d["recent"], 600)
    Deployment.objects.filter(pk=d["recent"].pk).update(
        scaling_memory={**d["recent"].scaling_memory, "last_traffic_at": timezone.now().timestamp() - 100}
    )
    assert autoscaling.wake(cold.pk) is True
    assert Deployment.objects.get(pk=d["old"].pk).events.filter(kind="evicted").exists()
    assert not Deployment.objects.get(pk=d["recent"].pk).events.filter(kind="evicted").exists()


def test_a_second_waiting_replica_evicts_for_itself_instead_of_queueing_behind_the_first(
    owner, team, full_pool
):
    pool, d = full_pool
    served(d["old"], 600)
    served(d["recent"], 300)
    version = d["cold"]
    cold = services.deploy_version(actor=owner, model=version.model, version=version, replicas=1, pool=pool)
    model, version2 = small_model(team, owner, "cold2")
    cold2 = services.deploy_version(actor=owner, model=model, version=version2, replicas=1, pool=pool)
    healing.tick()
    # The room "old" frees is cold's (it was evicted for it): cold2 does not wait for it but evicts "recent".
    old, recent = Deployment.objects.get(pk=d["old"].pk), Deployment.objects.get(pk=d["recent"].pk)
    assert old.placements.get().evicted_for_id == cold.pk
    assert recent.placements.get().evicted_for_id == cold2.pk
    for waiting in (cold, cold2):
        reason = Deployment.objects.get(pk=waiting.pk).pending_reason
        assert "evicting 1 idle replica" in reason, reason
    healing.tick()  # memory counts until unloaded: each waits for its own room, nothing more is evicted
    for waiting in (cold, cold2):
        assert (
            "waiting for evicted replicas to unload" in Deployment.objects.get(pk=waiting.pk).pending_reason
        )
    for victim in (old, recent):
        victim.placements.update(state=PlacementState.UNLOADED)
    # What an unload report also does (the rows were changed here directly): the instances' reserved memory.
    reserved.refresh_reserved_of([old.pk, recent.pk])
    # An unload report places the one the victim was evicted for at once (``place_short([its id])``)...
    assert healing.place_short([cold.pk]) == 1
    assert not Deployment.objects.get(pk=cold2.pk).placements.exists()
    healing.tick()  # ...the others at the tick
    assert all(Deployment.objects.get(pk=w.pk).placements.count() == 1 for w in (cold, cold2))


def test_room_a_sleep_frees_is_the_longest_waiting_ones_and_the_next_wake_up_evicts_for_itself(
    owner, team, full_pool
):
    """Room nobody claimed (a replica gone to sleep by itself) goes to the replica waiting longest: a later
    wake-up that counted it too waited behind that one, each wake-up one unload behind the last under a
    stream; it evicts an idle replica for itself instead."""
    pool, d = full_pool
    served(d["recent"], 600)  # idle past its period: evictable
    autoscaling.sleep(actor=owner, deployment=Deployment.objects.get(pk=d["old"].pk))
    version = d["cold"]
    cold = services.deploy_version(actor=owner, model=version.model, version=version, replicas=1, pool=pool)
    healing.tick()
    reason = Deployment.objects.get(pk=cold.pk).pending_reason
    assert "waiting for evicted replicas to unload" in reason, reason
    assert not DeploymentEvent.objects.filter(kind="evicted").exists()

    model, version2 = small_model(team, owner, "cold2")
    cold2 = services.deploy_version(actor=owner, model=model, version=version2, replicas=1, pool=pool)
    healing.tick()
    recent = Deployment.objects.get(pk=d["recent"].pk)
    assert recent.replicas == 0 and recent.placements.get().evicted_for_id == cold2.pk
    assert "evicting 1 idle replica" in Deployment.objects.get(pk=cold2.pk).pending_reason

    began = Deployment.objects.get(pk=cold2.pk).waiting_since
    assert began is not None and Deployment.objects.get(pk=cold.pk).waiting_since < began
    healing.tick()  # each counts the room coming for it: nothing more is evicted
    assert DeploymentEvent.objects.filter(kind="evicted").count() == 1
    reason = Deployment.objects.get(pk=cold.pk).pending_reason
    assert "waiting for evicted replicas to unload" in reason, reason
    # Its reason changed ("evicting" -> "waiting"): its turn did not.
    waiting = Deployment.objects.get(pk=cold2.pk)
    assert "waiting for evicted replicas to unload" in waiting.pending_reason
    assert waiting.waiting_since == began


def test_room_evicted_for_a_waiting_replica_is_its_own_once_free_and_a_newcomer_evicts_for_itself(
    owner, team, full_pool
):
    """Between the unload report and the placement it triggers, the freed room is free for every decision:
    a wake-up arriving then took it, and the replica it was evicted for waited on and evicted again."""
    pool, d = full_pool
    served(d["old"], 600)
    served(d["recent"], 300)
    version = d["cold"]
    cold = services.deploy_version(actor=owner, model=version.model, version=version, replicas=1, pool=pool)
    healing.tick()
    old = Deployment.objects.get(pk=d["old"].pk)
    placement = old.placements.get()
    assert placement.evicted_for_id == cold.pk
    assert reports.placement_unloaded(placement.pk, placement.generation, "unloaded")  # room free now

    model, version2 = small_model(team, owner, "newcomer")
    newcomer = services.deploy_version(actor=owner, model=model, version=version2, replicas=1, pool=pool)
    waiting = Deployment.objects.get(pk=newcomer.pk)
    assert not waiting.placements.exists()  # not into cold's room
    assert "0.1 GiB free is held for replicas waiting longer" in waiting.pending_reason, (
        waiting.pending_reason
    )
    healing.tick()
    assert Deployment.objects.get(pk=cold.pk).placements.filter(state=PlacementState.PENDING).count() == 1
    recent = Deployment.objects.get(pk=d["recent"].pk)
    assert recent.replicas == 0 and recent.placements.get().evicted_for_id == newcomer.pk
    # Cold's wait is over: the room evicted for it is nobody's any more (a later wait does not count on it).
    assert Deployment.objects.get(pk=d["old"].pk).placements.get().evicted_for_id is None


def test_room_evicted_for_a_replica_is_its_own_even_when_others_wait_longer(owner, team, full_pool):
    pool, d = full_pool
    served(d["old"], 10)
    served(d["recent"], 10)
    model, version = small_model(team, owner, "longest")
    longest = services.deploy_version(actor=owner, model=model, version=version, replicas=1, pool=pool)
    version = d["cold"]
    cold = services.deploy_version(actor=owner, model=version.model, version=version, replicas=1, pool=pool)
    assert (
        Deployment.objects.get(pk=longest.pk).waiting_since < Deployment.objects.get(pk=cold.pk).waiting_since
    )
    old = autoscaling.sleep(actor=owner, deployment=Deployment.objects.get(pk=d["old"].pk))
    placement = old.placements.get()
    placement.evicted_for_id = cold.pk  # as if evicted for it
    placement.save(update_fields=["evicted_for"])
    assert reports.placement_unloaded(placement.pk, placement.generation, "unloaded")

    assert healing.place_short([cold.pk]) == 1  # the room it made is its own
    assert healing.waiting_for_room(pool.pk) == [longest.pk]


def test_room_nobody_claimed_goes_to_the_replica_waiting_longest_not_to_a_newcomer(owner, team, full_pool):
    pool, d = full_pool
    served(d["old"], 10)
    served(d["recent"], 10)  # within their idle period: nothing may be evicted
    version = d["cold"]
    cold = services.deploy_version(actor=owner, model=version.model, version=version, replicas=1, pool=pool)
    assert Deployment.objects.get(pk=cold.pk).pending_reason
    old = autoscaling.sleep(actor=owner, deployment=Deployment.objects.get(pk=d["old"].pk))
    placement = old.placements.get()
    assert reports.placement_unloaded(placement.pk, placement.generation, "unloaded")

    model, version2 = small_model(team, owner, "newcomer")
    newcomer = services.deploy_version(actor=owner, model=model, version=version2, replicas=1, pool=pool)
    assert not Deployment.objects.get(pk=newcomer.pk).placements.exists()
    assert healing.place_short([newcomer.pk]) == 0  # the room is the longest waiting one's...
    assert healing.place_short([cold.pk]) == 1  # ...and it gets it
    assert healing.waiting_for_room(pool.pk) == [newcomer.pk]


def test_an_unload_in_a_full_pool_places_the_replica_waiting_longest_there_at_once(owner, team, full_pool):
    """A replica that went to sleep by itself (evicted for nobody) frees room: the unload report places the
    deployment waiting longest for room in that pool at once, not at the next tick - and only one that may
    use the pool."""
    pool, d = full_pool
    served(d["old"], 10)
    served(d["recent"], 10)  # both within their idle period: nothing may be evicted
    version = d["cold"]
    cold = services.deploy_version(actor=owner, model=version.model, version=version, replicas=1, pool=pool)
    other_pool = Pool.objects.create(name="elsewhere", memory_budget_mb=250)
    model = RegisteredModel.objects.create(team=team, name="far", slug="far", created_by=owner)
    far = services.deploy_version(actor=owner, model=model, version=make_version(model), replicas=1,
                                  pool=other_pool)  # fmt: skip
    assert "no instance" in Deployment.objects.get(pk=cold.pk).pending_reason
    assert Deployment.objects.get(pk=far.pk).pending_reason
    assert healing.waiting_for_room(pool.pk) == [cold.pk]

    old = autoscaling.sleep(actor=owner, deployment=Deployment.objects.get(pk=d["old"].pk))
    placement = old.placements.get()
    assert not Deployment.objects.get(pk=cold.pk).placements.exists()  # its memory counts until unloaded
    assert reports.placement_unloaded(placement.pk, placement.generation, "unloaded")
    agent_api._place_in_freed_room(placement.evicted_for_id, pool.pk)  # what the unload report does next

    assert Deployment.objects.get(pk=cold.pk).placements.filter(state=PlacementState.PENDING).count() == 1
    assert not Deployment.objects.get(pk=far.pk).placements.exists()
    assert healing.waiting_for_room(pool.pk) == []


def test_a_woken_replica_still_loading_or_not_yet_serving_its_held_request_is_never_evicted(owner, full_pool):
    """Under a stream a load can outlast the idle period: a replica woken for a request the gateway still
    holds is not evicted while it loads, nor once READY until that request went on (its cold start
    recorded) - evicting it stranded the held request for another wake-up."""
    pool, d = full_pool
    served(d["old"], 600)
    served(d["recent"], 600)  # both idle long past their period
    now = timezone.now().timestamp()
    woken = {"cold": {"signal_at": round((now - 30) * 1000)}}
    for name in ("old", "recent"):
        memory = {**Deployment.objects.get(pk=d[name].pk).scaling_memory, **woken}
        Deployment.objects.filter(pk=d[name].pk).update(scaling_memory=memory)
    d["old"].placements.update(state=PlacementState.LOADING)
    version = d["cold"]
    cold = services.deploy_version(actor=owner, model=version.model, version=version, replicas=1, pool=pool)
    healing.tick()
    assert not DeploymentEvent.objects.filter(kind="evicted").exists()
    assert Deployment.objects.get(pk=d["recent"].pk).replicas == 1

    # The held request went on (the gateway recorded the cold start): "recent" is idle again and may go;
    # "old" is still loading and stays.
    autoscaling.record_cold_start(d["recent"].pk, 900)
    healing.tick()
    assert Deployment.objects.get(pk=d["recent"].pk).replicas == 0
    assert Deployment.objects.get(pk=d["old"].pk).replicas == 1
    assert Deployment.objects.get(pk=cold.pk).placements.count() == 0  # waits for the unload

    # A cold start never recorded (a gateway restarted) protects it only for the activation timeout.
    stale = {"cold": {"signal_at": round((now - 3600) * 1000)}}
    memory = {**Deployment.objects.get(pk=d["old"].pk).scaling_memory, **stale}
    Deployment.objects.filter(pk=d["old"].pk).update(scaling_memory=memory)
    d["old"].placements.update(state=PlacementState.READY)
    assert autoscaling._holds_a_request(memory, now) is False


def test_a_wake_up_that_waits_for_room_is_marked_placed_when_it_is_placed(owner, full_pool):
    pool, d = full_pool
    served(d["old"], 10)
    served(d["recent"], 10)
    version = d["cold"]
    cold = services.deploy_version(actor=owner, model=version.model, version=version, replicas=1, pool=pool)
    autoscaling.configure(actor=owner, deployment=cold, values={"min_replicas": 0, "max_replicas": 1})
    autoscaling.sleep(actor=owner, deployment=Deployment.objects.get(pk=cold.pk))
    assert autoscaling.wake(cold.pk, held_at_ms=1)
    marks = Deployment.objects.get(pk=cold.pk).scaling_memory["cold"]
    assert "signal_at" in marks and "placed_at" not in marks  # no room yet: not placed

    old = autoscaling.sleep(actor=owner, deployment=Deployment.objects.get(pk=d["old"].pk))
    placement = old.placements.get()
    assert reports.placement_unloaded(placement.pk, placement.generation, "unloaded")
    agent_api._place_in_freed_room(None, pool.pk)
    marks = Deployment.objects.get(pk=cold.pk).scaling_memory["cold"]
    assert marks["placed_at"] >= marks["signal_at"]
    assert Deployment.objects.get(pk=cold.pk).placements.filter(state=PlacementState.PENDING).count() == 1


# --- Headroom: evicted ahead of the wake-ups ---------------------------------------------------------------


def test_the_headroom_evicts_the_lru_idle_replica_before_a_wake_up_needs_the_room(owner, full_pool, settings):
    settings.SCHEDULER_EVICTION_MIN_IDLE_S = 5
    settings.SCHEDULER_EVICTION_HEADROOM_MB = 100
    pool, d = full_pool
    served(d["old"], 30)
    served(d["recent"], 2)  # within the floor: kept
    assert autoscaling.keep_headroom() == 1
    old = Deployment.objects.get(pk=d["old"].pk)
    assert old.replicas == 0 and old.placements.get().unload is True
    event = old.events.get(kind="evicted")
    assert "evicted to keep 100 MiB free for wake-ups in cpu" in event.message
    assert event.details["for_deployment"] is None
    assert Deployment.objects.get(pk=d["recent"].pk).replicas == 1
    # The room being unloaded counts: no second eviction meanwhile, nor once it is free.
    served(d["recent"], 30)
    assert autoscaling.keep_headroom() == 0
    old.placements.update(state=PlacementState.UNLOADED)
    reserved.refresh_reserved([old.placements.get().instance_id])
    assert autoscaling.keep_headroom() == 0
    # A wake-up into the pool finds its room at once: placed, nothing evicted for it.
    version = d["cold"]
    cold = services.deploy_version(actor=owner, model=version.model, version=version, replicas=1, pool=pool)
    assert cold.placements.filter(state=PlacementState.PENDING).count() == 1
    assert Deployment.objects.get(pk=d["recent"].pk).replicas == 1


def test_no_headroom_by_default_and_never_a_replica_within_the_floor(owner, full_pool, settings):
    pool, d = full_pool
    served(d["old"], 600)
    assert autoscaling.keep_headroom() == 0  # 0 MiB: evict only when a replica needs the room
    settings.SCHEDULER_EVICTION_MIN_IDLE_S = 5
    settings.SCHEDULER_EVICTION_HEADROOM_MB = 200
    served(d["old"], 4)
    served(d["recent"], 1)
    assert autoscaling.keep_headroom() == 0
    assert Deployment.objects.filter(pk__in=[d["old"].pk, d["recent"].pk], replicas=1).count() == 2


def test_room_a_waiting_replica_will_take_is_not_headroom(owner, full_pool, settings):
    settings.SCHEDULER_EVICTION_MIN_IDLE_S = 5
    pool, d = full_pool
    served(d["old"], 600)
    served(d["recent"], 2)
    version = d["cold"]
    cold = services.deploy_version(actor=owner, model=version.model, version=version, replicas=1, pool=pool)
    healing.tick()  # the cold one evicts "old" for itself and waits for it to unload
    assert Deployment.objects.get(pk=d["old"].pk).replicas == 0
    assert Deployment.objects.get(pk=cold.pk).pending_reason
    settings.SCHEDULER_EVICTION_HEADROOM_MB = 100
    # 50 free + 100 coming, of which the waiting replica takes 100: 50 short, and "recent" is evictable now.
    served(d["recent"], 30)
    assert autoscaling.keep_headroom() == 1
    assert Deployment.objects.get(pk=d["recent"].pk).replicas == 0
