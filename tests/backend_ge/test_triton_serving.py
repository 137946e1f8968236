"""The seed examples and the GE backend's behaviour against one real tritonserver."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from backend_ge import triton_metrics
from backend_ge.examples import ENSEMBLE
from tests.backend_ge.builders import DTYPES

pytestmark = pytest.mark.triton


@pytest.fixture
def client(triton):
    c = httpclient.InferenceServerClient(url=triton.http_url, concurrency=16)
    yield c
    c.close()  # Triton's graceful stop waits for open HTTP connections


def stats(triton, model: str) -> dict:
    entry = triton.model_statistics(model)[0]
    return {
        "inferences": int(entry["inference_count"]),
        "executions": int(entry["execution_count"]),
        "success": int(entry["inference_stats"]["success"]["count"]),
        "fail": int(entry["inference_stats"]["fail"]["count"]),
    }


def test_seed_example_3_client_runs_unchanged(triton):
    # Seed example 3 verbatim, except the URL of the server the fixture started.
    client = httpclient.InferenceServerClient(url=triton.http_url)
    assert client.is_server_ready()
    assert client.is_model_ready("resnet50")
    input_data = np.random.randn(1, 3, 224, 224).astype(np.float32)
    inputs = [httpclient.InferInput("input", input_data.shape, "FP32")]
    inputs[0].set_data_from_numpy(input_data)
    outputs = [httpclient.InferRequestedOutput("output")]
    results = client.infer(model_name="resnet50", inputs=inputs, outputs=outputs)
    output_data = results.as_numpy("output")
    top5 = np.argsort(output_data[0])[-5:][::-1]
    client.close()

    assert output_data.shape == (1, 1000)
    assert output_data.dtype == np.float32
    assert len(set(top5.tolist())) == 5 and all(0 <= c < 1000 for c in top5)


def test_resnet50_output_equals_a_direct_onnxruntime_run(client, reference):
    x = np.random.default_rng(1).standard_normal((2, 3, 224, 224)).astype(np.float32)
    item = httpclient.InferInput("input", list(x.shape), "FP32")
    item.set_data_from_numpy(x)
    served = client.infer("resnet50", [item]).as_numpy("output")
    np.testing.assert_array_equal(served, reference("resnet50", {"input": x})["output"])


def test_seed_example_1_json_body_over_plain_http(triton, reference):
    x = np.random.default_rng(2).random((1, 3, 224, 224), dtype=np.float32)
    body = {
        "inputs": [
            {"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32", "data": x.ravel().tolist()}
        ]
    }
    reply = requests.post(f"http://{triton.http_url}/v2/models/resnet50/infer", json=body, timeout=60)

    assert reply.status_code == 200, reply.text
    payload = reply.json()
    assert payload["model_name"] == "resnet50"
    assert payload["model_version"] == "1"
    (output,) = payload["outputs"]
    assert (output["name"], output["shape"], output["datatype"]) == ("output", [1, 1000], "FP32")
    expected = reference("resnet50", {"input": x})["output"].ravel()
    np.testing.assert_allclose(np.array(output["data"], np.float32), expected, rtol=1e-6, atol=1e-6)


def test_seed_example_2_bert_int32_inputs(client, reference):
    rng = np.random.default_rng(3)
    ids = rng.integers(1000, 30000, (1, 128)).astype(np.int32)
    ids[0, 0], ids[0, 99] = 101, 102  # [CLS] ... [SEP] then padding, as in the seed's request
    mask = np.zeros((1, 128), np.int32)
    mask[0, :100] = 1
    inputs = []
    for name, array in (("input_ids", ids), ("attention_mask", mask)):
        inputs.append(httpclient.InferInput(name, list(array.shape), "INT32"))
        inputs[-1].set_data_from_numpy(array)
    result = client.infer("bert", inputs)
    pooled = result.as_numpy("pooled_output")

    assert pooled.shape == (1, 768) and pooled.dtype == np.float32
    expected = reference("bert", {"input_ids": ids, "attention_mask": mask})["pooled_output"]
    np.testing.assert_array_equal(pooled, expected)


def test_seed_ensemble_returns_the_postprocessed_result(client, reference):
    image = np.random.default_rng(4).integers(0, 256, (1, 224, 224, 3)).astype(np.uint8)
    item = httpclient.InferInput("raw_image", list(image.shape), "UINT8")
    item.set_data_from_numpy(image)
    result = client.infer(ENSEMBLE, [item])

    pre = reference("preprocess", {"input": image})["output"]
    logits = reference("resnet50", {"input": pre})["output"]
    post = reference("postprocess", {"input": logits})
    np.testing.assert_array_equal(result.as_numpy("predictions"), post["output"])
    np.testing.assert_array_equal(result.as_numpy("scores"), post["scores"])
    assert result.as_numpy("predictions").shape == (1, 5)
    assert np.all(np.diff(result.as_numpy("scores")[0]) <= 0)  # sorted best first


def test_dynamic_batching_batches_and_outputs_match_each_request(triton, client, reference):
    before = stats(triton, "mlp_batching")
    rng = np.random.default_rng(5)
    requests_data = [rng.standard_normal((1, 256)).astype(np.float32) for _ in range(96)]
    pending = []
    for x in requests_data:
        item = httpclient.InferInput("input", [1, 256], "FP32")
        item.set_data_from_numpy(x)
        pending.append(client.async_infer("mlp_batching", [item]))
    outputs = [p.get_result(timeout=60).as_numpy("output") for p in pending]
    after = stats(triton, "mlp_batching")

    inferences = after["inferences"] - before["inferences"]
    executions = after["executions"] - before["executions"]
    assert inferences == 96
    assert executions <= inferences / 2, (
        f"too little batching: {executions} executions for {inferences} inferences"
    )
    for x, y in zip(requests_data, outputs, strict=True):
        np.testing.assert_array_equal(y, reference("mlp", {"input": x})["output"])


def test_every_supported_dtype_round_trips(client):
    rng = np.random.default_rng(6)
    arrays = {
        "FP32": rng.standard_normal((2, 4)).astype(np.float32),
        "FP16": rng.standard_normal((2, 4)).astype(np.float16),
        "INT8": rng.integers(-128, 127, (2, 4)).astype(np.int8),
        "UINT8": rng.integers(0, 255, (2, 4)).astype(np.uint8),
        "INT32": rng.integers(-(2**31), 2**31 - 1, (2, 4)).astype(np.int32),
        "INT64": rng.integers(-(2**62), 2**62, (2, 4)).astype(np.int64),
        "BOOL": rng.integers(0, 2, (2, 4)).astype(bool),
    }
    inputs = []
    for wire, _ in DTYPES:
        inputs.append(httpclient.InferInput(f"in_{wire.lower()}", [2, 4], wire))
        inputs[-1].set_data_from_numpy(arrays[wire])
    result = client.infer("dtype_echo", inputs)
    for wire, _ in DTYPES:
        out = result.as_numpy(f"out_{wire.lower()}")
        assert out.dtype == arrays[wire].dtype
        np.testing.assert_array_equal(out, arrays[wire])


def test_config_is_completed_from_the_model_file(client, triton):
    config = client.get_model_config("mlp_auto", headers=triton.key_headers())
    assert config["max_batch_size"] == 8
    assert [(i["name"], i["data_type"], i["dims"]) for i in config["input"]] == [
        ("input", "TYPE_FP32", [256])
    ]
    assert [(o["name"], o["data_type"], o["dims"]) for o in config["output"]] == [
        ("output", "TYPE_FP32", [16])
    ]
    assert "dynamic_batching" in config


# -- bad requests ----------------------------------------------------------------------------------------


def _mlp_input():
    item = httpclient.InferInput("input", [1, 256], "FP32")
    item.set_data_from_numpy(np.ones((1, 256), np.float32))
    return item


def _resnet_input(shape, dtype=np.float32, wire="FP32"):
    item = httpclient.InferInput("input", list(shape), wire)
    item.set_data_from_numpy(np.zeros(shape, dtype))
    return item


@pytest.mark.parametrize(
    ("item", "needles"),
    [
        (lambda: _resnet_input((1, 3, 224, 225)), ["shape", "input", "[-1,3,224,224]"]),
        (lambda: _resnet_input((1, 3, 224, 224), np.int32, "INT32"), ["input", "INT32", "FP32"]),
    ],
    ids=["wrong-shape", "wrong-dtype"],
)
def test_bad_request_gets_a_clear_error_and_the_server_keeps_serving(triton, client, item, needles):
    with pytest.raises(InferenceServerException) as err:
        client.infer("resnet50", [item()])
    message = str(err.value)
    for needle in needles:
        assert needle in message, message
    assert client.is_server_live()
    assert client.infer("resnet50", [_resnet_input((1, 3, 224, 224))]).as_numpy("output").shape == (1, 1000)
    x = httpclient.InferInput("input", [1, 256], "FP32")
    x.set_data_from_numpy(np.ones((1, 256), np.float32))
    assert client.infer("mlp", [x]).as_numpy("output").shape == (1, 16)


def test_missing_input_is_named_in_the_error(client):
    ids = httpclient.InferInput("input_ids", [1, 128], "INT32")
    ids.set_data_from_numpy(np.ones((1, 128), np.int32))
    with pytest.raises(InferenceServerException, match="attention_mask"):
        client.infer("bert", [ids])
    assert client.is_model_ready("bert")


def test_unknown_model_is_a_clear_error(client):
    with pytest.raises(InferenceServerException, match="unknown model.*no_such_model"):
        client.infer("no_such_model", [_resnet_input((1, 3, 224, 224))])
    assert client.is_server_ready()


def test_bad_request_in_a_batch_fails_alone_and_the_rest_succeed(triton, client, reference):
    # mlp_ragged accepts any length in its config, so Triton forms one batch of all three requests and
    # only the backend, which knows the model needs 256 values, can reject the odd one.
    before = stats(triton, "mlp_ragged")
    rng = np.random.default_rng(7)
    data = [rng.standard_normal((1, n)).astype(np.float32) for n in (256, 100, 256)]
    pending = []
    for x in data:
        item = httpclient.InferInput("input", list(x.shape), "FP32")
        item.set_data_from_numpy(x)
        pending.append(client.async_infer("mlp_ragged", [item]))
    good0 = pending[0].get_result(timeout=30).as_numpy("output")
    with pytest.raises(InferenceServerException) as err:
        pending[1].get_result(timeout=30)
    good2 = pending[2].get_result(timeout=30).as_numpy("output")
    after = stats(triton, "mlp_ragged")

    assert "[1, 100]" in str(err.value) and "[-1, 256]" in str(err.value), str(err.value)
    np.testing.assert_array_equal(good0, reference("mlp", {"input": data[0]})["output"])
    np.testing.assert_array_equal(good2, reference("mlp", {"input": data[2]})["output"])
    # one execution for all three: the bad request did not split or fail the batch
    assert (after["executions"] - before["executions"], after["inferences"] - before["inferences"]) == (1, 3)


def test_the_backends_request_errors_are_invalid_arg_a_400_and_counted_as_invalid_requests(triton):
    # mlp_ragged's config takes any length, so only the backend (which knows the model needs 256) refuses it:
    # with pb_utils.TritonError.INVALID_ARG, which Triton 2.51 answers 400 over HTTP, INVALID_ARGUMENT over
    # gRPC (an execution failure is INTERNAL: 500), and the backend counts as INVALID_REQUEST, not BACKEND.
    def ge_failures() -> dict[str, float]:
        text = requests.get(triton.metrics_url, timeout=10).text
        return {
            reason: value
            for (model, _), values in triton_metrics.parse_metrics(text).counters.items()
            if model == "mlp_ragged"
            for reason, value in values.items()
            if reason.startswith(triton_metrics.GE_FAILURE_PREFIX)
        }

    before = ge_failures()
    body = {"inputs": [{"name": "input", "shape": [1, 100], "datatype": "FP32", "data": [0.5] * 100}]}
    reply = requests.post(f"http://{triton.http_url}/v2/models/mlp_ragged/infer", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert (
        json.loads(reply.text)["error"]
        == "input 'input' has shape [1, 100], model 'mlp_ragged' expects [-1, 256]"
    )

    client = grpcclient.InferenceServerClient(triton.grpc_url)
    try:
        item = grpcclient.InferInput("input", [1, 100], "FP32")
        item.set_data_from_numpy(np.zeros((1, 100), np.float32))
        with pytest.raises(InferenceServerException) as caught:
            client.infer("mlp_ragged", [item], client_timeout=30)
    finally:
        client.close()
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT", caught.value
    after = ge_failures()
    assert after["gefail:INVALID_REQUEST"] - before.get("gefail:INVALID_REQUEST", 0) == 2
    assert after["gefail:BACKEND"] == before.get("gefail:BACKEND", 0)


# -- model repository API ------------------------------------------------------------------------------


def test_missing_model_file_fails_the_load_naming_the_file(triton):
    for name in ("no_file_minimal", "no_file_full"):
        with pytest.raises(Exception, match=r"model\.om or model\.onnx") as err:
            triton.load_model(name)
        assert name in str(err.value)
    assert triton.is_model_ready("resnet50")


def test_unsupported_dtype_in_config_fails_the_load(triton):
    with pytest.raises(Exception, match="TYPE_STRING.*not supported.*FP32, FP16, INT8"):
        triton.load_model("string_input")


def test_repository_api_needs_the_key(triton):
    base = f"http://{triton.http_url}"
    assert requests.post(f"{base}/v2/repository/index", json={}, timeout=10).status_code == 403
    assert requests.post(f"{base}/v2/repository/models/mlp/unload", json={}, timeout=10).status_code == 403
    assert (
        requests.post(
            f"{base}/v2/repository/index", json={}, headers={"x-ge-repository-key": "wrong"}, timeout=10
        ).status_code
        == 403
    )
    names = {m["name"]: m.get("state") for m in triton.repository_index()}
    assert names["mlp"] == "READY"
    # inference itself stays open
    assert requests.get(f"{base}/v2/models/mlp/ready", timeout=10).status_code == 200


def test_unload_releases_the_model_and_load_brings_it_back(triton, client):
    triton.unload_model("mlp_auto")
    deadline = time.monotonic() + 30
    while client.is_model_ready("mlp_auto") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not client.is_model_ready("mlp_auto")
    with pytest.raises(InferenceServerException):
        client.infer("mlp_auto", [_mlp_input()])

    triton.load_model("mlp_auto")
    assert client.infer("mlp_auto", [_mlp_input()]).as_numpy("output").shape == (1, 16)


def _stub_pid(triton, model: str) -> int:
    """The python stub serving ``model`` (its command line names the model's ``<model>/1/model.py``)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if parent == triton.process.pid and any(a.endswith(f"/{model}/1/model.py".encode()) for a in cmdline):
            return int(entry.name)
    raise AssertionError(f"no stub process for {model}")


def test_an_onnx_models_stub_loads_no_native_code_beyond_numpy_and_onnxruntime(triton, client):
    # Every extension module a stub maps costs every served model memory: the hot path needs numpy (the
    # python backend's own) and the model's executor, nothing else (no protobuf, onnx, grpc, pyACL), and
    # serving requests must not pull in asyncio with ssl (the stub asks asyncio.iscoroutine each time).
    client.infer("mlp", [_mlp_input()])
    maps = Path(f"/proc/{_stub_pid(triton, 'mlp')}/maps").read_text().splitlines()
    libraries = {line.rsplit("/", 1)[-1] for line in maps if "/" in line and ".so" in line.rsplit("/", 1)[-1]}
    packages = {
        line.split("/site-packages/", 1)[1].split("/", 1)[0]
        for line in maps
        if "/site-packages/" in line and ".so" in line.rsplit("/", 1)[-1]
    }
    assert "onnxruntime" in packages, packages
    assert packages <= {"numpy", "numpy.libs", "onnxruntime", "onnxruntime.libs"}, packages
    assert not {lib for lib in libraries if lib.startswith(("_ssl.", "_asyncio.", "libssl"))}, libraries
