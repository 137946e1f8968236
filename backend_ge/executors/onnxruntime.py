"""The CPU executor: an ONNX model run by onnxruntime in the Triton stub process."""

from __future__ import annotations

import os

import numpy as np

from backend_ge import dtypes
from backend_ge.executors.base import Executor, ExecutorError, TensorSpec

# onnxruntime reports element types as strings; only the types the GE backend serves are mapped, so
# anything else fails at load time with the list of supported types.
_ORT_TYPES = {
    "tensor(float)": "FP32",
    "tensor(float16)": "FP16",
    "tensor(int8)": "INT8",
    "tensor(uint8)": "UINT8",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(bool)": "BOOL",
}

# A dynamic leading dimension accepts any batch; Triton's max_batch_size is an int32.
UNBOUNDED_BATCH = 2**31 - 1


def _spec(node, what: str) -> TensorSpec:
    wire = _ORT_TYPES.get(node.type)
    if wire is None:
        raise dtypes.UnsupportedDataType(
            f"{what} {node.name!r} has type {node.type}, which the GE backend does not serve; "
            f"supported: {dtypes.SUPPORTED_NAMES}"
        )
    shape = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in node.shape)
    return TensorSpec(node.name, dtypes.from_wire(wire), shape)


class OnnxRuntimeExecutor(Executor):
    """Runs ``model.onnx`` with onnxruntime's CPU provider.

    ``intra_op_threads`` 0 lets onnxruntime use every core; on a host shared with Triton's own threads a
    smaller number avoids oversubscription.
    """

    kind = "onnxruntime"

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        intra_op_threads: int = 0,
        inter_op_threads: int = 0,
        allow_spinning: bool = False,
    ) -> None:
        # Imported here so that choosing the pyACL executor never pays for onnxruntime.
        import onnxruntime as ort

        self.path = os.fspath(path)
        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_threads
        options.inter_op_num_threads = inter_op_threads
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Spinning worker threads keep cores busy between calls; on a host where Triton, its stubs and the
        # clients share a few cores that stolen time costs more than the wake-up latency it saves.
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "1" if allow_spinning else "0")
        try:
            self._session = ort.InferenceSession(
                self.path, sess_options=options, providers=["CPUExecutionProvider"]
            )
        except Exception as e:  # onnxruntime raises its own exception types per failure kind
            raise ExecutorError(f"onnxruntime could not load {self.path}: {e}") from e
        self._inputs = [_spec(n, "input") for n in self._session.get_inputs()]
        self._outputs = [_spec(n, "output") for n in self._session.get_outputs()]
        self._output_names = [s.name for s in self._outputs]

    @property
    def inputs(self) -> list[TensorSpec]:
        return self._inputs

    @property
    def outputs(self) -> list[TensorSpec]:
        return self._outputs

    @property
    def max_batch_size(self) -> int:
        """Unbounded when every input and output has a dynamic leading dimension, else 0."""
        specs = self._inputs + self._outputs
        if specs and all(s.shape and s.shape[0] == -1 for s in specs):
            return UNBOUNDED_BATCH
        return 0

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._session is None:
            raise ExecutorError("onnxruntime session is closed")
        try:
            results = self._session.run(self._output_names, feeds)
        except Exception as e:
            raise ExecutorError(f"onnxruntime run failed: {e}") from e
        return dict(zip(self._output_names, results, strict=True))

    def runner(self, output_names: list[str]):
        """``feeds -> [arrays]`` straight into the session's C++ binding.

        ``InferenceSession.run`` checks the feed names and graph-capture options in Python on every call;
        the serving path has checked its inputs already, and the binding raises on anything else.
        """
        unknown = sorted(set(output_names) - set(self._output_names))
        if unknown:
            raise ExecutorError(f"unknown output(s) {unknown}; the model has {self._output_names}")
        names = list(output_names)
        session = self._session
        if session is None:
            raise ExecutorError("onnxruntime session is closed")
        # ``_sess`` is the C++ session behind the Python wrapper; fall back to the public call if a
        # future onnxruntime renames it.
        binding = getattr(session, "_sess", None)
        run = binding.run if binding is not None and hasattr(binding, "run") else session.run

        def run_outputs(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
            if self._session is None:
                raise ExecutorError("onnxruntime session is closed")
            try:
                return run(names, feeds, None)
            except Exception as e:
                raise ExecutorError(f"onnxruntime run failed: {e}") from e

        return run_outputs

    def close(self) -> None:
        self._session = None
