"""Triton entry point of the GE backend, installed as ``<backends>/ge/model.py``.

Triton loads this file for every model whose config says ``backend: "ge"``; all work is delegated to
``backend_ge.serving``. Kept tiny because every model instance's stub process imports it.
"""

import os
import sys

# The stub's embedded interpreter ignores PYTHONPATH; honour it so backend_ge is importable from a
# source checkout as well as from an installed package.
for _entry in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):
    if _entry and _entry not in sys.path:
        sys.path.insert(0, _entry)

import triton_python_backend_utils as pb_utils  # noqa: E402 - provided by the python backend stub

from backend_ge import serving, stub_imports  # noqa: E402

stub_imports.defer_asyncio()  # the stub would import asyncio (and ssl) on the first request


class TritonPythonModel:
    """The GE backend model: pyACL on the NPU for ``model.om``, onnxruntime on the CPU for ``model.onnx``."""

    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        return serving.auto_complete(pb_utils, auto_complete_model_config)

    def initialize(self, args):
        self._model = serving.GeModel(pb_utils, args)
        # Bound once: execute() is the hot path.
        self.execute = self._model.execute
        if os.environ.get("GE_PROFILE_DIR"):  # opt-in measurements; not even imported otherwise
            from backend_ge import profiling

            mode = os.environ.get(profiling.PROFILE_MODE_ENV) or "timing"
            self.execute = profiling.instrument(self._model, os.environ[profiling.PROFILE_DIR_ENV], mode)

    def execute(self, requests):
        return self._model.execute(requests)

    def finalize(self):
        model = getattr(self, "_model", None)
        if model is not None:
            model.close()
            self._model = None
