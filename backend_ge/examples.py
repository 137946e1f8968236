"""Example model repository built by this project's own code (no downloads).

``write_examples(dir)`` writes the seed's models as ONNX graphs with random weights, each with a
``config.pbtxt`` for the GE backend and dynamic batching like the seed:

- ``resnet50``: the ResNet-50 v1 architecture, ``input`` FP32 [3,224,224] -> ``output`` FP32 [1000];
- ``bert``: BERT-shaped encoder of small width, ``input_ids``/``attention_mask`` INT32 [128] ->
  ``pooled_output`` FP32 [768];
- ``mlp``: a small multilayer perceptron, ``input`` FP32 [256] -> ``output`` FP32 [16];
- ``preprocess`` (UINT8 HWC image -> normalized NCHW), ``postprocess`` (logits -> top-5 classes and
  probabilities) and the ensemble ``preprocess_resnet_postprocess`` chaining them around ``resnet50``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from backend_ge import config as ge_config

OPSET = 17
ENSEMBLE = "preprocess_resnet_postprocess"
ALL = ("resnet50", "bert", "mlp", "preprocess", "postprocess", ENSEMBLE)


class _Graph:
    """Collects nodes and initializers with unique names while a model is being built."""

    def __init__(self, seed: int) -> None:
        self.nodes: list = []
        self.inits: list = []
        self.rng = np.random.default_rng(seed)
        self._n = 0

    def name(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}_{self._n}"

    def const(self, array: np.ndarray, prefix: str = "w") -> str:
        name = self.name(prefix)
        self.inits.append(numpy_helper.from_array(np.array(array, order="C"), name))
        return name

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, **attrs) -> str | list[str]:
        outs = [self.name(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, **attrs))
        return outs[0] if n_out == 1 else outs

    def he(self, *shape: int, fan_in: int) -> np.ndarray:
        return (self.rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)

    def model(self, inputs: list, outputs: list, name: str) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.inits)
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="backend_ge"
        )
        model.ir_version = 8  # readable by every onnxruntime release the project pins
        onnx.checker.check_model(model, full_check=True)
        return model


def _value(name: str, elem: int, shape: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


# ------------------------------------------------------------------------------------------ resnet50


def _conv_bn(
    g: _Graph, x: str, cin: int, cout: int, k: int, stride: int, relu: bool, gamma: float = 1.0
) -> str:
    w = g.const(g.he(cout, cin, k, k, fan_in=cin * k * k))
    y = g.op("Conv", [x, w], kernel_shape=[k, k], strides=[stride, stride], pads=[k // 2] * 4)
    scale = g.const(np.full(cout, gamma, np.float32))
    bias = g.const(np.zeros(cout, np.float32))
    mean = g.const(np.zeros(cout, np.float32))
    var = g.const(np.ones(cout, np.float32))
    y = g.op("BatchNormalization", [y, scale, bias, mean, var], epsilon=1e-5)
    return g.op("Relu", [y]) if relu else y


def _bottleneck(g: _Graph, x: str, cin: int, width: int, stride: int) -> str:
    cout = width * 4
    y = _conv_bn(g, x, cin, width, 1, 1, True)
    y = _conv_bn(g, y, width, width, 3, stride, True)
    # A small last-BN scale keeps activations bounded through 16 residual blocks of random weights.
    y = _conv_bn(g, y, width, cout, 1, 1, False, gamma=0.2)
    shortcut = _conv_bn(g, x, cin, cout, 1, stride, False) if (stride != 1 or cin != cout) else x
    return g.op("Relu", [g.op("Add", [y, shortcut])])


def build_resnet50(seed: int = 50) -> onnx.ModelProto:
    """ResNet-50 v1: 7x7 stem, bottleneck stages [3, 4, 6, 3], global average pool, 1000-way classifier."""
    g = _Graph(seed)
    x = _conv_bn(g, "input", 3, 64, 7, 2, True)
    x = g.op("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            x = _bottleneck(g, x, cin, width, stride if b == 0 else 1)
            cin = width * 4
    x = g.op("Flatten", [g.op("GlobalAveragePool", [x])], axis=1)
    w = g.const(g.he(1000, 2048, fan_in=2048))
    b = g.const(np.zeros(1000, np.float32))
    g.nodes.append(helper.make_node("Gemm", [x, w, b], ["output"], transB=1))
    return g.model(
        [_value("input", TensorProto.FLOAT, ["batch", 3, 224, 224])],
        [_value("output", TensorProto.FLOAT, ["batch", 1000])],
        "resnet50",
    )


# ------------------------------------------------------------------------------------------ bert


def _dense(g: _Graph, x: str, din: int, dout: int) -> str:
    w = g.const((g.rng.standard_normal((din, dout)) * 0.02).astype(np.float32))
    b = g.const(np.zeros(dout, np.float32))
    return g.op("Add", [g.op("MatMul", [x, w]), b])


def _layer_norm(g: _Graph, x: str, width: int) -> str:
    scale = g.const(np.ones(width, np.float32))
    bias = g.const(np.zeros(width, np.float32))
    return g.op("LayerNormalization", [x, scale, bias], axis=-1, epsilon=1e-12)


def _gelu(g: _Graph, x: str) -> str:
    # erf form of GELU (what BERT uses); the Gelu operator itself only exists from opset 20.
    scaled = g.op("Div", [x, g.const(np.array(np.sqrt(2.0), np.float32))])
    one_plus = g.op("Add", [g.op("Erf", [scaled]), g.const(np.array(1.0, np.float32))])
    return g.op("Mul", [g.op("Mul", [x, one_plus]), g.const(np.array(0.5, np.float32))])


def build_bert(
    seq: int = 128,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 2,
    vocab: int = 30522,
    pooled: int = 768,
    seed: int = 7,
) -> onnx.ModelProto:
    """A BERT encoder (embeddings, ``layers`` transformer blocks, tanh pooler on [CLS]).

    Width is small so that it runs on a 2-core CPU; the pooler projects to BERT-base's 768 so the output
    matches the seed's ``pooled_output`` [768].
    """
    g = _Graph(seed)
    head = hidden // heads
    ids = g.op("Cast", ["input_ids"], to=TensorProto.INT64)
    word = g.op("Gather", [g.const((g.rng.standard_normal((vocab, hidden)) * 0.02).astype(np.float32)), ids])
    pos = g.const((g.rng.standard_normal((1, seq, hidden)) * 0.02).astype(np.float32))
    x = _layer_norm(g, g.op("Add", [word, pos]), hidden)
    # mask 1 -> 0, mask 0 -> -10000, broadcast over heads and query positions: [B, 1, 1, S]
    mask = g.op("Cast", ["attention_mask"], to=TensorProto.FLOAT)
    bias = g.op(
        "Mul",
        [g.op("Sub", [g.const(np.array(1.0, np.float32)), mask]), g.const(np.array(-10000.0, np.float32))],
    )
    bias = g.op("Unsqueeze", [bias, g.const(np.array([1, 2], np.int64))])
    split_heads = g.const(np.array([0, seq, heads, head], np.int64))
    merge_heads = g.const(np.array([0, seq, hidden], np.int64))
    scale = g.const(np.array(1.0 / np.sqrt(head), np.float32))
    for _ in range(layers):
        q, k, v = (
            g.op("Transpose", [g.op("Reshape", [_dense(g, x, hidden, hidden), split_heads])], perm=perm)
            for perm in ([0, 2, 1, 3], [0, 2, 3, 1], [0, 2, 1, 3])
        )
        scores = g.op("Add", [g.op("Mul", [g.op("MatMul", [q, k]), scale]), bias])
        context = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v])
        context = g.op("Reshape", [g.op("Transpose", [context], perm=[0, 2, 1, 3]), merge_heads])
        x = _layer_norm(g, g.op("Add", [x, _dense(g, context, hidden, hidden)]), hidden)
        ffn = _dense(g, _gelu(g, _dense(g, x, hidden, hidden * 4)), hidden * 4, hidden)
        x = _layer_norm(g, g.op("Add", [x, ffn]), hidden)
    cls = g.op("Gather", [x, g.const(np.array(0, np.int64))], axis=1)
    w = g.const((g.rng.standard_normal((hidden, pooled)) * 0.02).astype(np.float32))
    b = g.const(np.zeros(pooled, np.float32))
    g.nodes.append(helper.make_node("Tanh", [g.op("Add", [g.op("MatMul", [cls, w]), b])], ["pooled_output"]))
    return g.model(
        [
            _value("input_ids", TensorProto.INT32, ["batch", seq]),
            _value("attention_mask", TensorProto.INT32, ["batch", seq]),
        ],
        [_value("pooled_output", TensorProto.FLOAT, ["batch", pooled])],
        "bert",
    )


# ------------------------------------------------------------------------------------------ mlp


def build_mlp(sizes: Iterable[int] = (256, 1024, 1024, 16), seed: int = 3) -> onnx.ModelProto:
    """Fully connected layers with ReLU between them: ``input`` [batch, 256] -> ``output`` [batch, 16]."""
    g = _Graph(seed)
    sizes = list(sizes)
    x = "input"
    for i, (din, dout) in enumerate(zip(sizes, sizes[1:], strict=False)):
        last = i == len(sizes) - 2
        w, b = g.const(g.he(din, dout, fan_in=din)), g.const(np.zeros(dout, np.float32))
        if last:
            g.nodes.append(helper.make_node("Gemm", [x, w, b], ["output"]))
        else:
            x = g.op("Relu", [g.op("Gemm", [x, w, b])])
    return g.model(
        [_value("input", TensorProto.FLOAT, ["batch", sizes[0]])],
        [_value("output", TensorProto.FLOAT, ["batch", sizes[-1]])],
        "mlp",
    )


# ------------------------------------------------------------------------------------------ ensemble parts


def build_preprocess() -> onnx.ModelProto:
    """UINT8 HWC image -> ImageNet-normalized FP32 CHW, the input ``resnet50`` expects."""
    g = _Graph(0)
    x = g.op("Div", [g.op("Cast", ["input"], to=TensorProto.FLOAT), g.const(np.array(255.0, np.float32))])
    x = g.op("Sub", [x, g.const(np.array([0.485, 0.456, 0.406], np.float32))])
    x = g.op("Div", [x, g.const(np.array([0.229, 0.224, 0.225], np.float32))])
    g.nodes.append(helper.make_node("Transpose", [x], ["output"], perm=[0, 3, 1, 2]))
    return g.model(
        [_value("input", TensorProto.UINT8, ["batch", 224, 224, 3])],
        [_value("output", TensorProto.FLOAT, ["batch", 3, 224, 224])],
        "preprocess",
    )


def build_postprocess(k: int = 5) -> onnx.ModelProto:
    """Logits -> the top-``k`` classes (``output``, INT64) and their softmax probabilities (``scores``)."""
    g = _Graph(0)
    probs = g.op("Softmax", ["input"], axis=-1)
    g.nodes.append(
        helper.make_node("TopK", [probs, g.const(np.array([k], np.int64))], ["scores", "output"], axis=-1)
    )
    return g.model(
        [_value("input", TensorProto.FLOAT, ["batch", 1000])],
        [
            _value("output", TensorProto.INT64, ["batch", k]),
            _value("scores", TensorProto.FLOAT, ["batch", k]),
        ],
        "postprocess",
    )


# ------------------------------------------------------------------------------------------ repository


def _signature(model: onnx.ModelProto) -> ge_config.ModelSignature:
    def tensors(values) -> tuple[ge_config.TensorSignature, ...]:
        out = []
        for v in values:
            dims = tuple(d.dim_value if d.dim_value > 0 else -1 for d in v.type.tensor_type.shape.dim)[1:]
            wire = {
                TensorProto.FLOAT: "FP32",
                TensorProto.INT32: "INT32",
                TensorProto.INT64: "INT64",
                TensorProto.UINT8: "UINT8",
            }[v.type.tensor_type.elem_type]
            out.append(ge_config.TensorSignature(v.name, wire, dims))
        return tuple(out)

    return ge_config.ModelSignature(tensors(model.graph.input), tensors(model.graph.output), batched=True)


# name -> (builder, max_batch_size, preferred batch sizes, max queue delay in microseconds, parameters)
_MODELS = {
    "resnet50": (build_resnet50, 32, (4, 8, 16), 5000, {}),
    "bert": (build_bert, 16, (4, 8), 5000, {}),
    # The MLP answers in well under a millisecond: a short queue delay batches concurrent requests
    # without adding the seed's 5 ms to every lone request. One onnxruntime thread: at this size handing
    # work to a second thread costs more than it saves, and the other core stays free for Triton itself
    # (measured: +15% batched throughput, unchanged unbatched, on 2 cores).
    "mlp": (build_mlp, 64, (), 100, {"intra_op_thread_count": "1"}),
    "preprocess": (build_preprocess, 32, (), 0, {}),
    "postprocess": (build_postprocess, 32, (), 0, {}),
}


def _write_model(root: Path, name: str) -> None:
    builder, max_batch, preferred, delay, parameters = _MODELS[name]
    model = builder()
    (root / name / "1").mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, root / name / "1" / "model.onnx")
    cfg = ge_config.generate_config(
        name,
        _signature(model),
        max_batch_size=max_batch,
        preferred_batch_sizes=preferred,
        max_queue_delay_us=delay,
        parameters=parameters,
    )
    if name == "resnet50":
        cfg.input[0].format = ge_config.mc.ModelInput.FORMAT_NCHW
    ge_config.write_config(cfg, root / name / "config.pbtxt")


def _write_ensemble(root: Path) -> None:
    mc = ge_config.mc
    cfg = mc.ModelConfig(name=ENSEMBLE, platform="ensemble", max_batch_size=32)
    cfg.input.add(name="raw_image", data_type=mc.TYPE_UINT8, dims=[224, 224, 3])
    cfg.output.add(name="predictions", data_type=mc.TYPE_INT64, dims=[5])
    cfg.output.add(name="scores", data_type=mc.TYPE_FP32, dims=[5])
    steps = cfg.ensemble_scheduling.step
    steps.add(
        model_name="preprocess",
        model_version=1,
        input_map={"input": "raw_image"},
        output_map={"output": "preprocessed_image"},
    )
    steps.add(
        model_name="resnet50",
        model_version=1,
        input_map={"input": "preprocessed_image"},
        output_map={"output": "logits"},
    )
    steps.add(
        model_name="postprocess",
        model_version=1,
        input_map={"input": "logits"},
        output_map={"output": "predictions", "scores": "scores"},
    )
    (root / ENSEMBLE / "1").mkdir(parents=True, exist_ok=True)
    ge_config.write_config(cfg, root / ENSEMBLE / "config.pbtxt")


def write_examples(directory: str | Path, names: Iterable[str] = ALL) -> list[str]:
    """Write the named example models (and their configs) under ``directory``; return the names written."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    names = list(names)
    unknown = sorted(set(names) - set(ALL))
    if unknown:
        raise ValueError(f"unknown example(s) {', '.join(unknown)}; available: {', '.join(ALL)}")
    if ENSEMBLE in names:  # an ensemble is only loadable with every model it chains
        names += [n for n in ("preprocess", "resnet50", "postprocess") if n not in names]
    for name in names:
        if name == ENSEMBLE:
            _write_ensemble(root)
        else:
            _write_model(root, name)
    return names
