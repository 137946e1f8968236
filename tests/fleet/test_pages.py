"""Host and instance pages: inventory, heartbeat, instance control through htmx, tenancy."""

from __future__ import annotations

import pytest
from django.utils import timezone

from apps.fleet.models import Device, Host, InstanceState, TritonInstance
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def shared(db):
    host = Host.objects.create(
        name="npu-1", address="10.0.0.1", last_heartbeat_at=timezone.now(), facts={"cpus": 96}
    )
    Device.objects.create(
        host=host,
        npu_id=0,
        name="310P3",
        health="OK",
        aicore_percent=37.0,
        hbm_used_mb=2048,
        hbm_total_mb=21534,
    )
    Device.objects.create(
        host=host, npu_id=1, name="310P3", health="Alarm", hbm_used_mb=0, hbm_total_mb=21534
    )
    TritonInstance.objects.create(
        host=host, name="npu-0", http_port=8100, grpc_port=8101, metrics_port=8102,
        state=InstanceState.READY, log_tail="I0101 Started HTTPService at 0.0.0.0:8100", pid=1234,
    )  # fmt: skip
    return host


@pytest.fixture
def dedicated(other_team):
    host = Host.objects.create(name="speech-box", address="10.0.0.2", team=other_team)
    TritonInstance.objects.create(host=host, name="cpu-0", http_port=8100, grpc_port=8101, metrics_port=8102)
    return host


def test_hosts_list_shows_status_heartbeat_devices_and_instance_states(client, viewer, shared, dedicated):
    client.force_login(viewer)
    html = client.get("/hosts/").content.decode()
    assert 'data-host="npu-1"' in html and 'data-host="speech-box"' not in html
    row = html.split('data-host="npu-1"')[1].split("</tr>")[0]
    assert "status-online" in row and " s ago" in row and "<td>2</td>" in row and "npu-0: READY" in row


def test_host_detail_has_the_npu_inventory_and_instances(client, viewer, shared):
    client.force_login(viewer)
    html = client.get("/hosts/npu-1/").content.decode()
    npu0 = html.split('data-npu="0.0"')[1].split("</tr>")[0]
    assert "310P3" in npu0 and "37 %" in npu0 and "2 GiB / 21 GiB" in npu0 and ">OK<" in npu0
    assert ">Alarm<" in html.split('data-npu="1.0"')[1].split("</tr>")[0]
    assert 'data-instance="npu-0"' in html


def test_another_teams_dedicated_host_and_instance_pages_are_404(client, viewer, dedicated):
    client.force_login(viewer)
    assert client.get("/hosts/speech-box/").status_code == 404
    assert client.get("/hosts/speech-box/instances/cpu-0/").status_code == 404
    assert client.post("/hosts/speech-box/instances/cpu-0/", {"op": "stop"}).status_code == 404


def test_instance_page_shows_log_and_buttons_only_to_operators(client, viewer, shared):
    client.force_login(viewer)
    html = client.get("/hosts/npu-1/instances/npu-0/").content.decode()
    assert 'id="instance-log"' not in html and "I0101 Started HTTPService" not in html
    assert "hx-post" not in html
    assert client.post("/hosts/npu-1/instances/npu-0/", {"op": "stop"}).status_code == 403
    assert TritonInstance.objects.get(name="npu-0").desired_state == "RUNNING"


def test_staff_stops_an_instance_through_htmx_and_the_partial_polls_until_it_stopped(client, shared):
    client.force_login(UserFactory(username="ops", is_staff=True))
    html = client.get("/hosts/npu-1/instances/npu-0/").content.decode()
    assert 'hx-vals=\'{"op": "stop"}\'' in html
    partial = client.post(
        "/hosts/npu-1/instances/npu-0/", {"op": "stop"}, HTTP_HX_REQUEST="true"
    ).content.decode()
    assert partial.startswith('<div id="instance-state" data-state="READY"') and "<html" not in partial
    assert 'hx-trigger="load delay:1s, every 2s"' in partial and "wanted: stopped" in partial
    TritonInstance.objects.filter(name="npu-0").update(state=InstanceState.STOPPED, pid=None)
    settled = client.get("/hosts/npu-1/instances/npu-0/", HTTP_HX_REQUEST="true").content.decode()
    assert 'data-state="STOPPED"' in settled and "hx-trigger" not in settled
