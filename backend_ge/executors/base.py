"""The one small interface every executor implements (onnxruntime on CPU, pyACL on the NPU)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from backend_ge.dtypes import DType


@dataclass(frozen=True)
class TensorSpec:
    """One model input or output as the model file declares it.

    ``shape`` is the full shape including the batch dimension when the model has one; ``-1`` marks a
    dynamic dimension.
    """

    name: str
    dtype: DType
    shape: tuple[int, ...]


class ExecutorError(RuntimeError):
    """Running or loading the model failed; the message names the failing call."""


class Executor(ABC):
    """Runs one loaded model. Not thread-safe: Triton gives each model instance its own executor."""

    kind: str = ""

    @property
    @abstractmethod
    def inputs(self) -> list[TensorSpec]: ...

    @property
    @abstractmethod
    def outputs(self) -> list[TensorSpec]: ...

    @property
    def max_batch_size(self) -> int:
        """Largest batch one call accepts; 0 when the model has no batch dimension."""
        return 0

    @abstractmethod
    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch. ``feeds`` maps every input name to an array; returns every output by name."""

    def runner(self, output_names: list[str]):
        """A callable ``feeds -> [array per name in output_names]`` for the serving hot path.

        The default goes through :meth:`run`; executors override it to skip building the dict.
        """
        names = list(output_names)
        run = self.run

        def run_outputs(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
            outputs = run(feeds)
            return [outputs[name] for name in names]

        return run_outputs

    @abstractmethod
    def close(self) -> None:
        """Release sessions and device memory. Safe to call twice."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
