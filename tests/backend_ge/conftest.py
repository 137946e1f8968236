"""Fixtures for the GE backend tests: the example repository and one real tritonserver serving it.

The server is session-scoped because each model load starts a python stub process (about 1-2 s each on
the 2-core CI machines); tests that stop or break a server start their own.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from backend_ge import examples
from backend_ge.runtime import TritonServer, load_all
from tests.backend_ge.builders import DTYPES

# Models the tests add next to the examples, with the config text each gets.
RAGGED_MLP = """
name: "mlp_ragged"
backend: "ge"
max_batch_size: 8
input [ { name: "input" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]
output [ { name: "output" data_type: TYPE_FP32 dims: [ 16 ] } ]
dynamic_batching { preferred_batch_size: [ 3 ] max_queue_delay_microseconds: 2000000 }
"""

# A queue delay long enough that concurrent test requests always meet in one batch, however slow the
# client is on a loaded machine (the example mlp's 100 us delay batches only under real load).
BATCHING_MLP = """
name: "mlp_batching"
backend: "ge"
max_batch_size: 16
dynamic_batching { preferred_batch_size: [ 16 ] max_queue_delay_microseconds: 100000 }
"""
# The batching test's 96 concurrent requests are sent by 16 client connections: on a loaded machine 20 ms of
# queue delay saw them arrive one by one (51 executions); 100 ms lets each batch fill as it would at a burst.

SLOW_MLP = """
name: "mlp_slow"
backend: "ge"
max_batch_size: 8
dynamic_batching { preferred_batch_size: [ 8 ] max_queue_delay_microseconds: 1500000 }
"""


def build_dtype_echo() -> onnx.ModelProto:
    """One input and one output per supported data type; each output is its input (Identity)."""
    nodes, inputs, outputs = [], [], []
    for wire, elem in DTYPES:
        name = wire.lower()
        inputs.append(helper.make_tensor_value_info(f"in_{name}", elem, ["batch", 4]))
        outputs.append(helper.make_tensor_value_info(f"out_{name}", elem, ["batch", 4]))
        nodes.append(helper.make_node("Identity", [f"in_{name}"], [f"out_{name}"]))
    graph = helper.make_graph(nodes, "dtype_echo", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def add_model(root: Path, name: str, config: str | None, onnx_from: Path | onnx.ModelProto | None) -> None:
    """Add a model directory; ``onnx_from`` None leaves the version directory empty."""
    (root / name / "1").mkdir(parents=True, exist_ok=True)
    if isinstance(onnx_from, Path):
        shutil.copy(onnx_from, root / name / "1" / "model.onnx")
    elif onnx_from is not None:
        onnx.save_model(onnx_from, root / name / "1" / "model.onnx")
    if config is not None:
        (root / name / "config.pbtxt").write_text(config)


@pytest.fixture(scope="session")
def example_repository(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("repository")
    examples.write_examples(root)
    mlp_onnx = root / "mlp" / "1" / "model.onnx"
    add_model(root, "mlp_ragged", RAGGED_MLP, mlp_onnx)
    add_model(root, "mlp_slow", SLOW_MLP, mlp_onnx)
    add_model(root, "mlp_batching", BATCHING_MLP, mlp_onnx)
    add_model(root, "mlp_auto", None, mlp_onnx)  # no config.pbtxt beyond the backend: completed at load
    (root / "mlp_auto" / "config.pbtxt").write_text('backend: "ge"\n')
    add_model(root, "dtype_echo", 'backend: "ge"\n', build_dtype_echo())
    add_model(root, "no_file_minimal", 'backend: "ge"\n', None)
    full = (root / "mlp" / "config.pbtxt").read_text().replace('name: "mlp"', 'name: "no_file_full"')
    add_model(root, "no_file_full", full, None)
    string_input = full.replace('name: "no_file_full"', 'name: "string_input"').replace(
        "TYPE_FP32", "TYPE_STRING", 1
    )
    add_model(root, "string_input", string_input, mlp_onnx)
    return root


SERVED = [*examples.ALL, "mlp_ragged", "mlp_batching", "mlp_auto", "dtype_echo"]


@pytest.fixture(scope="session")
def triton(example_repository, tmp_path_factory):
    """A real tritonserver with the GE backend serving the examples (and a few test models)."""
    server = TritonServer(
        example_repository, workdir=tmp_path_factory.mktemp("triton"), exit_timeout=5, die_with_parent=True
    )
    server.start(timeout=120)
    try:
        failures = load_all(server, SERVED)
        assert not failures, failures
        yield server
    finally:
        server.stop(timeout=30)


@pytest.fixture
def reference(example_repository):
    """Direct onnxruntime sessions over the same model files the server runs."""
    import onnxruntime as ort

    sessions: dict = {}

    def run(model: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if model not in sessions:
            path = example_repository / model / "1" / "model.onnx"
            sessions[model] = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        sess = sessions[model]
        names = [o.name for o in sess.get_outputs()]
        return dict(zip(names, sess.run(names, feeds), strict=True))

    return run
