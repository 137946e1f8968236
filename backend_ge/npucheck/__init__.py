"""``npu-check``: one command that tells the person installing the platform on an Ascend host whether the
host works with it, end to end.

1. ``environment``: CANN/ATC version, driver, ``npu-smi info`` (chips, health, memory), the soc version to
   compile for, the Python that imports ``acl``; each missing prerequisite on its own line.
2. ``compile``: the example models (resnet50, bert, mlp) with dynamic-batch gears, through the real ``atc``.
3. ``executor`` and ``triton``: each ``.om`` through the pyACL executor and through a real tritonserver with
   the ``ge`` backend, compared with onnxruntime within fp16 tolerances stated per model.
4. ``benchmark``: ResNet-50 at batch 1 vs dynamic batching, p50/p99, AI-core use and memory from npu-smi.

``--fake`` runs the same flow against ``backend_ge.fakes`` (recorded ATC and npu-smi output, the fake
pyACL), so the command itself is tested in CI.
"""

from backend_ge.npucheck.cli import main

__all__ = ["main"]
