"""The models ``npu-check`` compiles, runs and compares, with the tolerances it states for each.

The tolerances are fp16 ones: ATC compiles with ``--precision_mode=force_fp16``, so the NPU computes in
half precision while onnxruntime, the reference, computes in fp32. An output element passes when
``|npu - ref| <= atol + rtol * |ref|`` (numpy's ``allclose``). Rounding only the weights and inputs of these
example models to fp16 already moves their outputs by up to 0.0017 (mlp, outputs up to ~4), 0.0002 (bert,
tanh outputs within +-1) and 0.007 (resnet50, logits up to ~14); the tolerances leave room for the rounding
of every intermediate activation on top of that (about 5-15x), which grows with depth.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx

from backend_ge import config as gc
from backend_ge import dtypes, examples

PRECISION_MODE = "force_fp16"


@dataclass(frozen=True)
class CheckModel:
    """One example model: how ATC compiles it, how Triton serves it, and how close the NPU must come."""

    name: str
    build: Callable[[], onnx.ModelProto]
    gears: tuple[int, ...]  # ATC --dynamic_batch_size; the largest is the served max_batch_size
    preferred_batch_sizes: tuple[int, ...]  # the seed's dynamic_batching block
    max_queue_delay_us: int
    input_format: str
    rtol: float
    atol: float
    check_batches: tuple[int, ...]  # batch sizes run through the executor (non-gears are padded)

    def tolerance(self) -> dict:
        return {"rtol": self.rtol, "atol": self.atol, "precision_mode": PRECISION_MODE}


MODELS: dict[str, CheckModel] = {
    m.name: m
    for m in (
        CheckModel(
            "resnet50",
            examples.build_resnet50,
            (1, 2, 4, 8, 16, 32),
            (4, 8, 16),
            5000,
            "NCHW",
            rtol=2e-2,
            atol=1e-1,
            check_batches=(1, 3),
        ),
        CheckModel(
            "bert",
            examples.build_bert,
            (1, 2, 4, 8, 16),
            (4, 8),
            5000,
            "ND",
            rtol=1e-2,
            atol=5e-3,
            check_batches=(1, 3),
        ),
        CheckModel(
            "mlp",
            examples.build_mlp,
            (1, 2, 4, 8, 16, 32, 64),
            (),
            100,
            "ND",
            rtol=1e-2,
            atol=1e-2,
            check_batches=(1, 3, 67),
        ),
    )
}
BENCH_MODEL = "resnet50"
UNBATCHED_SUFFIX = "_nobatch"  # the same .om served without dynamic batching: every request runs at batch 1
# The seed article's figures for ResNet-50: each request alone vs dynamic batching.
SEED_IMG_S = {"batch1": 125.0, "dynamic_batching": 450.0}


def make_inputs(signature: gc.ModelSignature, batch: int, seed: int) -> dict[str, np.ndarray]:
    """Deterministic inputs: normal floats, token ids below 1000, attention masks of random length."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for t in signature.inputs:
        shape = [batch, *(d if d > 0 else 1 for d in t.dims)]
        dtype = dtypes.from_wire(t.dtype).numpy
        if dtype.kind == "f":
            feeds[t.name] = rng.standard_normal(shape).astype(dtype)
        elif "mask" in t.name:
            lengths = rng.integers(1, shape[-1] + 1, size=batch)
            feeds[t.name] = (np.arange(shape[-1]) < lengths[:, None]).astype(dtype).reshape(shape)
        else:
            feeds[t.name] = rng.integers(0, 1000, size=shape).astype(dtype)
    return feeds


def compare(output: np.ndarray, reference: np.ndarray, rtol: float, atol: float) -> dict:
    """How far ``output`` is from ``reference``; ``ok`` when every element is within atol + rtol*|ref|."""
    if output.shape != reference.shape:
        return {"ok": False, "reason": f"shape {list(output.shape)} != reference {list(reference.shape)}"}
    out, ref = output.astype(np.float64), reference.astype(np.float64)
    if not np.isfinite(out).all():
        return {"ok": False, "reason": "non-finite values in the output"}
    diff = np.abs(out - ref)
    allowed = atol + rtol * np.abs(ref)
    norms = np.linalg.norm(out) * np.linalg.norm(ref)
    return {
        "ok": bool((diff <= allowed).all()),
        "max_abs_diff": float(diff.max()) if diff.size else 0.0,
        "worst_fraction_of_tolerance": float((diff / allowed).max()) if diff.size else 0.0,
        "cosine": float((out.ravel() @ ref.ravel()) / norms) if norms else 1.0,
    }
