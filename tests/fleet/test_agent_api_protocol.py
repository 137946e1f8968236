"""The platform side of the agent protocol: what it sends passes the agent's own validator, and what an agent
sends that does not fit is a 400 naming the field (``hostagent.protocol``, one module for both sides)."""

from __future__ import annotations

import json

import pytest

from apps.deployments import services
from apps.deployments.agent_api import desired_state_of
from hostagent import protocol
from tests.fleet.helpers import joined_client as joined

pytestmark = pytest.mark.django_db


@pytest.fixture
def deployed(owner, make_ready_version, monkeypatch):
    monkeypatch.setattr(services, "_enqueue", lambda placements: None)
    host, agent, instance = joined("proto-host")
    version = make_ready_version()
    deployment = services.deploy_version(
        actor=owner, model=version.model, version=version, instances=[instance]
    )
    return host, agent, deployment.placements.get()


def test_the_platforms_desired_state_passes_the_agents_validator(deployed):
    host, agent, placement = deployed
    answer = agent.get("/agent/v1/desired-state")
    assert answer.status_code == 200
    state = protocol.check_desired_state(answer.json())
    assert [p["id"] for p in state["placements"]] == [placement.pk]
    assert protocol.check_desired_state(desired_state_of(host)) is not None


def test_a_placement_report_that_does_not_fit_is_a_400_naming_the_field_and_changes_nothing(deployed):
    _, agent, placement = deployed
    body = {"generation": placement.generation, "result": "loaded"}
    before = placement.state
    answer = agent.post(
        f"/agent/v1/placements/{placement.pk}/report", json.dumps(body), content_type="application/json"
    )
    assert answer.status_code == 400
    assert answer.json()["message"] == "'version' is required for a 'loaded' report."
    placement.refresh_from_db()
    assert placement.state == before and placement.applied_generation < placement.generation


def test_an_instance_report_with_an_unknown_field_is_a_400(deployed):
    _, agent, placement = deployed
    answer = agent.post(
        f"/agent/v1/instances/{placement.instance_id}/state",
        json.dumps({"state": "READY", "api_key": "x"}),
        content_type="application/json",
    )
    assert answer.status_code == 400 and "unknown field(s) 'api_key'" in answer.json()["message"]


def test_the_heartbeat_s_port_range_and_the_placement_report_s_footprint_are_checked():
    from hostagent import protocol as p

    assert p.check_heartbeat({"ports": {"first": 18100, "last": 18199}}).ports == (18100, 18199)
    assert p.check_heartbeat({}).ports is None
    for bad in ({"first": 0, "last": 5}, {"first": 200, "last": 100}, {"first": 1, "last": 60000}, []):
        with pytest.raises(p.ProtocolError, match="ports"):
            p.check_heartbeat({"ports": bad})
    report = p.check_placement_report(
        {"generation": 1, "result": "loaded", "version": 3, "footprint_mb": 250}
    )
    assert report.footprint_mb == 250 and report.body()["footprint_mb"] == 250
    with pytest.raises(p.ProtocolError, match="footprint_mb"):
        p.check_placement_report({"generation": 1, "result": "loaded", "version": 3, "footprint_mb": -1})


def test_the_agent_s_port_range_option():
    from hostagent.config import AgentConfig, ConfigError

    assert AgentConfig(platform="http://p", port_range="18100-18199").ports() == {
        "first": 18100,
        "last": 18199,
    }
    assert AgentConfig(platform="http://p").ports() is None
    with pytest.raises(ConfigError, match="port-range"):
        AgentConfig(platform="http://p", port_range="high-low")
