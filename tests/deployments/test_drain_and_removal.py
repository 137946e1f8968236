"""Drain and pinned deployments, and template instances the platform removes when their pool no longer wants
them: the scheduler's beat without agents (``healing.tick``)."""

from __future__ import annotations

import pytest
from django.utils import timezone

from apps.deployments import healing, services
from apps.deployments.models import Deployment, PlacementState
from apps.fleet import pools
from apps.fleet.models import DesiredInstanceState, ExecutorKind, Host, InstanceState, Pool, TritonInstance
from apps.fleet.services import record_heartbeat
from apps.registry.models import RegisteredModel
from backend_ge import npu_smi
from tests.factories import UserFactory
from tests.support.models import add_instance, make_version

pytestmark = pytest.mark.django_db


@pytest.fixture
def pool(db):
    return Pool.objects.create(name="cpu", memory_budget_mb=5000)


def pool_host(pool: Pool, name: str, *, port: int) -> TritonInstance:
    host = Host.objects.create(name=name, address="127.0.0.1", last_heartbeat_at=timezone.now(), pool=pool)
    return add_instance(host, "cpu-0", port)


def sized(model, mb=300):
    version = make_version(model)
    version.footprint_mb = mb
    version.save(update_fields=["footprint_mb"])
    return version


def deploy(owner, version, **intent) -> Deployment:
    deployment = services.deploy_version(actor=owner, model=version.model, version=version, **intent)
    return Deployment.objects.get(pk=deployment.pk)


def live(deployment):
    return deployment.placements.filter(retiring_reason="").exclude(state=PlacementState.UNLOADED)


def serve(deployment):
    live(deployment).update(state=PlacementState.READY, served_version=deployment.target_version)


def unload_retired(deployment):
    deployment.placements.filter(unload=True).update(state=PlacementState.UNLOADED)


def test_a_pinned_deployment_holds_the_drain_and_the_host_page_says_which_and_what_to_do(
    owner, model, team, pool, client
):
    first = pool_host(pool, "h1", port=18100)
    pool_host(pool, "h2", port=18200)
    pinned = deploy(owner, sized(model), instances=[first])
    scheduled = deploy(owner, sized(RegisteredModel.objects.create(team=team, name="s", slug="s")),
                       replicas=1, pool=pool, spread="none")  # fmt: skip
    scheduled.placements.update(instance=first)
    serve(pinned), serve(scheduled)
    pools.set_cordon(actor=owner, host=first.host, cordoned=True, drain=True)
    healing.tick()
    # The scheduled one moves (new replica on h2, the old one retired until the new one serves) ...
    assert [p.instance.host.name for p in live(scheduled)] == ["h2"]
    serve(scheduled)
    healing.tick()
    unload_retired(scheduled)
    healing.tick()
    # ... the pinned one stays where it was pinned, serving: the drain is held, not failed.
    assert [p.instance_id for p in live(pinned)] == [first.pk]
    assert not pinned.events.filter(kind="replica_lost").exists()
    client.force_login(UserFactory(is_staff=True))
    html = client.get("/hosts/h1/").content.decode()
    blocked = html.split('id="drain-blocked"', 1)[1].split("</div>", 1)[0]
    assert "held by pinned deployments" in blocked and f'data-pinned="vision/{model.slug}"' in blocked
    assert "redeploy each on other instances" in blocked and "1</strong> replica still on this host" in html
    # A member of another team sees that something pinned holds it, not whose.
    outsider = UserFactory()
    client.force_login(outsider)
    # (a shared host: anyone signed in may see it)
    html = client.get("/hosts/h1/").content.decode()
    assert "data-pinned=" not in html and "1 pinned replica of other teams" in html
    # Undeployed, the drain is done.
    services.undeploy(actor=owner, deployment=pinned)
    pinned.placements.update(state=PlacementState.UNLOADED)
    client.force_login(owner)
    html = client.get("/hosts/h1/").content.decode()
    assert "Drained: no replica left" in html and 'id="drain-blocked"' not in html


def _npu_inventory(count: int) -> npu_smi.NpuInventory:
    chip = dict(name="910B", health="OK", power_w=None, temperature_c=None, hugepages_used=0, hugepages_total=0,
                bus_id="", aicore_percent=None, memory_used_mb=0, memory_total_mb=0, hbm_used_mb=0,
                hbm_total_mb=8000)  # fmt: skip
    chips = [npu_smi.NpuChip(npu_id=i, chip_id=0, device_id=i, **chip) for i in range(count)]
    return npu_smi.NpuInventory(npu_smi_version="", driver_version="", chips=chips)


def _npu_host(name: str) -> tuple[Host, Pool]:
    pool = Pool.objects.filter(name="ascend").first() or pools.create_pool(
        actor=None, name="ascend", executor=ExecutorKind.NPU, hbm_reserve_mb=1000
    )
    host = Host.objects.create(name=name, address="127.0.0.1", last_heartbeat_at=timezone.now(), pool=pool,
                               labels={"pool": "ascend"})  # fmt: skip
    return host, pool


def beat(host, devices: int):
    host.refresh_from_db()
    record_heartbeat(
        host, facts={}, inventory=_npu_inventory(devices), read_local=False, port_range=(19000, 19099)
    )
    Host.objects.filter(pk=host.pk).update(last_heartbeat_at=timezone.now())


def names(host) -> list[str]:
    return sorted(TritonInstance.objects.filter(host=host).values_list("name", flat=True))


def test_template_instances_of_shrunk_devices_are_drained_stopped_and_removed(owner, model):
    host, pool = _npu_host("n1")
    other, _ = _npu_host("n2")
    beat(host, 4), beat(other, 2)
    TritonInstance.objects.update(state=InstanceState.READY)
    assert names(host) == ["npu-0-0", "npu-1-0", "npu-2-0", "npu-3-0"]
    on_gone = TritonInstance.objects.get(host=host, name="npu-3-0")
    deployment = deploy(owner, sized(model, mb=500), replicas=1, pool=pool)
    deployment.placements.update(instance=on_gone)
    serve(deployment)
    beat(host, 2)  # two devices left the host (failed, or moved to another)
    unwanted = dict(TritonInstance.objects.filter(host=host).values_list("name", "unwanted_since"))
    assert unwanted["npu-2-0"] and unwanted["npu-3-0"] and not unwanted["npu-0-0"]
    healing.tick()
    # The empty one is told to stop; the one with a replica gets no new replicas and its replica moves.
    stopped = TritonInstance.objects.get(host=host, name="npu-2-0")
    assert stopped.desired_state == DesiredInstanceState.STOPPED
    replacement = live(deployment).get()
    assert replacement.instance.name != "npu-3-0" and replacement.instance.unwanted_since is None
    on_gone.refresh_from_db()
    assert on_gone.desired_state == DesiredInstanceState.RUNNING  # it still serves until the move is done
    # The agent stopped npu-2-0: it is removed. The replacement serves, the old replica unloads, then npu-3-0
    # is stopped and, once stopped, removed.
    TritonInstance.objects.filter(pk=stopped.pk).update(state=InstanceState.STOPPED)
    serve(deployment)
    healing.tick()
    assert names(host) == ["npu-0-0", "npu-1-0", "npu-3-0"]
    unload_retired(deployment)
    healing.tick()
    on_gone.refresh_from_db()
    assert on_gone.desired_state == DesiredInstanceState.STOPPED
    TritonInstance.objects.filter(pk=on_gone.pk).update(state=InstanceState.STOPPED)
    healing.tick()
    assert names(host) == ["npu-0-0", "npu-1-0"]
    assert live(deployment).count() == 1 and deployment.events.filter(kind="replica_lost").exists()


def test_a_template_change_and_leaving_the_pool_remove_the_instances_it_no_longer_wants(owner, model):
    host, pool = _npu_host("n1")
    beat(host, 4)
    staff = UserFactory(is_staff=True)
    pools.update_pool(actor=staff, pool=pool, devices_per_instance=2)
    beat(host, 4)
    rows = dict(TritonInstance.objects.filter(host=host).values_list("name", "unwanted_since"))
    # npu-0-0 is wanted again (now for chips 0-1) - it stays; npu-2-0 too; npu-1-0 and npu-3-0 go.
    assert not rows["npu-0-0"] and not rows["npu-2-0"] and rows["npu-1-0"] and rows["npu-3-0"]
    assert TritonInstance.objects.get(host=host, name="npu-0-0").capacity_mb == 14000
    healing.tick()
    TritonInstance.objects.filter(desired_state=DesiredInstanceState.STOPPED).update(
        state=InstanceState.STOPPED
    )
    healing.tick()
    assert names(host) == ["npu-0-0", "npu-2-0"]
    # The host leaves the pool: every template instance goes; a hand-declared one stays.
    hand = add_instance(host, "by-hand", 19500)
    Host.objects.filter(pk=host.pk).update(pool=None, labels={})  # its label no longer names the pool
    beat(host, 4)
    assert set(
        TritonInstance.objects.filter(host=host, unwanted_since__isnull=False).values_list("name", flat=True)
    ) == {"npu-0-0", "npu-2-0"}
    healing.tick()
    TritonInstance.objects.filter(desired_state=DesiredInstanceState.STOPPED).update(
        state=InstanceState.STOPPED
    )
    healing.tick()
    assert names(host) == [hand.name]
