"""``model.om`` served by a real tritonserver through the pyACL executor, with the fake pyACL in the stub.

No NPU exists here, so the stub imports a shim ``acl`` module backed by ``tests/backend_ge/fake_acl.py``
(which enforces pyACL's call order and return codes and runs the math in onnxruntime). Everything from
Triton down to the executor is the production path.
"""

from __future__ import annotations

import json
import time

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as httpclient

from backend_ge.examples import build_mlp
from backend_ge.runtime import TritonServer
from tests.backend_ge.fake_acl import write_fake_om

pytestmark = pytest.mark.triton

ACL_SHIM = '''"""pyACL for tests: one fake runtime per stub process; reports its resources at exit."""
import atexit, json, os
from tests.backend_ge.fake_acl import FakeAcl

_runtime = FakeAcl(device_count=8)


def __getattr__(name):
    return getattr(_runtime, name)


def finalize():
    # Report right here as well as at exit: the python backend may end an unloaded stub without running
    # its exit handlers, and finalize is the last call a well-behaved executor makes.
    ret = _runtime.finalize()
    _report()
    return ret


@atexit.register
def _report():
    path = os.environ.get("GE_FAKE_ACL_REPORT")
    if path:
        with open(f"{path}.{os.getpid()}.json", "w") as f:
            json.dump({"allocations": len(_runtime.allocations), "finalized": _runtime.finalized,
                       "devices": sorted(_runtime.devices_set), "batches": _runtime.executed_batches}, f)
'''

OM_CONFIG = """
name: "mlp_om"
backend: "ge"
max_batch_size: 8
input [ { name: "input" data_type: TYPE_FP32 dims: [ 256 ] } ]
output [ { name: "output" data_type: TYPE_FP32 dims: [ 16 ] } ]
dynamic_batching { preferred_batch_size: [ 3 ] max_queue_delay_microseconds: 500000 }
parameters [ { key: "EXECUTOR_TYPE" value: { string_value: "graph" } },
             { key: "device_ids" value: { string_value: "4,5" } } ]
"""


@pytest.fixture(scope="module")
def om_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("om")
    shim = root / "shim"
    shim.mkdir()
    (shim / "acl.py").write_text(ACL_SHIM)
    repo = root / "repository"
    mlp = build_mlp()
    for name, config in (("mlp_om", OM_CONFIG), ("mlp_om_auto", 'backend: "ge"\n')):
        (repo / name / "1").mkdir(parents=True)
        write_fake_om(mlp, repo / name / "1" / "model.om", [1, 2, 4, 8])
        (repo / name / "config.pbtxt").write_text(config)
    (root / "onnx").mkdir()
    reference = root / "onnx" / "model.onnx"
    reference.write_bytes(mlp.SerializeToString())

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(shim))
        mp.setenv("GE_FAKE_ACL_REPORT", str(root / "report"))
        server = TritonServer(
            repo,
            workdir=root / "w",
            load_models=["mlp_om", "mlp_om_auto"],
            exit_timeout=5,
            die_with_parent=True,
        )
        server.start(timeout=120)
    try:
        yield server, root, ort.InferenceSession(str(reference), providers=["CPUExecutionProvider"])
    finally:
        server.stop(timeout=30)


def test_om_model_is_served_through_pyacl_with_gear_padding(om_server):
    server, root, reference = om_server
    client = httpclient.InferenceServerClient(server.http_url, concurrency=3)
    rng = np.random.default_rng(11)
    data = [rng.standard_normal((1, 256)).astype(np.float32) for _ in range(3)]
    try:
        pending = []
        for x in data:
            item = httpclient.InferInput("input", [1, 256], "FP32")
            item.set_data_from_numpy(x)
            pending.append(client.async_infer("mlp_om", [item]))
        outputs = [p.get_result(timeout=30).as_numpy("output") for p in pending]
    finally:
        client.close()
    for x, y in zip(data, outputs, strict=True):
        np.testing.assert_allclose(y, reference.run(None, {"input": x})[0], rtol=1e-6, atol=1e-6)
    stats = server.model_statistics("mlp_om")[0]
    assert (stats["inference_count"], stats["execution_count"]) == (3, 1)

    server.unload_model("mlp_om")  # finalize: the stub releases everything and exits
    deadline = time.monotonic() + 30
    reports: list = []
    while time.monotonic() < deadline and not reports:
        reports = [
            json.loads(p.read_text()) for p in root.glob("report.*.json") if "batches" in p.read_text()
        ]
        reports = [r for r in reports if 4 in r["batches"]]
        time.sleep(0.2)
    assert reports, "the unloaded stub wrote no pyACL report"
    (report,) = reports
    assert report["batches"][-1] == 4  # three requests ran as one call on the compiled gear 4
    assert report["devices"] == [4]  # instance 0 of device_ids "4,5"
    assert report["allocations"] == 0 and report["finalized"] is True


def test_om_model_config_is_completed_from_the_model_description(om_server):
    server, _, _ = om_server
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        config = client.get_model_config("mlp_om_auto", headers=server.key_headers())
    finally:
        client.close()
    assert config["max_batch_size"] == 8
    assert [(i["name"], i["data_type"], i["dims"]) for i in config["input"]] == [
        ("input", "TYPE_FP32", [256])
    ]
    assert [(o["name"], o["data_type"], o["dims"]) for o in config["output"]] == [
        ("output", "TYPE_FP32", [16])
    ]
