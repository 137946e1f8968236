"""Staff change a host's labels after it joined (``PATCH /api/v1/hosts/<name>/``, or the host page): checked
against the label syntax, audited, and the host's pool follows its ``pool`` label - a host that leaves a
pool has the instances that pool's template made for it drained by the scheduler, stopped and removed, and
the new pool's template makes its instances anew."""

from __future__ import annotations

import pytest
from django.utils import timezone

from apps.audit.models import AuditEvent
from apps.deployments import healing, reports, services
from apps.deployments.models import Deployment, PlacementState
from apps.fleet import pools
from apps.fleet.models import DesiredInstanceState, Host, InstanceState, Pool, TritonInstance
from apps.fleet.services import record_heartbeat
from tests.conftest import client_for
from tests.factories import UserFactory
from tests.support.models import make_version

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff():
    return UserFactory(username="ops", is_staff=True)


@pytest.fixture
def staff_client(staff):
    return client_for(staff)


def member_host(name: str, pool: Pool | None, port: int) -> Host:
    """A host that joined and reports a port range: a CPU pool's template makes its ``cpu-0`` at once."""
    host = Host.objects.create(
        name=name,
        address="127.0.0.1",
        last_heartbeat_at=timezone.now(),
        labels={"pool": pool.name} if pool else {},
        pool=pool,
        port_range_first=port,
        port_range_last=port + 99,
    )
    pools.sync_template_instances(host, None)
    TritonInstance.objects.filter(host=host).update(state=InstanceState.READY)  # as its agent reports
    return host


def beat(host: Host) -> None:
    host.refresh_from_db()
    record_heartbeat(
        host, facts={}, read_local=False, port_range=(host.port_range_first, host.port_range_last)
    )


def patch(client, host: Host, body):
    return client.patch(f"/api/v1/hosts/{host.name}/", body, format="json")


# --- The API: who may, what is accepted ---------------------------------------------------------------------


def test_staff_change_a_host_s_labels_and_it_joins_the_pool_they_name(staff_client, staff):
    pool = Pool.objects.create(name="cpu", memory_budget_mb=2000)
    host = member_host("h1", None, 19000)
    response = patch(staff_client, host, {"labels": {"pool": "cpu", "rack": "r12"}})
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["labels"] == {"pool": "cpu", "rack": "r12"} and body["pool"] == "cpu"
    made = TritonInstance.objects.get(host=host)
    assert (made.name, made.template_pool, made.capacity_mb) == ("cpu-0", pool, 2000)
    event = AuditEvent.objects.get(action="host.labels_changed")
    assert event.actor == staff and event.details["pool"] == [None, "cpu"]
    assert event.details["from"] == {} and event.details["to"] == {"pool": "cpu", "rack": "r12"}
    assert event.details["instances_created"] == ["cpu-0"]


@pytest.mark.parametrize(
    "body, field, says",
    [
        ({"labels": ["pool", "cpu"]}, "labels", "object of key/value strings"),
        ({"labels": {"Pool!": "cpu"}}, "labels", "Label key 'Pool!' is not allowed"),
        ({"labels": {"pool": 3}}, "labels", "The value of label 'pool' is not allowed"),
        ({"labels": {"pool": "a b"}}, "labels", "The value of label 'pool' is not allowed"),
        ({"labels": {"pool": "x" * 64}}, "labels", "1-63"),
        ({"labels": {f"k{i}": "v" for i in range(33)}}, "labels", "At most 32 labels"),
        ({}, "labels", "required"),
        ({"labels": {}, "name": "other"}, "name", "Only labels may be changed"),
    ],
)
def test_bad_labels_are_a_400_naming_the_field(staff_client, body, field, says):
    host = member_host("h1", None, 19000)
    response = patch(staff_client, host, body)
    assert response.status_code == 400, response.content
    assert says in " ".join(response.json()["fields"][field])
    host.refresh_from_db()
    assert host.labels == {} and not AuditEvent.objects.filter(action="host.labels_changed").exists()


def test_labels_are_checked_when_staff_add_a_host_too(staff_client):
    response = staff_client.post(
        "/api/v1/hosts/", {"name": "h2", "address": "10.0.0.2", "labels": {"pool": "$(x)"}}, format="json"
    )
    assert response.status_code == 400 and "labels" in response.json()["fields"]
    assert not Host.objects.filter(name="h2").exists()


def test_members_get_403_and_another_team_s_dedicated_host_is_404(
    maintainer_client, outsider_client, team, other_team
):
    shared = member_host("shared", None, 19000)
    ours = Host.objects.create(name="ours", address="10.0.0.3", team=team)
    theirs = Host.objects.create(name="theirs", address="10.0.0.4", team=other_team)
    assert patch(maintainer_client, shared, {"labels": {"a": "b"}}).status_code == 403
    assert patch(maintainer_client, ours, {"labels": {"a": "b"}}).status_code == 403
    assert patch(maintainer_client, theirs, {"labels": {"a": "b"}}).status_code == 404
    assert patch(outsider_client, ours, {"labels": {"a": "b"}}).status_code == 404
    assert all(h.labels == {} for h in Host.objects.all())


# --- Pool membership follows the labels --------------------------------------------------------------------


def test_a_host_that_changes_pools_has_its_template_instance_drained_then_made_by_the_new_pool(
    owner, model, staff
):
    old = Pool.objects.create(name="old", memory_budget_mb=2000)
    new = Pool.objects.create(name="new", memory_budget_mb=3000)
    moving = member_host("moving", old, 19000)
    staying = member_host("staying", old, 19200)
    version = make_version(model)
    deployment = services.deploy_version(
        actor=owner, model=model, version=version, replicas=1, pool=old, spread="none"
    )
    # Its replica is on the host that moves (both are empty: the lower id is chosen), and serves.
    placement = deployment.placements.get()
    assert placement.instance.host == moving
    reports.placement_loaded(placement.pk, placement.generation, version)
    first = TritonInstance.objects.get(host=moving)

    pools.set_labels(actor=staff, host=moving, labels={"pool": "new"})
    moving.refresh_from_db()
    first.refresh_from_db()
    assert moving.pool == new and first.unwanted_since is not None
    # The new pool's cpu-0 waits until the old one is gone (one name per host); the old pool's instance takes
    # no new replica and its replica moves to the host that stayed, one at a time.
    beat(moving)
    assert list(TritonInstance.objects.filter(host=moving)) == [first]
    healing.tick()
    replacement = deployment.placements.get(retiring_reason="")
    assert replacement.instance.host == staying
    reports.placement_loaded(replacement.pk, replacement.generation, version)
    healing.tick()  # the replacement serves: the old replica unloads
    placement.refresh_from_db()
    assert placement.unload
    reports.placement_unloaded(placement.pk, placement.generation, "unloaded")
    healing.tick()  # nothing left on it: stopped ...
    first.refresh_from_db()
    assert first.desired_state == DesiredInstanceState.STOPPED
    TritonInstance.objects.filter(pk=first.pk).update(state=InstanceState.STOPPED)  # its agent stopped it
    healing.tick()  # ... and removed
    assert not TritonInstance.objects.filter(pk=first.pk).exists()
    beat(moving)  # the next heartbeat: the new pool's template makes its instance
    made = TritonInstance.objects.get(host=moving)
    assert (made.name, made.template_pool, made.capacity_mb, made.unwanted_since) == (
        "cpu-0",
        new,
        3000,
        None,
    )
    assert Deployment.objects.get(pk=deployment.pk).placements.filter(state=PlacementState.READY).count() == 1


def test_a_host_whose_pool_label_is_removed_leaves_and_keeps_instances_declared_by_hand(staff):
    pool = Pool.objects.create(name="cpu", memory_budget_mb=2000)
    host = member_host("h1", pool, 19000)
    hand = TritonInstance.objects.create(
        host=host, name="by-hand", http_port=19500, grpc_port=19501, metrics_port=19502
    )
    pools.set_labels(actor=staff, host=host, labels={"rack": "r1"})
    host.refresh_from_db()
    assert host.pool is None and host.labels == {"rack": "r1"}
    unwanted = set(
        TritonInstance.objects.filter(host=host, unwanted_since__isnull=False).values_list("name", flat=True)
    )
    assert unwanted == {"cpu-0"}
    hand.refresh_from_db()
    assert hand.unwanted_since is None
    event = AuditEvent.objects.get(action="host.labels_changed")
    assert event.details["pool"] == ["cpu", None] and event.details["instances_unwanted"] == ["cpu-0"]


# --- The host page -------------------------------------------------------------------------------------------


def test_staff_edit_labels_on_the_host_page_and_a_member_may_not(client, staff, maintainer):
    Pool.objects.create(name="cpu", memory_budget_mb=2000)
    host = member_host("h1", None, 19000)
    client.force_login(staff)
    page = client.get(f"/hosts/{host.name}/")
    assert b'id="host-labels-form"' in page.content
    response = client.post(f"/hosts/{host.name}/", {"op": "labels", "labels": "pool=cpu\nrack = r7\n"})
    assert response.status_code == 302
    host.refresh_from_db()
    assert host.labels == {"pool": "cpu", "rack": "r7"} and host.pool.name == "cpu"
    bad = client.post(f"/hosts/{host.name}/", {"op": "labels", "labels": "pool=cpu\nnot a label"})
    assert bad.status_code == 400 and b"is not key=value" in bad.content
    worse = client.post(f"/hosts/{host.name}/", {"op": "labels", "labels": "Pool=cpu"})
    assert worse.status_code == 400 and b"Label key" in worse.content
    host.refresh_from_db()
    assert host.labels == {"pool": "cpu", "rack": "r7"}
    client.force_login(maintainer)
    assert client.post(f"/hosts/{host.name}/", {"op": "labels", "labels": "a=b"}).status_code == 403
