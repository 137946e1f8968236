"""Each instance's reserved memory (``TritonInstance.reserved_mb``, what the scheduler's decisions read) is kept
by the writers of placements: after every kind of change it equals the sum over the instance's live
placements (``scheduler.used_mb_sql``, computed independently). The changes are driven through the services
as the deploy API, the agents' reports and the beat drive them; ``reserved_drift`` is checked before each
tick, because a tick repairs any drift it finds (and counts it: 0 expected here)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.deployments import healing, reports, reserved, scheduler, services
from apps.deployments.models import Deployment, DeploymentInstance, DeploymentState, PlacementState
from apps.fleet import pools
from apps.fleet.models import Host, Pool, TritonInstance
from apps.registry.models import RegisteredModel
from tests.support.models import add_instance, make_version

MB = 2**20


@pytest.fixture
def pool(db):
    pool = Pool.objects.create(name="cpu", memory_budget_mb=10_000)
    for i in range(3):
        host = Host.objects.create(
            name=f"h{i}", address="127.0.0.1", last_heartbeat_at=timezone.now(), pool=pool
        )
        add_instance(host, "cpu-0", 18100 + 10 * i)
    return pool


def sized(model, number: int = 1, mb: int | None = 300):
    version = make_version(model, number)
    version.footprint_mb = mb
    version.size_bytes = 10 * MB
    version.save(update_fields=["footprint_mb", "size_bytes"])
    return version


def reserved_by_host() -> dict[str, int]:
    rows = TritonInstance.objects.order_by("host__name").values_list("host__name", "reserved_mb")
    return dict(rows)


def assert_kept() -> None:
    assert reserved.reserved_drift() == {}


def tick() -> None:
    assert_kept()
    assert healing.tick()["reserved_repaired"] == 0
    assert_kept()


def report(deployment: Deployment, *, loaded: bool = True, only=None) -> None:
    """Each live placement's agent reports its current decision applied (as the agent API does)."""
    deployment.refresh_from_db()
    version = deployment.target_version or deployment.active_version
    rows = deployment.placements.exclude(state=PlacementState.UNLOADED)
    for placement in rows.filter(**(only or {})):
        if placement.unload or not loaded:
            reports.placement_unloaded(placement.pk, placement.generation, "unloaded")
        else:
            reports.placement_loaded(placement.pk, placement.generation, version)
    assert_kept()


def deploy(owner, version, **intent) -> Deployment:
    deployment = services.deploy_version(actor=owner, model=version.model, version=version, **intent)
    assert_kept()
    return Deployment.objects.get(pk=deployment.pk)


def test_deploy_switch_and_undeploy_keep_the_figure(owner, model, pool):
    deployment = deploy(owner, sized(model, mb=300), replicas=2, pool=pool)
    assert sorted(reserved_by_host().values()) == [0, 300, 300]
    report(deployment)
    assert Deployment.objects.get(pk=deployment.pk).state == DeploymentState.SERVING
    services.switch_version(actor=owner, deployment=deployment, version=sized(model, 2, mb=700))
    assert_kept()
    assert sorted(reserved_by_host().values()) == [0, 1000, 1000]  # both versions loaded during the switch
    report(deployment)
    assert Deployment.objects.get(pk=deployment.pk).state == DeploymentState.SERVING
    assert sorted(reserved_by_host().values()) == [0, 700, 700]  # the old one unloaded
    services.undeploy(actor=owner, deployment=deployment)
    assert_kept()
    report(deployment, loaded=False)
    assert Deployment.objects.get(pk=deployment.pk).state == DeploymentState.UNDEPLOYED
    assert set(reserved_by_host().values()) == {0}


def test_a_failed_first_deploy_reserves_nothing(owner, model, pool):
    deployment = deploy(owner, sized(model, mb=300), replicas=1, pool=pool)
    placement = deployment.placements.get()
    reports.placement_failed(
        placement.pk, placement.generation, "boom", version=deployment.target_version, still_serving=None
    )
    assert_kept()
    assert Deployment.objects.get(pk=deployment.pk).state == DeploymentState.FAILED
    assert set(reserved_by_host().values()) == {0}


def test_healing_a_lost_host_keeps_the_figure(owner, model, team, pool):
    deployment = deploy(owner, sized(model, mb=300), replicas=2, pool=pool)
    other = RegisteredModel.objects.create(team=team, name="other", slug="other")
    deploy(owner, sized(other, mb=50), replicas=3, pool=pool)
    report(deployment)
    lost = deployment.placements.order_by("pk").first()
    Host.objects.filter(pk=lost.instance.host_id).update(
        last_heartbeat_at=timezone.now() - timedelta(seconds=90)
    )
    tick()  # retired (still held until unloaded) and replaced elsewhere
    assert sum(reserved_by_host().values()) == 3 * 300 + 3 * 50
    report(deployment, only={"retiring_reason": ""})
    tick()  # the replacement serves: the lost replica is told to unload
    lost.refresh_from_db()
    assert lost.unload
    reports.placement_unloaded(lost.pk, lost.generation, "unloaded")
    assert_kept()
    assert sum(reserved_by_host().values()) == 2 * 300 + 3 * 50


def test_draining_a_host_keeps_the_figure(owner, model, team, pool):
    first = TritonInstance.objects.get(host__name="h0")
    deployment = deploy(owner, sized(model, mb=300), replicas=1, pool=pool, instances=None)
    DeploymentInstance.objects.filter(deployment=deployment).update(instance=first)
    reserved.refresh_reserved(TritonInstance.objects.values_list("pk", flat=True))  # moved by hand above
    report(deployment)
    pools.set_cordon(actor=owner, host=first.host, cordoned=True, drain=True)
    tick()
    moved = deployment.placements.get(retiring_reason="")
    assert moved.instance_id != first.pk and reserved_by_host()["h0"] == 300
    report(deployment, only={"retiring_reason": ""})
    tick()
    report(deployment, only={"instance": first})  # its unload report
    assert reserved_by_host()["h0"] == 0 and sum(reserved_by_host().values()) == 300
    tick()


def test_a_measured_footprint_replaces_the_estimate_on_the_instances(owner, model, pool):
    version = sized(model, mb=None)
    estimate = version.footprint_estimate_mb()
    assert estimate == 64 + 15
    deployment = deploy(owner, version, replicas=2, pool=pool)
    assert sorted(reserved_by_host().values()) == [0, estimate, estimate]
    assert reports.footprint_measured(version.pk, 1234)
    assert_kept()
    assert sorted(reserved_by_host().values()) == [0, 1234, 1234]
    assert not reports.footprint_measured(version.pk, 99)  # only the first load's measure counts
    report(deployment)
    assert sorted(reserved_by_host().values()) == [0, 1234, 1234]


@pytest.mark.django_db(transaction=True)  # the beat runs outside any transaction
def test_the_beat_repairs_a_figure_changed_behind_the_writers_back(owner, model, pool):
    deployment = deploy(owner, sized(model, mb=300), replicas=1, pool=pool)
    instance = deployment.placements.get().instance
    TritonInstance.objects.filter(pk=instance.pk).update(reserved_mb=5)
    assert reserved.reserved_drift() == {instance.pk: (5, 300)}
    assert healing.tick()["reserved_repaired"] == 1
    assert_kept()


def test_a_footprint_reported_by_the_agent_api_moves_the_instance_s_reserved_memory(owner, model):
    from tests.fleet.helpers import joined_client

    _, agent, instance = joined_client("host-f")
    version = sized(model, mb=None)
    deployment = deploy(owner, version, instances=[instance])
    instance.refresh_from_db()
    assert instance.reserved_mb == version.footprint_estimate_mb() == 64 + 15
    placement = deployment.placements.get()
    body = {
        "generation": placement.generation,
        "result": "loaded",
        "version": version.pk,
        "footprint_mb": 420,
    }
    answer = agent.post(f"/agent/v1/placements/{placement.pk}/report", body, content_type="application/json")
    assert answer.status_code == 200 and answer.json()["accepted"] is True
    instance.refresh_from_db()
    assert instance.reserved_mb == 420
    assert_kept()


@pytest.mark.parametrize("hosts, per_host", [(6, 2), (3, 5)])
@pytest.mark.parametrize("policy", ["spread", "binpack"])
def test_a_decision_on_the_policy_s_prefix_chooses_as_on_the_whole_pool(
    db, monkeypatch, policy, hosts, per_host
):
    """The decision reads only the instances its choice can reach (``scheduler._choose_in``); with a prefix
    of one row beyond the replicas and alternatives, every choice - placed, shared host, nothing fits - is
    the one made on all the pool's instances, with the same reason and alternatives."""
    import random

    from apps.deployments.choice import choose

    monkeypatch.setattr(scheduler, "RANKED_MARGIN", 0)
    pool = Pool.objects.create(name="p", memory_budget_mb=1000, placement_policy=policy)
    rng = random.Random(5)
    for h in range(hosts):
        host = Host.objects.create(
            name=f"p{h}", address="127.0.0.1", last_heartbeat_at=timezone.now(), pool=pool
        )
        for i in range(per_host):
            instance = add_instance(host, f"cpu-{i}", 18100 + 20 * h + 3 * i)
            TritonInstance.objects.filter(pk=instance.pk).update(
                reserved_mb=rng.choice([0, 100, 400, 700, 950])
            )
    cases = [
        dict(need_mb=need, count=count, spread=spread, replicas=replicas)
        for need in (50, 300, 600, 2000)
        for count, replicas in ((1, 1), (3, 3), (4, 8))
        for spread in ("host", "none")
    ]
    for case in cases:
        intent = dict(
            case, taken_hosts=set(), taken_instances=set(), pool_name="p", policy=policy, need_of=None
        )
        ours, _ = scheduler._choose_in(pool, **intent)
        whole = choose(scheduler.candidates_in(pool, lock=False), **intent)
        assert [c.instance_id for c in ours.chosen] == [c.instance_id for c in whole.chosen], case
        assert (ours.reason, ours.alternatives) == (whole.reason, whole.alternatives), case


def test_a_prefix_that_would_share_a_host_reads_the_whole_pool(db, monkeypatch):
    """The most free instances all on a host that has a replica already: the choice must look past them."""
    monkeypatch.setattr(scheduler, "RANKED_MARGIN", 0)
    pool = Pool.objects.create(name="p", memory_budget_mb=1000)
    busy, other = (
        Host.objects.create(name=name, address="127.0.0.1", last_heartbeat_at=timezone.now(), pool=pool)
        for name in ("busy", "other")
    )
    for i in range(7):
        add_instance(busy, f"cpu-{i}", 18100 + 3 * i)
    elsewhere = add_instance(other, "cpu-0", 18200)
    TritonInstance.objects.filter(pk=elsewhere.pk).update(reserved_mb=500)
    intent = dict(need_mb=100, count=1, spread="none", replicas=2, taken_hosts={busy.pk}, taken_instances=set(),
                  pool_name="p", policy="spread", need_of=None)  # fmt: skip
    choice, _ = scheduler._choose_in(pool, **intent)
    assert [c.instance_id for c in choice.chosen] == [elsewhere.pk] and not choice.shared_host
