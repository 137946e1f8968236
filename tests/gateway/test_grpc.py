"""gRPC through the gateway on a shared instance: the gateway reads the model name from the whole protobuf message
(apps/gateway/grpc.lua) and applies the HTTP gateway's tenancy to it. One live test (real HAProxy and
tritonserver) covers the seed's BERT and MLP over tritonclient.grpc, tokens, another team's model under every
message type, and crafted bodies sent raw."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import grpc
import numpy as np
import onnxruntime
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from apps.registry.models import RegisteredModel
from apps.teams import services as team_services
from backend_ge import samples
from backend_ge.config import ModelSignature
from backend_ge.examples import build_bert, build_mlp
from tests.conftest import wait_for
from tests.factories import ready_onnx_version
from tests.support.models import wide_scaler_onnx
from tests.support.servers import deploy, ready_instance, requires_haproxy

pytestmark = [pytest.mark.triton, requires_haproxy, pytest.mark.django_db(transaction=True)]
SERVICE = "/inference.GRPCInferenceService/"
LIMIT = 4 * 2**20  # this module's gateway forwards gRPC messages up to 4 MiB
WIDE = 262_144  # floats in a row of the wide scaler: a 1 MiB tensor


@pytest.fixture(autouse=True)
def _grpc_message_limit(gateway_env):
    gateway_env["GATEWAY_GRPC_MAX_MESSAGE_BYTES"] = str(LIMIT)


def auth(token: str) -> dict:
    # tritonclient.grpc refuses a header named "Authorization"; gRPC metadata keys are lower case.
    return {"authorization": f"Bearer {token}"}


def grpc_error(url: str, model: str, token: str) -> InferenceServerException:
    """The error of a gRPC inference (an [1, 4] FP32 input) through the gateway."""
    client = grpcclient.InferenceServerClient(url)
    item = grpcclient.InferInput("input", [1, 4], "FP32")
    item.set_data_from_numpy(np.ones((1, 4), np.float32))
    try:
        with pytest.raises(InferenceServerException) as caught:
            client.infer(model, [item], headers=auth(token), client_timeout=10)
    finally:
        client.close()
    return caught.value


def status_of(call) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value.status(), caught.value.message()


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number: int, value: bytes) -> bytes:
    """A length-delimited protobuf field (field numbers below 16 here)."""
    return bytes([number << 3 | 2]) + varint(len(value)) + value


def raw_call(url: str, method: str, body: bytes, token: str, **options) -> tuple[grpc.StatusCode, str]:
    """One unary call with a hand-made message body (no serializer: the bytes go out as they are)."""
    with grpc.insecure_channel(url) as channel:
        call = channel.unary_unary(SERVICE + method)
        try:
            call(body, metadata=(("authorization", f"Bearer {token}"),), timeout=10, **options)
        except grpc.RpcError as error:
            return error.code(), error.details()
    return grpc.StatusCode.OK, ""


def test_grpc_tenancy_on_a_shared_instance(
    owner_client, outsider_client, owner, outsider, team, other_team, start_agent, make_scaler_version,
    start_gateway, make_token, artifact_root, tmp_path,
):  # fmt: skip
    _, shared = ready_instance(start_agent, "shared-a")
    bert_onnx, mlp_onnx = build_bert(layers=1), build_mlp()
    for slug, onnx_model in (("bert", bert_onnx), ("mlp", mlp_onnx)):
        model = RegisteredModel.objects.create(team=team, name=slug, slug=slug, created_by=owner)
        mlp_version = ready_onnx_version(model, onnx_model.SerializeToString(), tmp_path)
        deploy(owner_client, "vision", slug, 1, [shared])
    speech = RegisteredModel.objects.create(
        team=other_team, name="Scaler", slug="scaler", created_by=outsider
    )
    make_scaler_version(speech, 3.0)
    deploy(outsider_client, "speech", "scaler", 1, [shared])
    gateway = start_gateway()
    token_row, token = make_token(name="grpc")
    _, speech_token = team_services.create_token(actor=outsider, team=other_team, name="grpc")
    client = grpcclient.InferenceServerClient(gateway.grpc_url)

    # The seed's BERT (two INT32 inputs) and the MLP, unversioned (the gateway pins them) and versioned.
    ids = np.random.default_rng(1).integers(0, 30000, (1, 128)).astype(np.int32)
    mask = np.ones((1, 128), np.int32)
    inputs = [grpcclient.InferInput("input_ids", [1, 128], "INT32"),
              grpcclient.InferInput("attention_mask", [1, 128], "INT32")]  # fmt: skip
    inputs[0].set_data_from_numpy(ids)
    inputs[1].set_data_from_numpy(mask)

    def bert():
        try:
            return client.infer("vision__bert", inputs, headers=auth(token), client_timeout=20)
        except InferenceServerException:
            return None

    result = wait_for(bert, 30, f"BERT over gRPC through the gateway\n{gateway.output()}")
    expected = onnxruntime.InferenceSession(bert_onnx.SerializeToString()).run(
        None, {"input_ids": ids, "attention_mask": mask}
    )[0]
    np.testing.assert_allclose(result.as_numpy("pooled_output"), expected, rtol=1e-4, atol=1e-5)
    vector = np.random.default_rng(2).standard_normal((1, 256)).astype(np.float32)
    mlp_input = grpcclient.InferInput("input", [1, 256], "FP32")
    mlp_input.set_data_from_numpy(vector)
    result = client.infer("vision__mlp", [mlp_input], model_version="1", headers=auth(token))
    expected = onnxruntime.InferenceSession(mlp_onnx.SerializeToString()).run(None, {"input": vector})[0]
    np.testing.assert_allclose(result.as_numpy("output"), expected, rtol=1e-4, atol=1e-5)
    assert client.get_model_metadata("vision__mlp", headers=auth(token)).name == "vision__mlp"
    assert client.is_model_ready("vision__mlp", headers=auth(token))
    assert client.get_model_config("vision__mlp", headers=auth(token)).config.name == "vision__mlp"
    assert client.get_inference_statistics("vision__mlp", headers=auth(token)).model_stats
    assert client.is_server_live(headers=auth(token))

    # The deployment page's gRPC script runs as it is against the gateway.
    script = samples.tritonclient_example(
        gateway.grpc_url, "vision__mlp", ModelSignature.from_dict(mlp_version.signature), auth=True, grpc=True
    )
    with mock.patch.dict(os.environ, {samples.TOKEN_ENV: token}):
        exec(compile(script, "snippet", "exec"), {})  # noqa: S102 - the platform's own snippet

    # Another team's model on the same instance is the same NOT_FOUND as a missing one, for every message type.
    scaler = grpcclient.InferInput("input", [1, 4], "FP32")
    scaler.set_data_from_numpy(np.ones((1, 4), np.float32))
    for name in ("speech__scaler", "vision__missing"):
        for call in (
            lambda name=name: client.infer(name, [scaler], headers=auth(token)),
            lambda name=name: client.get_model_metadata(name, headers=auth(token)),
            lambda name=name: client.get_model_config(name, headers=auth(token)),
            lambda name=name: client.get_inference_statistics(name, headers=auth(token)),
            lambda name=name: client.is_model_ready(name, headers=auth(token)),
        ):
            assert status_of(call) == (
                "StatusCode.NOT_FOUND",
                f"Request for unknown model: '{name}' is not found",
            )
    assert client.infer("speech__scaler", [scaler], headers=auth(speech_token)).as_numpy(
        "output"
    ).tolist() == [[3.0] * 4]

    # Statistics of every model, the repository, and streams on a shared instance stay closed.
    assert (
        status_of(lambda: client.get_inference_statistics(headers=auth(token)))[0]
        == "StatusCode.INVALID_ARGUMENT"
    )
    assert (
        status_of(lambda: client.unload_model("speech__scaler", headers=auth(token)))[0]
        == "StatusCode.UNIMPLEMENTED"
    )
    with grpc.insecure_channel(gateway.grpc_url) as channel:
        stream = channel.stream_stream(SERVICE + "ModelStreamInfer")(
            iter([field(1, b"vision__mlp")]), metadata=(("authorization", f"Bearer {token}"),), timeout=10
        )
        with pytest.raises(grpc.RpcError) as caught:
            list(stream)
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "dedicated to your team" in caught.value.details()

    # Crafted bodies: never forwarded, INVALID_ARGUMENT with the reason.
    own, other = field(1, b"vision__mlp"), field(1, b"speech__scaler")
    crafted = {
        own + other: "names model_name more than once",  # protobuf would run the last one
        own + field(2, b"1") + field(2, b"1"): "names model_version more than once",
        own + b"\x18\xff\xff": "truncated varint",
        own + b"\x3a\x50abc": "length runs past the end",
        b"\x0a\x90": "length runs past the end",
        own + field(2, b"01"): "not a version number",
        field(1, b"x" * 129): "longer than 128",
        field(1, b"vision mlp"): "may hold only",
        b"": "must name a model",
        own + field(2, b""): "not a version number",  # an empty version would undo the gateway's pin
        field(7, b"\0" * 20000) + own: "must name a model (model_name) before its tensor data",
    }
    for body, reason in crafted.items():
        code, details = raw_call(gateway.grpc_url, "ModelInfer", body, token)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and reason in details, (body[:40], code, details)
    # (grpcio leaves a message uncompressed when compressing does not make it smaller.)
    compressible = own + field(7, b"\0" * 1000)
    code, details = raw_call(
        gateway.grpc_url, "ModelInfer", compressible, token, compression=grpc.Compression.Gzip
    )
    assert (code, "compressed" in details) == (grpc.StatusCode.INVALID_ARGUMENT, True)
    assert raw_call(gateway.grpc_url, "ModelReady", own, token)[0] == grpc.StatusCode.OK

    # The repository, shared-memory, trace and logging services stay closed (before any token check).
    for method in ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload", "SystemSharedMemoryStatus",
                   "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister", "CudaSharedMemoryStatus",
                   "CudaSharedMemoryRegister", "TraceSetting", "LogSettings"):  # fmt: skip
        code, details = raw_call(gateway.grpc_url, method, own, token)
        assert (code, details) == (
            grpc.StatusCode.UNIMPLEMENTED,
            "this gRPC method is not offered by the gateway",
        )

    # Tokens on every message type: none, a wrong one, and (after revocation) a revoked one are
    # UNAUTHENTICATED; another team's token gets this team's model as the same NOT_FOUND as an unknown one.
    model_calls = {
        "ModelInfer": lambda h: client.infer("vision__mlp", [mlp_input], headers=h),
        "ModelMetadata": lambda h: client.get_model_metadata("vision__mlp", headers=h),
        "ModelConfig": lambda h: client.get_model_config("vision__mlp", headers=h),
        "ModelStatistics": lambda h: client.get_inference_statistics("vision__mlp", headers=h),
        "ModelReady": lambda h: client.is_model_ready("vision__mlp", headers=h),
    }
    every_call = {
        **model_calls,
        "ServerLive": lambda h: client.is_server_live(headers=h),
        "ServerReady": lambda h: client.is_server_ready(headers=h),
        "ServerMetadata": lambda h: client.get_server_metadata(headers=h),
    }
    for method, call in every_call.items():
        for headers in (None, auth("tgp_0_wrong"), {"authorization": "Basic dmlzaW9u"}):
            assert status_of(lambda c=call, h=headers: c(h))[0] == "StatusCode.UNAUTHENTICATED", (
                method,
                headers,
            )
    for method, call in model_calls.items():
        assert status_of(lambda c=call: c(auth(speech_token))) == (
            "StatusCode.NOT_FOUND",
            "Request for unknown model: 'vision__mlp' is not found",
        ), method
    team_services.revoke_token(actor=owner, token=token_row)
    wait_for(
        lambda: raw_call(gateway.grpc_url, "ModelReady", own, token)[0] == grpc.StatusCode.UNAUTHENTICATED,
        15,
        "the revoked token to be refused",
    )
    for method, call in every_call.items():
        assert status_of(lambda c=call: c(auth(token)))[0] == "StatusCode.UNAUTHENTICATED", method
    client.close()


def inferences(instance, model: str) -> int:
    """Requests ``model`` has run on ``instance`` (Triton's statistics, asked with the instance key)."""
    client = httpclient.InferenceServerClient(f"127.0.0.1:{instance.http_port}")
    try:
        stats = client.get_inference_statistics(model, headers=instance.key_headers())
    finally:
        client.close()
    return sum(int(s["inference_stats"]["success"]["count"]) for s in stats["model_stats"])


def rss_kib(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    return {
        k: int(v.split()[0])
        for k, v in (line.split(":", 1) for line in status.splitlines())
        if k in ("VmRSS", "VmHWM")
    }


def test_grpc_messages_of_mib_stream_through_and_larger_ones_are_refused(
    owner_client, outsider_client, owner, outsider, team, other_team, start_agent, make_scaler_version,
    start_gateway, make_token, artifact_root, tmp_path,
):  # fmt: skip
    _, shared = ready_instance(start_agent, "shared-a")
    wide = RegisteredModel.objects.create(team=team, name="Wide", slug="wide", created_by=owner)
    ready_onnx_version(wide, wide_scaler_onnx(WIDE), tmp_path)
    deploy(owner_client, "vision", "wide", 1, [shared])
    speech = RegisteredModel.objects.create(
        team=other_team, name="Scaler", slug="scaler", created_by=outsider
    )
    make_scaler_version(speech, 3.0)
    deploy(outsider_client, "speech", "scaler", 1, [shared])
    gateway = start_gateway()
    _, token = make_token(name="grpc")
    client = grpcclient.InferenceServerClient(gateway.grpc_url)

    def infer(rows: int):
        data = np.random.default_rng(rows).standard_normal((rows, WIDE)).astype(np.float32)
        item = grpcclient.InferInput("input", list(data.shape), "FP32")
        item.set_data_from_numpy(data)
        return data, client.infer("vision__wide", [item], headers=auth(token), client_timeout=60)

    def first_answer():
        try:
            return infer(1)
        except InferenceServerException:
            return None

    # A 1 MiB tensor (and a 3 MiB batch) through the gateway: walked as it streams, answered as sent.
    data, result = wait_for(first_answer, 30, f"a 1 MiB tensor over gRPC\n{gateway.output()}")
    np.testing.assert_allclose(result.as_numpy("output"), data * 2.0, rtol=1e-6)
    data, result = infer(3)
    np.testing.assert_allclose(result.as_numpy("output"), data * 2.0, rtol=1e-6)

    # The gateway's memory follows its buffers, not the messages: 8 concurrent 1 MiB calls, 40 MiB in all.
    worker = gateway.admin().worker_pid()
    before = rss_kib(worker)
    with ThreadPoolExecutor(8) as pool:
        outputs = list(pool.map(lambda _: infer(1)[1].as_numpy("output").shape, range(40)))
    after = rss_kib(worker)
    print(f"HAProxy worker RSS {before['VmRSS']} KiB before, {after['VmRSS']} KiB after 40 x 1 MiB over gRPC "
          f"(8 concurrent); peak {after['VmHWM']} KiB")  # fmt: skip
    assert outputs == [(1, WIDE)] * 40
    assert after["VmHWM"] - before["VmRSS"] < 24 * 1024, (before, after)

    # Above the limit: RESOURCE_EXHAUSTED naming it (after the gateway read the upload, so grpcio reports it).
    with pytest.raises(InferenceServerException) as caught:
        infer(5)
    assert caught.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert f"larger than the {LIMIT} bytes (4.0 MiB) the gateway accepts" in caught.value.message()
    assert "GATEWAY_GRPC_MAX_MESSAGE_BYTES" in caught.value.message()

    # Past the head the walk goes on: a name, a version or a malformed field after the tensor data aborts the
    # call before the message's last byte reaches the instance - protobuf's last model_name never runs.
    own, other, tensor = field(1, b"vision__wide"), field(1, b"speech__scaler"), field(7, b"\0" * 200_000)
    ran = inferences(shared, "speech__scaler")
    for body in (
        own + tensor + other,
        own + tensor + field(2, b"1"),
        own + tensor + tensor + other,
        own + tensor + b"\x18\xff\xff",
        own + tensor + b"\x3a\x50abc",
    ):
        code, details = raw_call(gateway.grpc_url, "ModelInfer", body, token)
        print(f"aborted past the head: {code} {details}")
        # The refused field's key is made one no parser accepts: the instance refuses the whole message.
        assert code == grpc.StatusCode.INTERNAL and "Unable to parse request" in details, (code, details)
    assert inferences(shared, "speech__scaler") == ran
    # Each refused call ended on both sides: no stream to the instance is left waiting for the server timeout.
    wait_for(
        lambda: " be=gs" not in gateway.admin().ask("show sess"),
        10,
        f"the refused calls' streams to the instance to end\n{gateway.admin().ask('show sess')}",
    )
    # The same call, well formed, is the owner's model's (and Triton's own complaint about the made-up input).
    code, details = raw_call(gateway.grpc_url, "ModelInfer", own + tensor, token)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "missing required input" in details, (code, details)
    client.close()
