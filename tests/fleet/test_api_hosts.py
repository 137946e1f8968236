"""Hosts and instances API: who sees which host, who may start/stop/restart, staff-only creation."""

from __future__ import annotations

import pytest
from django.utils import timezone

from apps.fleet.models import Device, Host, InstanceState, TritonInstance
from tests.conftest import client_for
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def instance_on(host: Host, name: str = "cpu-0", port: int = 18100) -> TritonInstance:
    return TritonInstance.objects.create(
        host=host,
        name=name,
        http_port=port,
        grpc_port=port + 1,
        metrics_port=port + 2,
        state=InstanceState.READY,
    )


@pytest.fixture
def shared(db):
    host = Host.objects.create(name="local", address="127.0.0.1", last_heartbeat_at=timezone.now())
    Device.objects.create(
        host=host,
        npu_id=0,
        name="310P3",
        health="OK",
        aicore_percent=12.0,
        hbm_used_mb=1024,
        hbm_total_mb=21534,
    )
    instance_on(host)
    return host


@pytest.fixture
def dedicated(team):
    host = Host.objects.create(name="vision-npu", address="10.0.0.5", team=team)
    instance_on(host, "npu-0", 8100)
    return host


@pytest.fixture
def staff_client(db):
    return client_for(UserFactory(username="ops", is_staff=True))


def test_member_sees_shared_and_own_dedicated_hosts_with_inventory(viewer_client, shared, dedicated):
    listed = viewer_client.get("/api/v1/hosts/").json()["results"]
    assert [h["name"] for h in listed] == ["local", "vision-npu"]
    local = listed[0]
    assert local["status"] == "online" and 0 <= local["heartbeat_age_seconds"] < 5
    assert local["device_count"] == 1 and local["identity"] == "no credential" and local["team"] is None
    assert local["instances"][0]["name"] == "cpu-0" and local["instances"][0]["state"] == "READY"
    assert listed[1]["status"] == "offline" and listed[1]["team"] == "vision"
    detail = viewer_client.get("/api/v1/hosts/local/").json()
    assert detail["devices"][0]["name"] == "310P3" and detail["devices"][0]["hbm_total_mb"] == 21534
    assert detail["instances"][0]["endpoints"] == {
        "http": "http://127.0.0.1:18100",
        "grpc": "127.0.0.1:18101",
        "metrics": "http://127.0.0.1:18102/metrics",
    }


def test_outsider_gets_404_for_another_teams_dedicated_host_and_instance(outsider_client, shared, dedicated):
    assert [h["name"] for h in outsider_client.get("/api/v1/hosts/").json()["results"]] == ["local"]
    assert outsider_client.get("/api/v1/hosts/vision-npu/").status_code == 404
    instance = dedicated.instances.get()
    assert outsider_client.get(f"/api/v1/instances/{instance.pk}/").status_code == 404
    assert outsider_client.post(f"/api/v1/instances/{instance.pk}/restart/").status_code == 404
    assert instance.pk not in [i["id"] for i in outsider_client.get("/api/v1/instances/").json()["results"]]


def test_instance_detail_has_state_and_only_the_callers_deployments_and_no_log_tail(viewer_client, dedicated):
    instance = dedicated.instances.get()
    TritonInstance.objects.filter(pk=instance.pk).update(
        log_tail="I0101 started", restarts=2, last_error="boom"
    )
    body = viewer_client.get(f"/api/v1/instances/{instance.pk}/").json()
    assert body["log_tail"] is None and body["restarts"] == 2 and body["last_error"] == "boom"
    assert body["can_operate"] is False and body["deployments"] == []


def test_team_maintainer_operates_a_dedicated_host_but_not_a_shared_one(maintainer_client, shared, dedicated):
    own = dedicated.instances.get()
    response = maintainer_client.post(f"/api/v1/instances/{own.pk}/stop/")
    assert response.status_code == 200 and response.json()["desired_state"] == "STOPPED"
    assert maintainer_client.post(f"/api/v1/instances/{own.pk}/start/").json()["desired_state"] == "RUNNING"
    on_shared = shared.instances.get()
    refused = maintainer_client.post(f"/api/v1/instances/{on_shared.pk}/stop/")
    assert refused.status_code == 403
    assert (
        refused.json()["message"] == "Only platform staff may start, stop or restart the instances of local."
    )
    assert TritonInstance.objects.get(pk=on_shared.pk).desired_state == "RUNNING"


def test_viewer_cannot_operate_the_teams_dedicated_host(viewer_client, dedicated):
    instance = dedicated.instances.get()
    response = viewer_client.post(f"/api/v1/instances/{instance.pk}/restart/")
    assert response.status_code == 403
    assert "maintainers and owners of team 'vision'" in response.json()["message"]


def test_start_lifts_a_quarantine(staff_client, shared):
    instance = shared.instances.get()
    TritonInstance.objects.filter(pk=instance.pk).update(state=InstanceState.QUARANTINED, crash_times=["x"])
    body = staff_client.post(f"/api/v1/instances/{instance.pk}/start/").json()
    assert body["state"] == "STOPPED" and body["crash_times"] == [] and body["desired_state"] == "RUNNING"


def test_staff_sees_every_host_and_creates_hosts_and_instances(
    staff_client, owner_client, shared, dedicated, team
):
    assert len(staff_client.get("/api/v1/hosts/").json()["results"]) == 2
    created = staff_client.post(
        "/api/v1/hosts/", {"name": "npu-7", "address": "10.0.0.7", "team": "vision"}, format="json"
    )
    assert created.status_code == 201 and created.json()["team"] == "vision"
    duplicate = staff_client.post("/api/v1/hosts/", {"name": "npu-7", "address": "x"}, format="json")
    assert duplicate.status_code == 400 and "already exists" in duplicate.json()["fields"]["name"][0]
    spec = {"host": "npu-7", "name": "npu-0", "http_port": 8100, "grpc_port": 8101, "metrics_port": 8102,
            "device_ids": [0], "executor": "npu"}  # fmt: skip
    instance = staff_client.post("/api/v1/instances/", spec, format="json")
    assert instance.status_code == 201 and instance.json()["device_ids"] == [0]
    clash = staff_client.post("/api/v1/instances/", spec | {"name": "npu-1"}, format="json")
    assert clash.status_code == 400 and "already used" in clash.json()["message"]
    # Team owners are not platform staff.
    assert (
        owner_client.post("/api/v1/hosts/", {"name": "mine", "address": "x"}, format="json").status_code
        == 403
    )
    assert owner_client.post("/api/v1/instances/", spec | {"name": "npu-2"}, format="json").status_code == 403


def test_staff_powers_do_not_travel_with_an_api_token(make_token, owner, shared):
    from tests.conftest import bearer_client

    owner.is_staff = True
    owner.save()
    _, secret = make_token()
    client = bearer_client(secret)
    instance = shared.instances.get()
    assert client.post(f"/api/v1/instances/{instance.pk}/stop/").status_code == 403
