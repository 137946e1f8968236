"""Host identity and the agent API: staff add a host and get a one-time join token, the agent exchanges it for
a credential (only its hash is kept), revocation is immediate, and each credential opens only its own host's
desired state, placements and artifacts - nothing of the management API, which opens nothing here."""

from __future__ import annotations

import hashlib

import pytest
from django.test import Client

from apps.deployments import services as deployment_services
from apps.deployments.models import PlacementState
from apps.fleet import services
from apps.fleet.models import Host, TritonInstance, hash_host_secret
from tests.conftest import client_for
from tests.factories import UserFactory
from tests.fleet.helpers import agent_client, joined_client

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff_client(db):
    return client_for(UserFactory(username="ops", is_staff=True))


def test_staff_add_a_host_and_its_join_token_is_shown_once_and_stored_as_a_hash(staff_client):
    created = staff_client.post("/api/v1/hosts/", {"name": "npu-7", "address": "10.0.0.7"}, format="json")
    assert created.status_code == 201, created.content
    token = created.json()["join_token"]
    assert token.startswith("hjt_") and created.json()["identity"] == "awaiting join"
    host = Host.objects.get(name="npu-7")
    assert host.join_token_hash == hash_host_secret(token) and token not in str(host.__dict__)
    assert "join_token" not in staff_client.get("/api/v1/hosts/npu-7/").json()
    joined_ = agent_client().post("/agent/v1/join", {"join_token": token}, content_type="application/json")
    assert joined_.status_code == 201 and joined_.json()["host"] == "npu-7"
    credential = joined_.json()["credential"]
    assert credential.startswith("hag_")
    host.refresh_from_db()
    assert (
        host.credential_hash == hashlib.sha256(credential.encode()).hexdigest() and not host.join_token_hash
    )
    again = agent_client().post("/agent/v1/join", {"join_token": token}, content_type="application/json")
    assert again.status_code == 401 and "new one" in again.json()["message"]


def test_members_cannot_add_hosts_or_revoke_them(owner_client):
    refused = owner_client.post("/api/v1/hosts/", {"name": "mine", "address": "10.0.0.9"}, format="json")
    assert refused.status_code == 403 and not Host.objects.filter(name="mine").exists()


def test_a_revoked_host_gets_401_at_once_and_a_new_join_token_brings_it_back(staff_client):
    host, agent, _ = joined_client("edge-1")
    assert agent.post("/agent/v1/heartbeat", {}, content_type="application/json").status_code == 200
    assert staff_client.post("/api/v1/hosts/edge-1/revoke/").json()["identity"] == "revoked"
    refused = agent.get("/agent/v1/desired-state")
    assert refused.status_code == 401 and "revoked" in refused.json()["message"]
    assert agent.post("/agent/v1/heartbeat", {}, content_type="application/json").status_code == 401
    token = staff_client.post("/api/v1/hosts/edge-1/join-token/").json()["join_token"]
    credential = agent_client().post("/agent/v1/join", {"join_token": token}, content_type="application/json")
    fresh = agent_client(credential.json()["credential"])
    assert fresh.get("/agent/v1/desired-state").status_code == 200
    assert agent.get("/agent/v1/desired-state").status_code == 401  # the old credential stays dead


def test_management_credentials_do_not_open_the_agent_api_and_the_host_credential_not_the_management_api(
    staff_client, owner_client, make_token
):
    _, agent, _ = joined_client("edge-2")
    assert staff_client.get("/agent/v1/desired-state").status_code == 401
    assert owner_client.get("/agent/v1/desired-state").status_code == 401
    _, secret = make_token()
    assert Client(HTTP_AUTHORIZATION=f"Bearer {secret}").get("/agent/v1/desired-state").status_code == 401
    # To a host's credential the management API does not exist: 404, the same as for an unknown path.
    for path in ("/api/v1/hosts/", "/api/v1/instances/", "/api/v1/teams/", "/api/v1/me/"):
        answer = agent.get(path)
        assert answer.status_code == 404 and "not visible to you" in answer.json()["message"], path
    assert agent.post("/api/v1/hosts/", {"name": "x"}, content_type="application/json").status_code == 404


def test_heartbeat_records_facts_and_the_npu_inventory_and_refuses_bad_bodies():
    host, agent, instance = joined_client("npu-host")
    chip = {"npu_id": 0, "chip_id": 0, "device_id": 0, "name": "310P3", "health": "OK", "bus_id": "0000:01:00.0",
            "aicore_percent": 7, "memory_used_mb": 100, "memory_total_mb": 1000, "hbm_used_mb": 5,
            "hbm_total_mb": 21534, "power_w": 12.5, "temperature_c": 40}  # fmt: skip
    body = {
        "facts": {"cpus": 8, "platform": "Linux", "secret": "dropped"},
        "npu": {"driver_version": "24.1.rc2", "chips": [chip]},
        "instances": [{"id": instance.pk, "log_tail": "started"}],
    }
    answer = agent.post("/agent/v1/heartbeat", body, content_type="application/json")
    assert answer.status_code == 200 and answer.json()["host"] == "npu-host"
    host.refresh_from_db()
    assert host.facts == {"cpus": 8, "platform": "Linux"} and host.npu_driver_version == "24.1.rc2"
    assert host.is_online() and host.devices.get().hbm_total_mb == 21534
    assert TritonInstance.objects.get(pk=instance.pk).log_tail == "started"
    bad = agent.post("/agent/v1/heartbeat", {"facts": {"cpus": "many"}}, content_type="application/json")
    assert bad.status_code == 400 and "facts.cpus" in bad.json()["message"]


def test_instance_state_reports_are_checked_and_only_for_own_instances():
    _, agent, instance = joined_client("host-a")
    _, _, other = joined_client("host-b", port=18200)
    url = f"/agent/v1/instances/{instance.pk}/state"
    ok = agent.post(url, {"state": "READY", "pid": 4242, "restarts": 1}, content_type="application/json")
    assert ok.status_code == 200
    instance.refresh_from_db()
    assert (instance.state, instance.pid, instance.restarts) == ("READY", 4242, 1)
    bad = agent.post(url, {"state": "PWNED"}, content_type="application/json")
    assert bad.status_code == 400 and "'state' must be one of" in bad.json()["message"]
    other_url = f"/agent/v1/instances/{other.pk}/state"
    assert agent.post(other_url, {"state": "STOPPED"}, content_type="application/json").status_code == 404


def test_desired_state_is_304_until_something_changes_for_the_host(
    owner, make_ready_version, django_capture_on_commit_callbacks
):
    host, agent, instance = joined_client("host-c")
    first = agent.get("/agent/v1/desired-state")
    etag = first["ETag"]
    assert first.json()["instances"][0]["api_key"] == instance.api_key and first.json()["placements"] == []
    assert agent.get("/agent/v1/desired-state", HTTP_IF_NONE_MATCH=etag).status_code == 304
    version = make_ready_version()
    with django_capture_on_commit_callbacks() as callbacks:
        _deploy(owner, version, instance)
    services.notify_hosts([host.pk])  # what the deploy's commit hook does first
    assert callbacks, "the deploy hands its placements over on commit"
    state = agent.get("/agent/v1/desired-state", HTTP_IF_NONE_MATCH=etag)
    assert state.status_code == 200, "the deploy must reach the agent's next poll"
    placement = state.json()["placements"][0]
    assert placement["target"] == version.pk and placement["model_name"] == version.model.triton_model_name()
    files = state.json()["versions"][str(version.pk)]["files"]
    assert {f["path"] for f in files} == {"config.pbtxt", "1/model.onnx"}


def _deploy(owner, version, instance):
    return deployment_services.deploy_version(
        actor=owner, model=version.model, version=version, instances=[instance]
    )


def test_reports_move_the_placement_and_a_stale_generation_is_dropped(owner, make_ready_version):
    _, agent, instance = joined_client("host-d")
    version = make_ready_version()
    placement = _deploy(owner, version, instance).placements.get()
    url = f"/agent/v1/placements/{placement.pk}/report"
    loaded = agent.post(url, {"generation": 1, "result": "loaded", "version": version.pk, "message": "ok"},
                        content_type="application/json")  # fmt: skip
    assert loaded.status_code == 200 and loaded.json()["accepted"] is True
    assert loaded.json()["placement"]["served"] == version.pk
    placement.refresh_from_db()
    assert placement.state == PlacementState.READY and placement.is_applied()
    stale = agent.post(url, {"generation": 0 + 1, "result": "lost", "error": "x", "reloading": False},
                       content_type="application/json")  # fmt: skip
    assert stale.json()["accepted"] is True  # same generation, applied: a loss is news
    placement.refresh_from_db()
    assert placement.state == PlacementState.FAILED
    old = agent.post(url, {"generation": 99, "result": "unloaded"}, content_type="application/json")
    assert old.json()["accepted"] is False
    wrong = agent.post(
        url, {"generation": 1, "result": "loaded", "version": 10**6}, content_type="application/json"
    )
    assert wrong.status_code == 400 and "not a version of" in wrong.json()["message"]


def test_another_hosts_placement_and_unplaced_versions_are_404_and_placed_files_match_their_sha256(
    owner, make_ready_version
):
    _, agent, instance = joined_client("host-e")
    _, intruder, _ = joined_client("host-f", port=18300)
    version = make_ready_version()
    unplaced = make_ready_version(model=version.model, scale=2.0)
    placement = _deploy(owner, version, instance).placements.get()
    report = {"generation": 1, "result": "started"}
    url = f"/agent/v1/placements/{placement.pk}/report"
    assert intruder.post(url, report, content_type="application/json").status_code == 404
    base = f"/agent/v1/versions/{version.pk}"
    assert intruder.get(f"{base}/manifest").status_code == 404
    assert intruder.get(f"{base}/files/1/model.onnx").status_code == 404
    assert agent.get(f"/agent/v1/versions/{unplaced.pk}/manifest").status_code == 404
    manifest = {f["path"]: f["sha256"] for f in agent.get(f"{base}/manifest").json()["files"]}
    body = b"".join(agent.get(f"{base}/files/1/model.onnx").streaming_content)
    assert hashlib.sha256(body).hexdigest() == manifest["1/model.onnx"]
    assert agent.get(f"{base}/files/../../source/x").status_code == 404
    assert agent.get(f"{base}/files/1/../config.pbtxt").status_code == 404


def test_staff_add_a_host_on_the_page_see_its_join_token_once_and_revoke_it(client, owner):
    client.force_login(UserFactory(username="ops-page", is_staff=True))
    page = client.post("/hosts/", {"name": "page-host", "address": "10.0.0.8"})
    assert page.status_code == 200
    token = page.context["join_token"]
    assert token.startswith("hjt_") and token in page.content.decode()
    assert token not in client.get("/hosts/page-host/").content.decode()
    assert client.post("/hosts/", {"name": "page-host", "address": "x"}).status_code == 400
    fresh = client.post("/hosts/page-host/", {"op": "join-token"}).context["join_token"]
    assert fresh != token and Host.objects.get(name="page-host").join_token_hash == hash_host_secret(fresh)
    client.post("/hosts/page-host/", {"op": "revoke"})
    assert Host.objects.get(name="page-host").identity == "revoked"
    client.force_login(owner)
    assert client.post("/hosts/", {"name": "owned", "address": "10.0.0.9"}).status_code == 403
    assert client.post("/hosts/page-host/", {"op": "revoke"}).status_code in (403, 404)
