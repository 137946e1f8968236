"""The agent protocol's version (``X-Agent-Protocol``): the platform serves the versions it accepts, refuses the
others on every agent endpoint with a 426 naming both sides' versions, refuses a malformed header with a 400,
keeps the version each host last spoke and shows it on the hosts pages and API; the agent program exits with one
clear line when refused."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from apps.fleet import services
from apps.fleet.models import Host
from hostagent import protocol
from hostagent.client import save_credential
from serving_platform import agent_urls
from tests.factories import UserFactory
from tests.fleet.helpers import agent_client, joined, joined_client

pytestmark = pytest.mark.django_db

HEADER = protocol.AGENT_PROTOCOL_WSGI_KEY
CURRENT = protocol.AGENT_PROTOCOL_VERSION
ROOT = Path(__file__).resolve().parents[2]


def beat(agent, **headers):
    return agent.post("/agent/v1/heartbeat", {}, content_type="application/json", **headers)


def test_an_agent_of_the_current_version_is_served_and_its_version_kept():
    host, agent, _ = joined_client("proto-ok")
    assert host.agent_protocol is None  # no agent has called yet
    assert beat(agent).status_code == 200
    host.refresh_from_db()
    assert host.agent_protocol == CURRENT and host.agent_protocol_served and host.agent_protocol_advice == ""
    assert agent.get("/agent/v1/desired-state").status_code == 200


@pytest.mark.parametrize(
    ("spoken", "side"),
    [
        (None, "upgrade the host agent"),
        ("0", "upgrade the host agent"),
        (str(CURRENT + 1), "upgrade the platform"),
    ],
)
def test_an_older_or_newer_agent_is_refused_naming_both_versions(spoken, side):
    host, credential, _ = joined("proto-refused")
    agent = agent_client(credential)
    headers = {HEADER: spoken} if spoken is not None else {}
    if spoken is None:
        agent.defaults.pop(HEADER)  # an agent released before the header
    answer = beat(agent, **headers)
    assert answer.status_code == 426, answer.content
    body = answer.json()
    expected = 0 if spoken is None else int(spoken)
    assert body["error"] == "agent_protocol" and body["agent_protocol"] == expected
    assert body["platform_protocol"] == CURRENT and body["accepted"] == [
        protocol.MIN_AGENT_PROTOCOL_VERSION,
        CURRENT,
    ]
    assert f"this agent speaks agent protocol {expected}" in body["message"]
    assert (
        f"the platform speaks {CURRENT} (accepts {protocol.MIN_AGENT_PROTOCOL_VERSION}-{CURRENT})"
        in body["message"]
    )
    assert side in body["message"]
    host.refresh_from_db()
    assert host.last_heartbeat_at is None  # refused: nothing of the heartbeat was taken
    assert host.agent_protocol == expected and host.agent_protocol_served is False
    assert side in host.agent_protocol_advice
    # Refused again with the same version: no write for it.
    with CaptureQueriesContext(connection) as queries:
        assert beat(agent, **headers).status_code == 426
    assert not [q for q in queries.captured_queries if q["sql"].startswith(("UPDATE", "INSERT", "DELETE"))]


@pytest.mark.parametrize(
    "raw", ["one", "1.0", "-1", "+1", "1 ", " 1", "1, 1", "0x1", "\u0663", "12345", "9" * 300, ""]
)
def test_a_malformed_protocol_header_is_a_400_naming_the_header(raw):
    host, agent, _ = joined_client("proto-garbage")
    answer = beat(agent, **{HEADER: raw})
    assert answer.status_code == 400, answer.content
    assert "'X-Agent-Protocol' must be the agent's protocol version" in answer.json()["message"]
    host.refresh_from_db()
    assert host.agent_protocol is None and host.last_heartbeat_at is None


def _concrete(route: str) -> str:
    return re.sub(r"<path:\w+>", "1/model.onnx", re.sub(r"<int:\w+>", "1", route))


def test_every_agent_endpoint_refuses_an_agent_without_the_header():
    """Each view under /agent/v1/ (join included) checks the version: none can be reached by a refused agent."""
    _, credential, _ = joined("proto-every")
    old = agent_client(credential)
    old.defaults.pop(HEADER)
    routes = [str(pattern.pattern) for pattern in agent_urls.urlpatterns]
    assert len(routes) >= 8
    for route in routes:
        url = f"/agent/v1/{_concrete(route)}"
        statuses = {old.get(url).status_code, old.post(url, {}, content_type="application/json").status_code}
        assert 426 in statuses and statuses <= {405, 426}, (url, statuses)


def test_a_refused_join_keeps_the_token_for_an_upgraded_agent():
    _, token = services.create_host(actor=None, name="proto-join", address="127.0.0.1")
    refused = agent_client().post(
        "/agent/v1/join", {"join_token": token}, content_type="application/json", **{HEADER: "0"}
    )
    assert refused.status_code == 426 and "agent protocol 0" in refused.json()["message"]
    joined_ = agent_client().post("/agent/v1/join", {"join_token": token}, content_type="application/json")
    assert joined_.status_code == 201, joined_.content


def test_an_unknown_credential_is_a_401_before_the_version_is_looked_at():
    # A stranger learns nothing about the platform's protocol.
    answer = agent_client("hag_not-a-credential").post(
        "/agent/v1/heartbeat", {}, content_type="application/json", **{HEADER: "0"}
    )
    assert answer.status_code == 401


def test_the_hosts_pages_and_api_show_the_version_each_host_last_spoke(client, owner_client):
    current, _, _ = joined("proto-new")
    old, _, _ = joined("proto-old")
    never, _, _ = joined("proto-never")
    Host.objects.filter(pk=current.pk).update(agent_protocol=CURRENT)
    Host.objects.filter(pk=old.pk).update(agent_protocol=0)
    client.force_login(UserFactory(username="ops", is_staff=True))
    html = client.get("/hosts/").content.decode()
    row = {
        name: html.split(f'data-host="{name}"')[1].split("</tr>")[0]
        for name in ("proto-new", "proto-old", "proto-never")
    }
    assert (
        f'<span class="agent-protocol">{CURRENT}</span>' in row["proto-new"]
        and "refused" not in row["proto-new"]
    )
    assert '<span class="agent-protocol">0</span>' in row["proto-old"]
    assert "refused: upgrade the host agent" in row["proto-old"]
    assert "not reported" in row["proto-never"]
    detail = (
        client.get("/hosts/proto-old/")
        .content.decode()
        .split('id="host-agent-protocol"')[1]
        .split("</dd>")[0]
    )
    assert '<span class="agent-protocol">0</span>' in detail and "refused: upgrade the host agent" in detail
    assert f"accepts {protocol.accepted_agent_protocols()}" in detail
    api = owner_client.get("/api/v1/hosts/proto-new/").json()
    assert api["agent_protocol"] == CURRENT and api["agent_protocol_served"] is True
    api = owner_client.get("/api/v1/hosts/proto-old/").json()
    assert api["agent_protocol"] == 0 and api["agent_protocol_served"] is False
    assert owner_client.get("/api/v1/hosts/proto-never/").json()["agent_protocol"] is None


@pytest.mark.servers
@pytest.mark.django_db(transaction=True)
def test_a_refused_agent_exits_3_with_one_line_naming_both_versions(live_server, tmp_path, monkeypatch):
    """The real program against the real platform after an upgrade past the agent's protocol."""
    host, credential, _ = joined("proto-exit")
    credential_file = tmp_path / "host-credential"
    save_credential(credential_file, credential)
    monkeypatch.setattr(protocol, "AGENT_PROTOCOL_VERSION", CURRENT + 1)  # the platform, upgraded
    monkeypatch.setattr(protocol, "MIN_AGENT_PROTOCOL_VERSION", CURRENT + 1)
    result = subprocess.run(
        [sys.executable, "-m", "hostagent", "--platform", live_server.url, "--root", str(tmp_path),
         "--credential-file", str(credential_file)],
        cwd=ROOT, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "tests" / "without_django")},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 3, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert " ERROR hostagent: " in lines[0]
    assert f"this agent speaks agent protocol {CURRENT}; the platform speaks {CURRENT + 1}" in lines[0]
    assert f"(accepts {CURRENT + 1}-{CURRENT + 1}): upgrade the host agent" in lines[0]
    host.refresh_from_db()
    assert host.agent_protocol == CURRENT and host.last_heartbeat_at is None
