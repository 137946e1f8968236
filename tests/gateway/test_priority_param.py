"""priority.lua with real HAProxy in front of a server that records what it received: the level lands in the
request's top-level parameters (or a new one), byte lengths stay right for JSON and binary requests of any
size, whatever the chunking, and a key hidden behind an escape is refused."""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from apps.gateway.rules import PRIORITY_LUA_FILE, priority_body_rules, shape_response_rules
from backend_ge.runtime import free_port
from tests.support.servers import requires_haproxy

pytestmark = [requires_haproxy, pytest.mark.servers]


class Recorder(BaseHTTPRequestHandler):
    received: list[tuple[dict, bytes]] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["content-length"]))
        Recorder.received.append(({k.lower(): v for k, v in self.headers.items()}, body))
        try:
            json.loads(body[: int(self.headers.get("inference-header-content-length") or len(body))])
            status, answer = 200, b'{"ok":true}'
        except ValueError:
            status, answer = 500, b'{"error":"failed to parse the request JSON buffer: x"}'
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    directory = tmp_path_factory.mktemp("priority")
    recorder = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=recorder.serve_forever, daemon=True).start()
    port = free_port()
    config = "\n".join(
        [
            "global",
            f"    lua-load '{PRIORITY_LUA_FILE}'",
            "    tune.bufsize 16384",
            "defaults",
            "    mode http",
            "    timeout connect 2s",
            "    timeout client 20s",
            "    timeout server 20s",
            "frontend inference",
            f"    bind 127.0.0.1:{port}",
            "    option http-buffer-request",
            "    filter lua.priority_param",
            "    http-request set-var(txn.jlen) req.hdr(inference-header-content-length)",
            # In the gateway the level comes from the route and the caller's class; here from the test.
            "    http-request set-var(txn.plevel) req.hdr(x-level) if { req.hdr(x-level) -m found }",
            *priority_body_rules(),
            *shape_response_rules(before_counts=True),
            *shape_response_rules(before_counts=False),
            "    default_backend recorder",
            "backend recorder",
            f"    server r 127.0.0.1:{recorder.server_address[1]}",
            "",
        ]
    )
    (directory / "haproxy.cfg").write_text(config)
    process = subprocess.Popen(["haproxy", "-db", "-f", str(directory / "haproxy.cfg")])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            http.client.HTTPConnection("127.0.0.1", port, timeout=1).connect()
            break
        except OSError:
            time.sleep(0.05)
    yield port
    process.terminate()
    process.wait(10)
    recorder.shutdown()


def send(port: int, body: bytes, level: str | None, headers: dict | None = None, chunks: int = 1):
    """POST ``body`` (in ``chunks`` writes, with pauses, so HAProxy sees it in pieces); returns the status,
    the answer and what the server received."""
    Recorder.received.clear()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    connection.putrequest("POST", "/v2/models/m/infer")
    all_headers = {"content-length": str(len(body)), "content-type": "application/json", **(headers or {})}
    if level is not None:
        all_headers["x-level"] = level
    for name, value in all_headers.items():
        connection.putheader(name, value)
    connection.endheaders()
    size = -(-len(body) // chunks)
    for i in range(0, len(body), size):
        connection.send(body[i : i + size])
        if chunks > 1:
            time.sleep(0.02)
    response = connection.getresponse()
    answer = response.read()
    connection.close()
    return response.status, answer, (Recorder.received[-1] if Recorder.received else None)


def received_json(received) -> tuple[dict, bytes]:
    headers, body = received
    assert int(headers["content-length"]) == len(body)
    length = int(headers.get("inference-header-content-length") or len(body))
    return json.loads(body[:length]), body[length:]


def request(**extra) -> dict:
    return {"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}], **extra}


@pytest.mark.parametrize("chunks", [1, 7])
@pytest.mark.parametrize(
    "sent, expected_parameters",
    [
        (request(), {"priority": 2}),
        (request(parameters={}), {"priority": 2}),
        (request(parameters={"binary_data_output": True}), {"priority": 2, "binary_data_output": True}),
        # Its own priority comes after the gateway's: Triton reads the first of duplicate members.
        (request(parameters={"priority": 1, "sequence_id": 5}), {"priority": 1, "sequence_id": 5}),
        (
            {"id": "parameters", "inputs": request()["inputs"], "parameters": {"a": "}"}},
            {"priority": 2, "a": "}"},
        ),
    ],
)
def test_the_level_is_the_first_member_of_the_top_level_parameters(proxy, sent, expected_parameters, chunks):
    body = json.dumps(sent).encode()
    status, _, received = send(proxy, body, "2", chunks=chunks)
    assert status == 200
    got, rest = received_json(received)
    assert rest == b""
    assert got["parameters"] == expected_parameters
    assert got["inputs"] == sent["inputs"]
    raw = received[1].decode()
    assert raw.count('"priority":2') == 1
    # The gateway's member is the first of the object, so a caller's own "priority" cannot win.
    assert re.search(r'"parameters": ?\{"priority":2[ ,}]', raw), raw


def test_a_large_json_request_keeps_every_byte(proxy):
    data = [float(i) for i in range(120_000)]  # ~1 MB of JSON, far beyond the 16 KiB buffer
    sent = request(inputs=[{"name": "input", "shape": [1, len(data)], "datatype": "FP32", "data": data}])
    status, _, received = send(proxy, json.dumps(sent).encode(), "3", chunks=40)
    assert status == 200
    got, _ = received_json(received)
    assert got["inputs"][0]["data"] == data
    assert got["parameters"] == {"priority": 3}


@pytest.mark.parametrize("binary_bytes", [16, 300_000])
def test_a_binary_request_gets_the_level_in_its_json_header_and_its_data_unchanged(proxy, binary_bytes):
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "shape": [1, binary_bytes // 4],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": binary_bytes},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    data = bytes(range(256)) * (binary_bytes // 256) + bytes(binary_bytes % 256)
    status, _, received = send(
        proxy, header + data, "1", headers={"inference-header-content-length": str(len(header))}, chunks=5
    )
    assert status == 200
    got, rest = received_json(received)
    assert got["parameters"] == {"priority": 1, "binary_data_output": True}
    assert rest == data
    assert int(received[0]["inference-header-content-length"]) == len(header) + 27 + 1


def test_without_a_level_nothing_changes(proxy):
    body = json.dumps(request(parameters={"priority": 7})).encode()
    status, _, received = send(proxy, body, None)
    assert status == 200
    assert received[1] == body


@pytest.mark.parametrize("body", [b"[1, 2, 3]", b"not json", b'{"inputs": [', b"{}"])
def test_a_body_that_is_no_request_keeps_its_length_consistent(proxy, body):
    status, _, received = send(proxy, body, "2")
    headers, got = received
    assert int(headers["content-length"]) == len(got) == len(body) + 28
    if body == b"{}":
        assert json.loads(got) == {"parameters": {"priority": 2}}
    elif body.startswith(b"["):
        assert got == body + b" " * 28  # no object to put it in: spaces after the JSON
    else:
        assert status == 500  # the recorder, like Triton, cannot parse it


def test_a_top_level_key_spelled_with_an_escape_is_refused(proxy):
    body = b'{"inputs": [], "param\\u0065ters": {"priority": 1}}'
    status, answer, _ = send(proxy, body, "2")
    assert status == 400
    assert json.loads(answer)["error"] == (
        "the request was refused before the model read it: a top-level key is spelled with an escape"
    )
