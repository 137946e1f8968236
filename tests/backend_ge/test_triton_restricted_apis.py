"""Triton's control surfaces need the instance key, over HTTP and gRPC, on a real tritonserver.

Logging, trace, shared memory, model repository and model config are restricted; health, inference,
metadata and statistics stay open (the gateway closes those later). Triton answers a missing key with
HTTP 403 and gRPC UNAVAILABLE ("This protocol is restricted").
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from backend_ge.runtime import (
    API_KEY_HEADER,
    DEFAULT_OPEN_APIS,
    GRPC_API_KEY_HEADER,
    TRITON_APIS,
    TritonServer,
)
from tests.conftest import wait_for

pytestmark = pytest.mark.triton

# (method, path, body): one call per restricted group; the mutating ones must not be applied either.
RESTRICTED_HTTP = [
    ("GET", "/v2/logging", None),
    ("POST", "/v2/logging", {"log_verbose_level": 3}),
    ("GET", "/v2/trace/setting", None),
    ("POST", "/v2/trace/setting", {"trace_level": ["TIMESTAMPS"]}),
    ("GET", "/v2/models/mlp/trace/setting", None),
    ("GET", "/v2/systemsharedmemory/status", None),
    ("POST", "/v2/systemsharedmemory/region/r/register", {"key": "/r", "offset": 0, "byte_size": 8}),
    ("POST", "/v2/systemsharedmemory/unregister", None),
    ("GET", "/v2/cudasharedmemory/status", None),
    ("POST", "/v2/repository/index", {}),
    ("POST", "/v2/repository/models/mlp/unload", {}),
    ("GET", "/v2/models/mlp/config", None),
]


def http_call(server: TritonServer, method: str, path: str, body=None, headers=None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://{server.http_url}{path}", data=data, method=method)
    for name, value in (headers or {}).items():
        req.add_header(name, value)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.parametrize(
    ("method", "path", "body"), RESTRICTED_HTTP, ids=[f"{m} {p}" for m, p, _ in RESTRICTED_HTTP]
)
def test_control_apis_refuse_http_requests_without_the_instance_key(triton, method, path, body):
    status, reply = http_call(triton, method, path, body)
    assert status == 403, reply
    assert API_KEY_HEADER.encode() in reply
    status, _ = http_call(triton, method, path, body, {API_KEY_HEADER: "not-the-key"})
    assert status == 403


@pytest.mark.parametrize(
    "path", ["/v2/logging", "/v2/trace/setting", "/v2/systemsharedmemory/status", "/v2/cudasharedmemory/status",
             "/v2/models/mlp/config"],
)  # fmt: skip
def test_control_apis_answer_http_requests_with_the_instance_key(triton, path):
    status, reply = http_call(triton, "GET", path, headers=triton.key_headers())
    assert status == 200, reply


def test_logging_settings_do_not_change_without_the_key(triton):
    before = json.loads(http_call(triton, "GET", "/v2/logging", headers=triton.key_headers())[1])
    assert http_call(triton, "POST", "/v2/logging", {"log_verbose_level": 3})[0] == 403
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    try:
        with pytest.raises(InferenceServerException):
            client.update_log_settings({"log_verbose_level": 3})
    finally:
        client.close()
    after = json.loads(http_call(triton, "GET", "/v2/logging", headers=triton.key_headers())[1])
    assert after == before and after["log_verbose_level"] == 0


GRPC_CALLS = {
    "logging": lambda c, **kw: c.get_log_settings(**kw),
    "logging-update": lambda c, **kw: c.update_log_settings({"log_verbose_level": 0}, **kw),
    "trace": lambda c, **kw: c.get_trace_settings(**kw),
    "shared-memory": lambda c, **kw: c.get_system_shared_memory_status(**kw),
    "cuda-shared-memory": lambda c, **kw: c.get_cuda_shared_memory_status(**kw),
    "model-repository": lambda c, **kw: c.get_model_repository_index(**kw),
    "model-config": lambda c, **kw: c.get_model_config("mlp", **kw),
}


@pytest.mark.parametrize("call", sorted(GRPC_CALLS))
def test_control_apis_refuse_grpc_requests_without_the_instance_key(triton, call):
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as refused:
            GRPC_CALLS[call](client)
        assert refused.value.status() == "StatusCode.UNAVAILABLE"
        assert GRPC_API_KEY_HEADER in refused.value.message()
        # The HTTP header name is not what Triton reads over gRPC.
        with pytest.raises(InferenceServerException):
            GRPC_CALLS[call](client, headers={API_KEY_HEADER: triton.api_key})
        GRPC_CALLS[call](client, headers=triton.key_headers("grpc"))
    finally:
        client.close()


def test_inference_metadata_statistics_and_health_stay_open(triton):
    http = httpclient.InferenceServerClient(triton.http_url)
    grpc = grpcclient.InferenceServerClient(triton.grpc_url)
    try:
        assert http.is_server_live() and grpc.is_server_live()
        assert http.get_model_metadata("mlp")["name"] == "mlp"
        assert grpc.get_model_metadata("mlp").name == "mlp"
        assert http.get_inference_statistics("mlp")["model_stats"]
        assert grpc.get_inference_statistics("mlp").model_stats
        item = httpclient.InferInput("input", [1, 256], "FP32")
        item.set_data_from_numpy(np.ones((1, 256), np.float32))
        assert http.infer("mlp", [item]).as_numpy("output").shape == (1, 16)
        gitem = grpcclient.InferInput("input", [1, 256], "FP32")
        gitem.set_data_from_numpy(np.ones((1, 256), np.float32))
        assert grpc.infer("mlp", [gitem]).as_numpy("output").shape == (1, 16)
    finally:
        http.close()
        grpc.close()


def test_the_runtime_loads_and_unloads_with_its_key(triton):
    assert not triton.is_model_ready("mlp_slow")
    triton.load_model("mlp_slow")
    try:
        assert triton.is_model_ready("mlp_slow")
        assert any(m["name"] == "mlp_slow" and m.get("state") == "READY" for m in triton.repository_index())
    finally:
        triton.unload_model("mlp_slow")
    # Unloading finishes in the background; the shared server is ready again (strict readiness) after it.
    wait_for(lambda: triton.is_ready(), timeout=30)
    assert not triton.is_model_ready("mlp_slow")


def test_every_api_group_but_the_open_ones_is_restricted_on_the_command_line(tmp_path):
    server = TritonServer(tmp_path, workdir=tmp_path / "w", api_key="k3y", open_apis=("health",))
    args = server.command(tmp_path / "backends")
    restricted = ",".join(api for api in TRITON_APIS if api != "health")
    assert f"--http-restricted-api={restricted}:{API_KEY_HEADER}=k3y" in args
    assert f"--grpc-restricted-protocol={restricted}:{API_KEY_HEADER}=k3y" in args
    default = TritonServer(tmp_path, workdir=tmp_path / "w").restricted_apis
    assert set(default) == set(TRITON_APIS) - set(DEFAULT_OPEN_APIS)
    assert {"logging", "trace", "shared-memory", "model-repository", "model-config"} == set(default)
    with pytest.raises(ValueError, match="unknown Triton API group"):
        TritonServer(tmp_path, workdir=tmp_path / "w", open_apis=("health", "everything"))


def test_a_server_inherits_only_an_allow_list_of_the_environment(tmp_path):
    from backend_ge.runtime import TritonRuntime, server_environment

    runtime = TritonRuntime(tmp_path / "runtime")
    env = server_environment(
        runtime,
        {
            "PATH": "/usr/bin",
            "DATABASE_URL": "postgres://u:secret@db/platform",
            "SECRET_KEY": "s",
            "AGENT_KEY": "k",
            "CELERY_BROKER_URL": "redis://:pw@redis:6379/0",
            "GE_REPOSITORY_KEY": "the-key",
            "ASCEND_TOOLKIT_HOME": "/usr/local/Ascend/ascend-toolkit/latest",
            "LC_ALL": "C.UTF-8",
        },
        home=tmp_path / "run",
        include_checkout=False,
    )
    assert env["PATH"].split(":")[0] == str(runtime.python_bin)
    assert env["LD_LIBRARY_PATH"].split(":")[0] == str(runtime.libs)
    assert env["HOME"] == str(tmp_path / "run")
    assert env["ASCEND_TOOLKIT_HOME"] and env["LC_ALL"] == "C.UTF-8"
    assert not {"DATABASE_URL", "SECRET_KEY", "AGENT_KEY", "CELERY_BROKER_URL", "GE_REPOSITORY_KEY"} & set(
        env
    )
    assert "PYTHONPATH" not in env  # the runtime tree has backend_ge; no checkout for another user
