"""Client errors are 400s: every bad input through the real gateway (HAProxy) to a real tritonserver with the GE
backend answers 400 with Triton's JSON error - also the ones Triton 2.51 itself answers 500 (its HTTP frontend's
parse failures, rewritten by ``apps.gateway.rules.client_error_rules``) - while a model that fails in execute
stays a 500; over gRPC the same inputs are INVALID_ARGUMENT and the failure INTERNAL. The gateway's figures
count the 400s as bad requests (4xx), not as server errors."""

from __future__ import annotations

import gzip
import http.client
import json

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from apps.gateway.metrics import scrape_gateway
from apps.gateway.models import GatewayMetrics, GatewayScrapeState
from apps.registry.models import RegisteredModel
from tests.conftest import wait_for
from tests.monitoring.builders import infer_body, reshaper_version
from tests.support.models import INFER_BODY
from tests.support.servers import deploy, ready_instance, requires_haproxy

pytestmark = [pytest.mark.triton, requires_haproxy, pytest.mark.django_db(transaction=True)]
SCALER = "vision__scaler"  # input [N, 4] FP32, max_batch_size 8: output = input * 2
RESHAPER = "vision__reshaper"  # fails in execute for any width but 1 (tests/monitoring/builders.py)


def tensor(shape=(1, 4), datatype="FP32", data=None, name="input") -> dict:
    count = int(np.prod(shape))
    return {
        "name": name,
        "shape": list(shape),
        "datatype": datatype,
        "data": [1.0] * count if data is None else data,
    }


def body(*inputs, **extra) -> bytes:
    return json.dumps({"inputs": list(inputs), **extra}).encode()


def binary_body(declared_bytes: int) -> tuple[bytes, dict]:
    """A binary-tensor request (the KServe binary extension) whose header declares ``declared_bytes``."""
    header = json.dumps(
        {"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                     "parameters": {"binary_data_size": declared_bytes}}]}
    ).encode()  # fmt: skip
    return header + np.ones((1, 4), np.float32).tobytes(), {
        "Inference-Header-Content-Length": str(len(header)),
        "Content-Type": "application/octet-stream",
    }


# (name, body, extra headers, Triton 2.51's own status straight from the server, a needle of its message)
BAD_INPUTS = [
    ("malformed JSON", b'{"inputs": [', {}, 500, "failed to parse the request JSON buffer"),
    ("bytes after the JSON", INFER_BODY + b"xx", {}, 500, "failed to parse the request JSON buffer"),
    ("no inputs", b'{"outputs": []}', {}, 500, "Unable to parse 'inputs'"),
    ("shape does not match its data", body(tensor(data=[1.0] * 3)), {}, 500, "Unable to parse 'data'"),
    ("datatype does not match its data", body(tensor(data=["a"] * 4)), {}, 500, "Unable to parse 'data'"),
    ("batch past max_batch_size, data short", body(tensor((9, 4), data=[1.0] * 4)), {}, 500, "Unable to parse 'data'"),
    ("a negative dimension", body(tensor((-1, 4), data=[1.0] * 4)), {}, 500, "Unable to parse 'shape'"),
    ("no datatype", body({"name": "input", "shape": [1, 4], "data": [1.0] * 4}), {}, 500, "Unable to parse 'datatype'"),
    ("an id that is not a string", body(tensor(), id=5), {}, 500, "Unable to parse 'id'"),
    ("a parameter of the wrong type", body(tensor(), parameters={"priority": "high"}), {}, 500, "Unable to parse 'priority'"),
    ("classification not a number", body(tensor(), outputs=[{"name": "output", "parameters": {"classification": "x"}}]),
     {}, 500, "Unable to set 'classification'"),
    ("batch past max_batch_size", body(tensor((9, 4))), {}, 400, "batch-size must be <= 8"),
    ("datatype the model does not take", body(tensor(datatype="INT32", data=[1] * 4)), {}, 400, "expects 'FP32'"),
    ("shape the model does not take", body(tensor((1, 5))), {}, 400, "unexpected shape for input 'input'"),
    ("unknown input", body(tensor(), tensor(name="bogus")), {}, 400, "expected 1 inputs but got 2"),
    ("missing input", body(), {}, 400, "missing required input(s) ['input']"),
    ("unknown output", body(tensor(), outputs=[{"name": "nope"}]), {}, 400, "unexpected inference output 'nope'"),
    ("binary data shorter than declared", *binary_body(64), 400, "unexpected size for input 'input'"),
    ("binary data longer than declared", *binary_body(8), 400, "unexpected additional input data"),
]  # fmt: skip


def post(url: str, path: str, data: bytes, headers: dict, token: str | None = None) -> tuple[int, str, str]:
    host, port = url.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=20)
    headers = {"Content-Type": "application/json", **headers}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        connection.request("POST", path, body=data, headers=headers)
        response = connection.getresponse()
        return (
            response.status,
            response.getheader("content-type", ""),
            response.read().decode(errors="replace"),
        )
    finally:
        connection.close()


def post_raw(url: str, path: str, data: bytes, headers: dict, token: str) -> tuple[int, str, bytes]:
    """(status, Content-Encoding, raw body) of a POST through the gateway."""
    host, port = url.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=20)
    try:
        connection.request("POST", path, body=data, headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {token}", **headers})  # fmt: skip
        response = connection.getresponse()
        return response.status, response.getheader("content-encoding", ""), response.read()
    finally:
        connection.close()


def grpc_status(
    url: str, token: str, model: str, shape, datatype="FP32", raw: bytes | None = None, name="input"
):
    """(status code name, details) of a raw ModelInfer through the gateway's gRPC frontend."""
    request = service_pb2.ModelInferRequest(model_name=model)
    item = request.inputs.add()
    item.name, item.datatype = name, datatype
    item.shape.extend(shape)
    request.raw_input_contents.append(raw if raw is not None else np.ones(shape, np.float32).tobytes())
    with grpc.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            stub.ModelInfer(request, metadata=(("authorization", f"Bearer {token}"),), timeout=20)
        except grpc.RpcError as error:
            return error.code().name, error.details()
    return "OK", ""


@pytest.fixture
def served(start_agent, team, owner, owner_client, make_scaler_version, artifact_root, tmp_path):
    """The scaler and the failing reshaper on one real instance; returns the instance."""
    _, instance = ready_instance(start_agent, "errors-a")
    scaler = RegisteredModel.objects.create(team=team, name="Scaler", slug="scaler", created_by=owner)
    make_scaler_version(scaler, 2.0)
    reshaper = RegisteredModel.objects.create(team=team, name="Reshaper", slug="reshaper", created_by=owner)
    reshaper_version(reshaper, owner, tmp_path)
    deployments = {
        SCALER: deploy(owner_client, "vision", "scaler", 1, [instance]),
        RESHAPER: deploy(owner_client, "vision", "reshaper", 1, [instance]),
    }
    return instance, deployments


def test_bad_inputs_answer_400_with_triton_json_error_and_a_failing_model_stays_500(
    served, start_gateway, gateway_env, settings, make_token
):
    instance, deployments = served
    settings.GATEWAY_METRICS_URL = f"http://{gateway_env['GATEWAY_STATS_BIND']}/metrics"
    gateway = start_gateway()
    _, token = make_token(name="errors")
    scaler_path, reshaper_path = (f"/v2/models/{name}/infer" for name in (SCALER, RESHAPER))
    wait_for(lambda: post(gateway.url, scaler_path, INFER_BODY, {}, token)[0] == 200, 20, "the scaler routed")
    wait_for(
        lambda: post(gateway.url, reshaper_path, json.dumps(infer_body(1)).encode(), {}, token)[0] == 200,
        20,
        "the reshaper routed",
    )
    scrape_gateway()  # the baseline: the waits above are not counted below
    GatewayMetrics.objects.all().delete()

    # Straight to Triton first: what it answers itself (the table in docs/users/call.md).
    triton = instance.endpoint_url().removeprefix("http://")
    direct = {}
    for name, data, headers, triton_status, needle in BAD_INPUTS:
        status, _, text = post(triton, scaler_path, data, {**headers, **instance.key_headers()})
        direct[name] = status
        print(f"Triton {status} | {name}: {text[:120]}")
        assert status == triton_status and needle in json.loads(text)["error"], (name, status, text)

    # Through the gateway: every one is a 400 with Triton's own JSON error, as JSON.
    for name, data, headers, _, needle in BAD_INPUTS:
        status, content_type, text = post(gateway.url, scaler_path, data, headers, token)
        print(f"gateway {status} (Triton {direct[name]}) | {name}: {text[:120]}")
        assert status == 400, (name, status, text)
        assert content_type == "application/json", (name, content_type)
        assert needle in json.loads(text)["error"], (name, text)

    # A model that fails in execute stays a 500 (retry), with its error; the model still serves.
    status, content_type, text = post(
        gateway.url, reshaper_path, json.dumps(infer_body(2)).encode(), {}, token
    )
    assert status == 500 and content_type == "application/json", (status, content_type, text)
    assert "model 'vision__reshaper' failed" in json.loads(text)["error"]
    status, _, text = post(gateway.url, scaler_path, INFER_BODY, {}, token)
    assert status == 200 and json.loads(text)["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]

    # gRPC through the gateway's gRPC frontend: Triton's INVALID_ARGUMENT for the same inputs, INTERNAL for the
    # failure, and the well-formed call answers.
    url = gateway.grpc_url
    grpc_cases = {
        "batch past max_batch_size": grpc_status(url, token, SCALER, [9, 4]),
        "datatype": grpc_status(url, token, SCALER, [1, 4], "INT32", np.ones((1, 4), np.int32).tobytes()),
        "shape": grpc_status(url, token, SCALER, [1, 5]),
        "unknown input": grpc_status(url, token, SCALER, [1, 4], name="bogus"),
        "raw data size": grpc_status(url, token, SCALER, [1, 4], raw=b"\0" * 12),
        "unknown datatype": grpc_status(url, token, SCALER, [1, 4], "FP99"),
    }
    print("gRPC:", grpc_cases)
    assert {code for code, _ in grpc_cases.values()} == {"INVALID_ARGUMENT"}, grpc_cases
    assert "batch-size must be <= 8" in grpc_cases["batch past max_batch_size"][1]
    assert "input byte size mismatch" in grpc_cases["raw data size"][1]
    code, details = grpc_status(url, token, RESHAPER, [1, 2])
    assert code == "INTERNAL" and "model 'vision__reshaper' failed" in details, (code, details)
    assert grpc_status(url, token, SCALER, [1, 4]) == ("OK", "")
    client = grpcclient.InferenceServerClient(url)
    try:
        item = grpcclient.InferInput("input", [1, 5], "FP32")
        item.set_data_from_numpy(np.ones((1, 5), np.float32))
        with pytest.raises(InferenceServerException) as caught:
            client.infer(SCALER, [item], headers={"authorization": f"Bearer {token}"}, client_timeout=20)
        assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    finally:
        client.close()

    # The gateway's figures: the 400s are bad requests (4xx), only the failure is a server error (5xx).
    scrape_gateway()
    assert GatewayScrapeState.objects.get().last_error == ""
    scaler_row = GatewayMetrics.objects.get(deployment=deployments[SCALER])
    http_400 = len(BAD_INPUTS)
    grpc_invalid = len(grpc_cases) + 1  # and tritonclient's call
    # gRPC answers travel as HTTP 200 (the status is in the trailers): in 2xx, and in the 400s by their status.
    assert (scaler_row.responses_4xx, scaler_row.responses_5xx) == (http_400, 0)
    assert scaler_row.responses_2xx == 1 + grpc_invalid + 1
    assert scaler_row.responses_400 == http_400 + grpc_invalid
    reshaper_row = GatewayMetrics.objects.get(deployment=deployments[RESHAPER])
    assert (reshaper_row.responses_5xx, reshaper_row.responses_4xx, reshaper_row.responses_400) == (1, 0, 0)
    wide = GatewayMetrics.objects.get(deployment=None)
    assert (wide.responses_400, wide.responses_5xx) == (http_400 + grpc_invalid, 1)


HUGE = 2**40  # one request with this many elements announced aborted tritonserver 2.51 (std::bad_alloc)


def huge_shape_cases() -> list[tuple[str, bytes, dict]]:
    """Requests announcing more elements than they hold - in the ways a client could hide the shape."""
    plain = body(tensor((1, HUGE), data=[0.5]))
    padded = body(tensor((1, HUGE), data=[0.5]), id="x" * 100_000)  # the shape 100 kB in: another chunk
    escaped = b'{"inputs":[{"name":"input","\\u0073hape":[1,%d],"datatype":"FP32","data":[0.5]}]}' % HUGE
    spaced = (
        b'{"inputs":[{"name":"input","shape"'
        + b" " * 40
        + b':[1,%d],"datatype":"FP32","data":[0.5]}]}' % HUGE
    )
    two = body(
        tensor((1, 40_000), data=[0.5]), tensor((1, 40_000), data=[0.5], name="second"), id="y" * 50_000
    )
    header = json.dumps({"inputs": [{"name": "input", "shape": [1, HUGE], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 16}}]}).encode()  # fmt: skip
    binary = (header + b"\0" * 16, {"Inference-Header-Content-Length": str(len(header))})
    return [
        ("a huge shape", plain, {}),
        ("a huge shape after 100 kB", padded, {}),
        ("a huge shape under an escaped key", escaped, {}),
        ("a huge shape after spaces", spaced, {}),
        ("two shapes together more than the body", two, {}),
        ("a huge shape in a binary request's header", *binary),
    ]


def test_a_shape_announcing_more_than_its_request_holds_is_refused_before_triton_sizes_it(
    served, start_gateway, make_token
):
    """Straight to Triton, the first case aborts the server (every model on the instance); through the gateway
    each is a 400 naming the reason, the instance keeps its process, and well-formed requests - large JSON with
    the shape far in, "shape" as a value, binary tensors - still answer."""
    instance, _ = served
    gateway = start_gateway()
    _, token = make_token(name="shapes")
    path = f"/v2/models/{SCALER}/infer"
    wait_for(lambda: post(gateway.url, path, INFER_BODY, {}, token)[0] == 200, 20, "the scaler routed")
    pid = type(instance).objects.get(pk=instance.pk).pid
    for name, data, headers in huge_shape_cases():
        status, content_type, text = post(gateway.url, path, data, headers, token)
        assert status == 400 and content_type == "application/json", (name, status, text)
        assert json.loads(text)["error"].startswith("a tensor shape was refused before the model read it"), (
            text
        )
    four = tensor(data=[1.0, 2.0, 3.0, 4.0])
    padded_ok = body(four, id="z" * 100_000)
    value_not_key = body(four, id='"shape":[1099511627776]')
    ok_binary, ok_headers = binary_body(16)
    wanted = [2.0, 4.0, 6.0, 8.0]
    for name, data, headers, output in (("padded", padded_ok, {}, wanted), ("value", value_not_key, {}, wanted),
                                        ("binary", ok_binary, ok_headers, [2.0] * 4)):  # fmt: skip
        status, _, text = post(gateway.url, path, data, headers, token)
        assert status == 200 and json.loads(text)["outputs"][0]["data"] == output, (name, text)
    # A compressed body would hide its shapes (Triton inflates before it sizes them): refused, saying why;
    # a compressed answer is still fine.
    status, _, text = post(gateway.url, path, gzip.compress(INFER_BODY), {"Content-Encoding": "gzip"}, token)
    assert status == 415 and "send the request uncompressed" in json.loads(text)["error"], (status, text)
    status, encoding, raw = post_raw(gateway.url, path, INFER_BODY, {"Accept-Encoding": "gzip"}, token)
    answer = json.loads(gzip.decompress(raw) if encoding == "gzip" else raw)
    assert status == 200 and answer["outputs"][0]["data"] == wanted, (status, encoding)
    assert type(instance).objects.get(pk=instance.pk).pid == pid  # the server never restarted
