"""The scheduler without agents: placement by capacity and spread, pending with the reason, self-healing,
drain, pools from labels and instances from the template, and the API's validation of the intent."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.deployments import healing, reserved, scheduler, services
from apps.deployments.models import Deployment, DeploymentState, PlacementState
from apps.deployments.scheduler import Candidate, choose
from apps.fleet import pools
from apps.fleet.models import ExecutorKind, Host, InstanceState, Pool, TritonInstance
from apps.fleet.services import record_heartbeat
from apps.registry.models import RegisteredModel
from backend_ge import npu_smi
from tests.support.models import add_instance, make_version

BASE = "/api/v1/teams/vision/deployments/"
MB = 2**20


def cand(pk, host, capacity, used=0):
    return Candidate(instance_id=pk, host_id=host, label=f"h{host}/i{pk}", capacity_mb=capacity, used_mb=used)


# --- choose(): pure --------------------------------------------------------------------------------------


def test_choose_prefers_the_least_loaded_instance():
    cands = [cand(1, 1, 1000, 800), cand(2, 2, 1000, 100), cand(3, 3, 1000, 500)]
    choice = choose(cands, need_mb=100, count=1, spread="host", replicas=1)
    assert [c.instance_id for c in choice.chosen] == [2] and not choice.reason
    assert cands[1].used_mb == 200  # the candidate's memory is taken for the next decision


def test_choose_binpack_prefers_the_most_loaded_instance_that_still_fits():
    cands = [cand(1, 1, 1000, 800), cand(2, 2, 1000, 100), cand(3, 3, 1000, 500), cand(4, 4, 1000, 950)]
    choice = choose(cands, need_mb=100, count=1, spread="host", replicas=1, policy="binpack")
    assert [c.instance_id for c in choice.chosen] == [1]  # 4 is fuller but 50 MB free do not fit 100
    # Filled up, the next replica of the same size goes to the next fullest that fits.
    choice = choose(cands, need_mb=100, count=1, spread="none", replicas=1, policy="binpack")
    assert [c.instance_id for c in choice.chosen] == [1] and cands[0].used_mb == 1000
    choice = choose(cands, need_mb=100, count=1, spread="none", replicas=1, policy="binpack")
    assert [c.instance_id for c in choice.chosen] == [3]


def test_choose_binpack_keeps_spread_over_hosts_and_fills_one_host_s_devices_first():
    # Host 1 has two devices, host 2 one; binpack fills the loaded device of host 1, and a second replica of
    # the same deployment still goes to another host (spread=host), there the fullest device.
    cands = [cand(1, 1, 1000, 300), cand(2, 1, 1000, 0), cand(3, 2, 1000, 0), cand(4, 2, 1000, 200)]
    choice = choose(cands, need_mb=400, count=2, spread="host", replicas=2, policy="binpack")
    assert [c.instance_id for c in choice.chosen] == [1, 4]
    spread = [cand(1, 1, 1000, 300), cand(2, 1, 1000, 0), cand(3, 2, 1000, 0), cand(4, 2, 1000, 200)]
    choice = choose(spread, need_mb=400, count=2, spread="host", replicas=2, policy="spread")
    assert [c.instance_id for c in choice.chosen] == [2, 3]


def test_choose_spreads_one_replica_per_host_while_there_are_enough_hosts():
    cands = [cand(1, 1, 4000), cand(2, 1, 4000), cand(3, 2, 1000)]
    choice = choose(cands, need_mb=500, count=2, spread="host", replicas=2)
    assert sorted(c.host_id for c in choice.chosen) == [1, 2]


def test_choose_shares_hosts_when_the_pool_has_too_few():
    cands = [cand(1, 1, 4000), cand(2, 1, 4000)]
    choice = choose(cands, need_mb=500, count=2, spread="host", replicas=2)
    assert sorted(c.instance_id for c in choice.chosen) == [1, 2] and not choice.reason


def test_choose_never_puts_two_replicas_on_one_instance_and_never_overcommits():
    cands = [cand(1, 1, 1000)]
    choice = choose(cands, need_mb=400, count=2, spread="none", replicas=2)
    assert len(choice.chosen) == 1
    assert "every schedulable host" in choice.reason or "has" in choice.reason
    cands = [cand(1, 1, 1000), cand(2, 1, 1000)]
    choice = choose(cands, need_mb=600, count=3, spread="none", replicas=3)
    assert len(choice.chosen) == 2 and all(c.used_mb <= c.capacity_mb for c in cands)


def test_choose_says_why_nothing_fits():
    cands = [cand(1, 3, 2048, 1000), cand(2, 4, 2048, 1900)]
    choice = choose(cands, need_mb=3277, count=1, spread="host", replicas=1, pool_name="ascend-910b")
    assert not choice.chosen
    assert (
        choice.reason == "no instance in ascend-910b has 3.2 GiB free; the largest free is 1.0 GiB on h3/i1"
    )
    assert "no schedulable instance in cpu" in choose([], need_mb=1, count=1, spread="host", replicas=1,
                                                      pool_name="cpu").reason  # fmt: skip


# --- With the database ----------------------------------------------------------------------------------


@pytest.fixture
def pool(db):
    return Pool.objects.create(name="cpu", memory_budget_mb=1000)


def pool_host(pool: Pool, name: str, *, port: int, capacity: int | None = None) -> TritonInstance:
    host = Host.objects.create(name=name, address="127.0.0.1", last_heartbeat_at=timezone.now(), pool=pool)
    instance = add_instance(host, "cpu-0", port)
    if capacity is not None:
        TritonInstance.objects.filter(pk=instance.pk).update(capacity_mb=capacity)
    return instance


def another_model(team, slug: str) -> RegisteredModel:
    return RegisteredModel.objects.create(team=team, name=slug, slug=slug)


def sized(model, number=1, mb=300):
    version = make_version(model, number)
    version.footprint_mb = mb
    version.save(update_fields=["footprint_mb"])
    return version


def deploy(owner, version, **intent) -> Deployment:
    deployment = services.deploy_version(actor=owner, model=version.model, version=version, **intent)
    return Deployment.objects.get(pk=deployment.pk)


def hosts_of(deployment) -> list[str]:
    rows = deployment.placements.filter(retiring_reason="").exclude(state=PlacementState.UNLOADED)
    return sorted(p.instance.host.name for p in rows)


def test_replicas_spread_over_hosts_with_an_event_per_decision(owner, model, pool):
    pool_host(pool, "h1", port=18100)
    pool_host(pool, "h2", port=18200)
    deployment = deploy(owner, sized(model), replicas=2, pool=pool)
    assert deployment.state == DeploymentState.DEPLOYING and not deployment.pending_reason
    assert hosts_of(deployment) == ["h1", "h2"]
    placed = list(deployment.events.filter(kind="placed"))
    assert len(placed) == 2 and placed[0].details["need_mb"] == 300
    assert placed[0].details["free_mb_before"] == 1000 and placed[0].details["alternatives"]


def test_a_model_too_big_stays_pending_with_the_reason_and_places_when_capacity_frees(
    owner, model, pool, team
):
    instance = pool_host(pool, "h1", port=18100)
    other = another_model(team, "big-one")
    hog = deploy(owner, sized(other, mb=800), replicas=1, pool=pool)
    deployment = deploy(owner, sized(model, mb=500), replicas=1, pool=pool)
    assert deployment.state == DeploymentState.PENDING
    assert deployment.pending_reason == (
        "1 of 1 replica(s) pending: no instance in cpu has 0.5 GiB free; the largest free is 0.2 GiB on "
        f"{instance}"
    )
    assert deployment.events.filter(kind="unschedulable").count() == 1
    healing.tick()  # nothing changed: no second event
    assert deployment.events.filter(kind="unschedulable").count() == 1
    services.undeploy(actor=owner, deployment=hog)
    hog.placements.update(state=PlacementState.UNLOADED)
    healing.tick()
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.DEPLOYING and deployment.pending_reason == ""
    assert hosts_of(deployment) == ["h1"]


def test_the_estimate_from_the_artifact_is_used_until_measured(model):
    version = make_version(model)
    version.size_bytes = 100 * MB
    assert version.footprint_estimate_mb() == 64 + 150
    version.footprint_mb = 90
    assert version.footprint_estimate_mb() == 90


def test_a_cordoned_host_a_quarantined_instance_and_a_silent_host_get_no_replicas(owner, model, pool):
    a = pool_host(pool, "h1", port=18100)
    b = pool_host(pool, "h2", port=18200)
    c = pool_host(pool, "h3", port=18300)
    Host.objects.filter(pk=a.host_id).update(cordoned_at=timezone.now())
    TritonInstance.objects.filter(pk=b.pk).update(state=InstanceState.QUARANTINED)
    Host.objects.filter(pk=c.host_id).update(last_heartbeat_at=timezone.now() - timedelta(seconds=61))
    deployment = deploy(owner, sized(model), replicas=1, pool=pool)
    assert deployment.state == DeploymentState.PENDING
    assert "no schedulable instance in cpu" in deployment.pending_reason


def test_a_lost_host_s_replica_is_replaced_and_removed_once_the_replacement_serves(owner, model, pool):
    pool_host(pool, "h1", port=18100)
    pool_host(pool, "h2", port=18200)
    pool_host(pool, "h3", port=18300)
    deployment = deploy(owner, sized(model), replicas=2, pool=pool)
    deployment.placements.update(state=PlacementState.READY, served_version=deployment.target_version)
    lost = deployment.placements.first()
    Host.objects.filter(pk=lost.instance.host_id).update(
        last_heartbeat_at=timezone.now() - timedelta(seconds=90)
    )
    healing.tick()
    lost.refresh_from_db()
    assert "sent no heartbeat" in lost.retiring_reason and not lost.unload
    assert len(hosts_of(deployment)) == 2 and lost.instance.host.name not in hosts_of(deployment)
    assert deployment.events.filter(kind="replica_lost").exists()
    # The replacement serves: the lost replica is told to unload (its host drops it when it comes back).
    deployment.placements.filter(retiring_reason="").update(state=PlacementState.READY)
    healing.tick()
    lost.refresh_from_db()
    assert lost.unload and deployment.events.filter(kind="replica_removed").exists()


def test_drain_moves_one_replica_at_a_time(owner, model, pool, team):
    first = pool_host(pool, "h1", port=18100, capacity=5000)
    pool_host(pool, "h2", port=18200, capacity=5000)
    a = deploy(owner, sized(model), replicas=1, pool=pool, spread="none")
    b = deploy(owner, sized(another_model(team, "second")), replicas=1, pool=pool, spread="none")
    for d in (a, b):  # both on the emptiest instance in turn: force them onto h1 for the test
        d.placements.update(instance=first, state=PlacementState.READY)
    pools.set_cordon(actor=owner, host=first.host, cordoned=True, drain=True)
    healing.tick()
    moving = [d for d in (a, b) if d.placements.exclude(retiring_reason="").exists()]
    assert len(moving) == 1  # one at a time
    d = moving[0]
    assert hosts_of(d) == ["h2"]
    healing.tick()  # the replacement is not READY yet: nothing unloads, nothing else moves
    assert not d.placements.filter(unload=True).exists()
    d.placements.filter(retiring_reason="").update(state=PlacementState.READY)
    healing.tick()
    old = d.placements.get(instance=first)
    assert old.unload
    old.state = PlacementState.UNLOADED
    old.save(update_fields=["state"])
    healing.tick()
    other = b if d == a else a
    assert other.placements.exclude(retiring_reason="").exists()


def test_pool_from_label_and_instances_from_the_template(db, owner):
    host = Host.objects.create(name="npu-1", address="127.0.0.1", labels={"pool": "ascend"})
    pool = pools.create_pool(actor=None, name="ascend", executor=ExecutorKind.NPU, devices_per_instance=2,
                             hbm_reserve_mb=1000)  # fmt: skip
    host.refresh_from_db()
    assert host.pool == pool
    chip = dict(name="910B", health="OK", power_w=None, temperature_c=None, hugepages_used=0, hugepages_total=0,
                bus_id="", aicore_percent=None, memory_used_mb=0, memory_total_mb=0, hbm_used_mb=0,
                hbm_total_mb=32000)  # fmt: skip
    chips = [npu_smi.NpuChip(npu_id=i, chip_id=0, device_id=i, **chip) for i in range(4)]
    inventory = npu_smi.NpuInventory(npu_smi_version="", driver_version="", chips=chips)
    record_heartbeat(host, facts={}, inventory=inventory, read_local=False, port_range=(19000, 19099))
    instances = list(TritonInstance.objects.filter(host=host).order_by("name"))
    assert [(i.name, i.device_ids, i.capacity_mb) for i in instances] == [
        ("npu-0-0", [0, 1], 62000),
        ("npu-2-0", [2, 3], 62000),
    ]
    assert {i.http_port for i in instances} | {i.metrics_port for i in instances} <= set(range(19000, 19100))
    record_heartbeat(host, facts={}, inventory=inventory, read_local=False, port_range=(19000, 19099))
    assert TritonInstance.objects.filter(host=host).count() == 2  # idempotent


# --- The API --------------------------------------------------------------------------------------------


def post(client, **body):
    return client.post(BASE, {"model": "classifier", "version": 1, **body}, format="json")


def test_the_api_deploys_replicas_into_a_pool(maintainer_client, model, pool):
    pool_host(pool, "h1", port=18100)
    sized(model)
    response = post(maintainer_client, replicas=1, pool="cpu")
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["replicas"] == 1 and body["pool"] == "cpu" and not body["pinned"]
    assert len(body["placements"]) == 1 and body["pending_reason"] == ""


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"replicas": 0}, "replicas"),
        ({"replicas": 10000}, "replicas"),
        ({"pool": "nope"}, "pool"),
        ({"pool": "theirs"}, "pool"),
        ({"spread": "diagonal"}, "spread"),
        ({"instances": [1], "pool": "cpu"}, "instances"),
    ],
)
def test_bad_intent_is_a_400_naming_the_field(maintainer_client, model, pool, other_team, body, field):
    Pool.objects.create(name="theirs", team=other_team)
    sized(model)
    response = post(maintainer_client, **body)
    assert response.status_code == 400, response.json()
    assert field in str(response.json()), response.json()


def test_quotas_count_replicas(maintainer_client, model, pool, team):
    team.quota_instances = 2
    team.save(update_fields=["quota_instances"])
    sized(model)
    response = post(maintainer_client, replicas=3, pool="cpu")
    assert response.status_code == 400 and "replicas" in str(response.json())


def test_staff_create_pools_and_cordon_drain_uncordon_hosts(owner, team, maintainer_client):
    from apps.teams.models import Membership
    from tests.conftest import client_for
    from tests.factories import UserFactory

    staff = UserFactory(is_staff=True)
    Membership.objects.create(team=team, user=staff, role="owner")
    host = Host.objects.create(name="h9", address="127.0.0.1", labels={"pool": "gpu-less"})
    body = {"name": "gpu-less", "executor": "cpu", "memory_budget_mb": 2048}
    assert maintainer_client.post("/api/v1/pools/", body, format="json").status_code == 403
    staff_client = client_for(staff)
    response = staff_client.post("/api/v1/pools/", body, format="json")
    assert response.status_code == 201, response.json()
    assert response.json()["hosts"] == ["h9"]
    assert maintainer_client.post(f"/api/v1/hosts/{host.name}/drain/").status_code in (403, 404)
    drained = staff_client.post(f"/api/v1/hosts/{host.name}/drain/").json()
    assert drained["cordoned_at"] and drained["draining_at"] and drained["pool"] == "gpu-less"
    back = staff_client.post(f"/api/v1/hosts/{host.name}/uncordon/").json()
    assert back["cordoned_at"] is None and back["draining_at"] is None


@pytest.mark.django_db(transaction=True)
def test_parallel_deploys_never_overcommit_an_instance(owner, team):
    """On PostgreSQL the candidate instances' row locks serialize the decisions: 6 deploys of 400 MB race
    for two instances of 1000 MB; exactly 4 fit, the others stay PENDING."""
    import threading

    from django.db import connection, connections

    if connection.vendor != "postgresql":
        pytest.skip("row locks are PostgreSQL's; SQLite serializes writers anyway")
    pool = Pool.objects.create(name="race", memory_budget_mb=1000)
    pool_host(pool, "r1", port=18100)
    pool_host(pool, "r2", port=18200)
    versions = [sized(another_model(team, f"m{i}"), mb=400) for i in range(6)]
    barrier, errors = threading.Barrier(len(versions)), []

    def run(version):
        try:
            barrier.wait(timeout=10)
            services.deploy_version(actor=owner, model=version.model, version=version, replicas=1, pool=pool,
                                    spread="none")  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(v,)) for v in versions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors, errors
    used = reserved.used_by_instance(
        list(TritonInstance.objects.filter(host__pool=pool).values_list("pk", flat=True))
    )
    assert sorted(used.values()) == [800, 800]
    assert Deployment.objects.filter(state=DeploymentState.PENDING).count() == 2


def test_a_measured_footprint_is_kept_from_the_first_load(model):
    from apps.registry.services import record_footprint

    version = make_version(model)
    assert record_footprint(version.pk, 420) and not record_footprint(version.pk, 999)
    version.refresh_from_db()
    assert version.footprint_mb == 420 and version.footprint_estimate_mb() == 420


def test_the_used_memory_summed_in_sql_is_the_footprints_of_the_live_placements(owner, team, pool):
    """The SQL aggregate that defines an instance's reserved memory: served + target (once when they are the
    same), the estimate for an unmeasured version, nothing for unloaded placements or undeployed deployments."""
    first = pool_host(pool, "h1", port=18100, capacity=100_000)
    second = pool_host(pool, "h2", port=18200, capacity=100_000)
    switching = deploy(owner, sized(another_model(team, "a"), mb=300), replicas=2, pool=pool)
    new = sized(switching.model, number=2, mb=700)
    Deployment.objects.filter(pk=switching.pk).update(
        active_version=switching.target_version, target_version=new
    )
    same = deploy(owner, sized(another_model(team, "b"), mb=50), replicas=1, pool=pool)
    Deployment.objects.filter(pk=same.pk).update(active_version=same.target_version)
    unmeasured = make_version(another_model(team, "c"))
    unmeasured.size_bytes = 10 * MB
    unmeasured.save(update_fields=["size_bytes"])
    estimated = deploy(owner, unmeasured, replicas=2, pool=pool)
    gone = deploy(owner, sized(another_model(team, "d"), mb=5000), replicas=1, pool=pool)
    services.undeploy(actor=owner, deployment=gone)
    gone.placements.update(state=PlacementState.UNLOADED)
    unloaded = deploy(owner, sized(another_model(team, "e"), mb=9000), replicas=2, pool=pool)
    unloaded.placements.filter(instance=second).update(state=PlacementState.UNLOADED)

    expected = {first.pk: 0, second.pk: 0}
    for deployment in (switching, same, estimated, unloaded):
        deployment.refresh_from_db()
        need = scheduler.deployment_need_mb(deployment)
        for placement in deployment.placements.exclude(state=PlacementState.UNLOADED):
            expected[placement.instance_id] += need
    assert scheduler.deployment_need_mb(switching) == 1000
    assert scheduler.deployment_need_mb(estimated) == unmeasured.footprint_estimate_mb() == 64 + 15
    assert reserved.used_by_instance([first.pk, second.pk]) == expected
    assert sum(expected.values()) == 2 * 1000 + 50 + 2 * 79 + 9000
    # The rows were changed behind the writers' back above: the figure the decisions read is recomputed
    # (as the beat does), and then agrees with the aggregate.
    assert reserved.repair_reserved() >= 1 and reserved.reserved_drift() == {}
    assert {c.instance_id: c.used_mb for c in scheduler.candidates_in(pool, lock=False)} == expected


def test_a_binpack_pool_fills_the_loaded_instance_and_says_so_in_the_event(owner, team, maintainer_client):
    pool = Pool.objects.create(name="packed", memory_budget_mb=1000, placement_policy="binpack")
    first = pool_host(pool, "p1", port=18100)
    pool_host(pool, "p2", port=18200)
    deploy(owner, sized(another_model(team, "a"), mb=300), replicas=1, pool=pool)
    second = deploy(owner, sized(another_model(team, "b"), mb=300), replicas=1, pool=pool)
    assert [p.instance_id for p in second.placements.all()] == [first.pk]
    event = second.events.get(kind="placed")
    assert event.details["policy"] == "binpack" and "most loaded instance that still fits" in event.message
    # The same two deploys in a spread pool land on both hosts.
    pool.placement_policy = "spread"
    pool.save()
    third = deploy(owner, sized(another_model(team, "c"), mb=300), replicas=1, pool=pool)
    assert hosts_of(third) == ["p2"]
    assert "least loaded instance that fits" in third.events.get(kind="placed").message


def test_staff_patch_a_pool_s_policy_and_budget_and_a_member_may_not(owner, team, maintainer_client, client):
    from tests.factories import UserFactory

    pool = Pool.objects.create(name="cpu-small", memory_budget_mb=1000)
    instance = pool_host(pool, "s1", port=18100)
    TritonInstance.objects.filter(pk=instance.pk).update(from_template=True, capacity_mb=1000)
    url = "/api/v1/pools/cpu-small/"
    assert maintainer_client.patch(url, {"placement_policy": "binpack"}, format="json").status_code == 403
    client.force_login(UserFactory(is_staff=True))
    answer = client.patch(url, {"placement_policy": "tightest"}, content_type="application/json")
    assert answer.status_code == 400 and "placement_policy" in answer.json()["fields"]
    answer = client.patch(url, {"placement_policy": "binpack", "memory_budget_mb": 3000},
                          content_type="application/json")  # fmt: skip
    assert answer.status_code == 200 and answer.json()["placement_policy"] == "binpack"
    instance.refresh_from_db()
    assert instance.capacity_mb == 3000  # a CPU pool's template instances get the new budget at once
