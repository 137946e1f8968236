"""The agent's side of the agent protocol's version: every request it makes - join, heartbeat, the desired
state's long poll, reports, downloads - says ``X-Agent-Protocol``; a platform's 426 is ``ProtocolRefused`` at
once (no retries), and a running agent refused by it logs one ERROR line and takes no more work."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hostagent import protocol
from hostagent.client import PlatformClient, ProtocolRefused, VersionSpec, join
from hostagent.config import AgentConfig
from hostagent.protocol import PlacementReport, PlacementResult
from hostagent.supervisor import HostAgent

FILE = b"onnx bytes"
ANSWERS = {
    ("POST", "/agent/v1/join"): (201, {"host": "h", "address": "127.0.0.1", "credential": "hag_new"}),
    ("POST", "/agent/v1/heartbeat"): (200, {"host": "h", "address": "127.0.0.1", "generation": 1}),
    ("GET", "/agent/v1/desired-state"): (304, None),
    ("POST", "/agent/v1/instances/3/state"): (200, {"id": 3, "accepted": True}),
    ("POST", "/agent/v1/instances/3/final-counts"): (200, {"rows": 0}),
    ("POST", "/agent/v1/placements/11/report"): (200, {"accepted": True, "placement": None}),
    ("GET", "/agent/v1/versions/7/files/1/model.onnx"): (200, FILE),
}


class FakePlatform(BaseHTTPRequestHandler):
    """Answers each agent call as the platform would, and keeps what protocol version each call said."""

    seen: list[tuple[str, str, str | None]]
    refuse = False

    def log_message(self, *args) -> None:
        pass

    def _answer(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        path = self.path.split("?")[0]
        self.seen.append((method, path, self.headers.get(protocol.AGENT_PROTOCOL_HEADER)))
        status, body = ANSWERS.get((method, path), (404, {"error": "not_found", "message": path}))
        if self.refuse:
            status, body = 426, {"error": "agent_protocol", "message": "this agent speaks agent protocol 1; "
                                 "the platform speaks 2 (accepts 2-2): upgrade the host agent"}  # fmt: skip
        payload = body if isinstance(body, bytes) else b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        if status == 304:
            self.send_header("ETag", self.headers.get("If-None-Match", ""))
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self._answer("POST")


@pytest.fixture
def platform():
    handler = type("Handler", (FakePlatform,), {"seen": [], "refuse": False})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    handler.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield handler
    server.shutdown()
    server.server_close()


def test_every_call_of_the_agent_says_its_protocol_version(platform, tmp_path):
    join(platform.url, "hjt_x", tmp_path / "credential")
    client = PlatformClient(platform.url, "hag_new", retries=0)
    client.heartbeat({})
    assert client.desired_state('"4"', wait=0.5) == ('"4"', None)  # a long poll
    client.report_instance(3, {"state": "READY"})
    client.report_final_counts(3, {})
    client.report_placement(11, PlacementReport(2, PlacementResult.STARTED))
    spec = VersionSpec(7, 1, "vision/m v1", "vision__m", "", {}, 8,
                       [{"path": "1/model.onnx", "sha256": hashlib.sha256(FILE).hexdigest(), "size": len(FILE)}])  # fmt: skip
    assert (client.download_version(spec, tmp_path / "cache") / "1" / "model.onnx").read_bytes() == FILE
    paths = {path for _, path, _ in platform.seen}
    assert paths == {path for _, path in ANSWERS}, paths  # every kind of call was made
    assert {said for _, _, said in platform.seen} == {str(protocol.AGENT_PROTOCOL_VERSION)}, platform.seen


def test_a_426_is_refused_at_once_with_the_platforms_words(platform, tmp_path):
    platform.refuse = True
    client = PlatformClient(platform.url, "hag_x", retries=3)
    with pytest.raises(ProtocolRefused) as refused:
        client.heartbeat({})
    assert len(platform.seen) == 1  # retrying cannot help: no retries
    message = str(refused.value)
    assert f"which speaks agent protocol {protocol.AGENT_PROTOCOL_VERSION} (HTTP 426)" in message
    assert "the platform speaks 2 (accepts 2-2): upgrade the host agent" in message
    with pytest.raises(ProtocolRefused):
        join(platform.url, "hjt_x", tmp_path / "credential")
    assert not (tmp_path / "credential").exists()


def test_a_running_agent_refused_logs_one_error_keeps_asking_slowly_and_takes_no_more_work(
    platform, tmp_path, caplog
):
    """The platform was upgraded past a running agent: its servers keep serving what they have (not stopped),
    it logs the refusal once, heartbeats on and polls only every 30 s."""
    config = AgentConfig(platform=platform.url, root=tmp_path, heartbeat_interval=0.1)
    agent = HostAgent(PlatformClient(platform.url, "hag_x", retries=0), "h", config)
    platform.refuse = True
    caplog.set_level(logging.INFO, logger="hostagent")
    loops = [threading.Thread(target=loop, daemon=True) for loop in (agent._heartbeat_loop, agent._poll_loop)]
    for loop in loops:
        loop.start()
    deadline = time.monotonic() + 10
    while sum(path.endswith("/heartbeat") for _, path, _ in platform.seen) < 4:
        assert time.monotonic() < deadline, platform.seen
        time.sleep(0.05)
    agent._stop.set()
    for loop in loops:
        loop.join(5)
    assert [path for _, path, _ in platform.seen].count("/agent/v1/desired-state") == 1
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1 and errors[0].levelno == logging.ERROR, [r.getMessage() for r in errors]
    assert (
        "upgrade the host agent; this agent takes no more work until it is upgraded" in errors[0].getMessage()
    )
    assert agent.revoked.is_set()
