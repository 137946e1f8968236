"""The agent API's one wire protocol (``hostagent.protocol``): each message has one validator, used by the agent
on what it receives and sends, and by the platform on what an agent sends. A message that does not fit is
refused with what is wrong, on either side."""

from __future__ import annotations

import copy
import json

import pytest
import requests

from hostagent import protocol
from hostagent.client import DesiredState, PlatformClient, PlatformError
from hostagent.protocol import PlacementReport, PlacementResult, ProtocolError

VERSION = {"id": 7, "number": 1, "label": "vision/m v1", "model_name": "vision__m", "config_text": "",
           "signature": {}, "instance_limit": 8, "files": [{"path": "1/model.onnx", "sha256": "ab", "size": 3}]}  # fmt: skip
INSTANCE = {"id": 3, "name": "cpu-0", "label": "h/cpu-0", "http_port": 8100, "grpc_port": 8101, "metrics_port": 8102,
            "device_ids": [], "executor": "cpu", "latency_summaries": False, "desired_state": "RUNNING",
            "state": "READY", "restarts": 0, "crash_times": [], "pid": 42, "command": "", "command_seq": 0,
            "api_key": "k"}  # fmt: skip
PLACEMENT = {"id": 11, "instance": 3, "label": "h/cpu-0", "deployment": 5, "model_name": "vision__m",
             "generation": 2, "applied_generation": 1, "state": "LOADING", "undeploy": False, "target": 7,
             "active": None, "target_version": 7, "canary_target": None, "served": None, "canary": None,
             "keep_model": False}  # fmt: skip
STATE = {
    "host": "h",
    "generation": 4,
    "instances": [INSTANCE],
    "placements": [PLACEMENT],
    "versions": {"7": VERSION},
}


def test_a_well_formed_desired_state_passes_and_becomes_the_agents_objects():
    desired = DesiredState()
    desired.replace(protocol.check_desired_state(copy.deepcopy(STATE)))
    placement = desired.placement(11)
    assert (
        placement.deployment.target_version.label == "vision/m v1" and desired.instance(3).http_port == 8100
    )


def broken_states():
    def changed(path, value):
        state = copy.deepcopy(STATE)
        target = state
        for key in path[:-1]:
            target = target[key]
        if value is KeyError:
            del target[path[-1]]
        else:
            target[path[-1]] = value
        return state

    yield changed(["generation"], "4"), "'generation'"
    yield changed(["instances", 0, "http_port"], 70000), "'instances[0].http_port' must be an integer from 1"
    yield changed(["instances", 0, "state"], "DANCING"), "'instances[0].state' must be one of"
    yield changed(["instances", 0, "command"], "rm -rf"), "'instances[0].command' must be one of"
    yield changed(["instances", 0, "api_key"], KeyError), "'instances[0]' lacks 'api_key'"
    yield changed(["placements", 0, "target"], 8), "'placements[0].target' names version 8, not in 'versions'"
    yield changed(["placements", 0, "undeploy"], "no"), "'placements[0].undeploy' has the wrong type"
    yield changed(["versions", "7", "id"], 9), "'versions[7]' holds version 9"
    yield (
        changed(["versions", "7", "files"], [{"path": "x"}]),
        "'versions[7].files[0]' must have a 'path' and",
    )


@pytest.mark.parametrize(("state", "message"), list(broken_states()))
def test_a_desired_state_that_does_not_fit_is_refused_naming_the_field(state, message):
    with pytest.raises(ProtocolError) as error:
        protocol.check_desired_state(state)
    assert message in str(error.value)


class Answer:
    """The platform's answer as the agent's HTTP session returns it."""

    def __init__(self, body, status=200):
        self.status_code, self._body, self.headers = status, body, {"ETag": '"4"'}
        self.url = "http://platform/agent/v1/x"
        self.request = requests.Request("GET", self.url)

    def json(self):
        return json.loads(json.dumps(self._body))


def test_the_agent_refuses_a_desired_state_that_does_not_fit_and_keeps_the_one_it_had(monkeypatch):
    client = PlatformClient("http://platform", "hag_x", retries=0)
    bad = copy.deepcopy(STATE)
    bad["placements"][0]["state"] = "SOMEWHERE"
    monkeypatch.setattr(client, "call", lambda *a, **kw: Answer(bad))
    with pytest.raises(PlatformError) as error:
        client.desired_state(None)
    assert "does not fit the agent protocol" in str(error.value) and "placements[0].state" in str(error.value)


def test_the_agent_checks_a_report_before_it_sends_it(monkeypatch):
    client = PlatformClient("http://platform", "hag_x", retries=0)
    sent = []
    monkeypatch.setattr(
        client, "call", lambda *a, **kw: sent.append(kw) or Answer({"accepted": True, "placement": None})
    )
    assert client.report_placement(11, PlacementReport(2, PlacementResult.LOADED, version=7)) == (True, None)
    assert sent[0]["json"] == {"generation": 2, "result": "loaded", "version": 7, "kind": "serving"}
    with pytest.raises(ProtocolError, match="'version' is required for a 'loaded' report"):
        client.report_placement(11, PlacementReport(2, PlacementResult.LOADED))
    with pytest.raises(ProtocolError, match="'pid' must be an integer"):
        client.report_instance(3, {"pid": -5})
    assert len(sent) == 1


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"generation": 0, "result": "loaded", "version": 1}, "'generation' must be the positive generation"),
        (
            {"generation": 1, "result": "exploded"},
            "'result' must be one of canary_failed, canary_loaded, failed",
        ),
        ({"generation": 1, "result": "canary_failed"}, "'canary' is required for a 'canary_failed' report"),
        (
            {"generation": 1, "result": "loaded", "version": 1, "kind": "x"},
            "'kind' must be one of canary_unloaded",
        ),
        ({"generation": 1, "result": "lost", "reloading": "yes"}, "'reloading' must be true or false"),
        ({"generation": 1, "result": "started", "version": "1"}, "'version' must be an integer"),
        ({"generation": 1, "result": "started", "path": "/etc"}, "unknown field(s) 'path'"),
        ({"generation": 1, "result": "waiting", "message": 5}, "'message' must be a string"),
        (
            {"generation": 1, "result": "loaded", "version": 1, "timings": {"load_ms": -1}},
            "'timings.load_ms' must be an integer from 0",
        ),
        (
            {"generation": 1, "result": "loaded", "version": 1, "timings": {"shell": 1}},
            "unknown timing(s) 'shell'",
        ),
        ({"generation": 1, "result": "loaded", "version": 1, "timings": [1]}, "'timings' must be"),
    ],
)
def test_a_placement_report_that_does_not_fit_is_refused_naming_the_field(body, message):
    with pytest.raises(ProtocolError) as error:
        protocol.check_placement_report(body)
    assert message in str(error.value)


def test_an_instance_report_with_a_field_the_protocol_lacks_is_refused():
    with pytest.raises(ProtocolError, match="unknown field"):
        protocol.check_instance_report({"state": "READY", "api_key": "mine now"})
    assert protocol.check_instance_report({"state": "READY", "pid": None}) == {"state": "READY", "pid": None}


def test_a_loaded_report_carries_the_agents_timings_and_one_without_them_is_still_understood():
    timed = protocol.PlacementReport(
        3,
        protocol.PlacementResult.LOADED,
        version=7,
        timings={"files_ms": 4, "load_ms": 250, "total_ms": 300},
    )
    assert protocol.check_placement_report(timed.body()).timings == {
        "files_ms": 4,
        "load_ms": 250,
        "total_ms": 300,
    }
    older = {"generation": 3, "result": "loaded", "version": 7}
    assert protocol.check_placement_report(older).timings is None
