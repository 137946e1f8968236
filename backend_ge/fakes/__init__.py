"""FAKES of the Ascend tools, for machines without an NPU: the test suite and ``npu-check --fake``.

Nothing here touches a device. Every tool replays recorded real output (``recorded/``, sources in each
folder's README) or computes with onnxruntime:

- ``pyacl.FakeAcl``: pyACL's calls, return codes and rules; the math runs in onnxruntime on a "fake om"
  (the ONNX bytes plus a JSON sidecar with the dynamic-batch gears).
- ``atc.py``: a fake ``atc`` that replays a recorded real ATC run (output lines and exit code).
- ``npu_smi.py``: a fake ``npu-smi`` that replays a recorded real ``npu-smi info`` table.
- ``shim/acl.py``: ``import acl`` for tritonserver's python stubs, backed by ``FakeAcl``.

The executables and the ``acl`` shim refuse to run unless ``GE_FAKES=1``, which only the tests and
``npu-check --fake`` set (in their own environment), so a fake can never stand in for CANN by accident on
a real host.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ENV_FLAG = "GE_FAKES"
HERE = Path(__file__).resolve().parent
RECORDED = HERE / "recorded"
ATC_RECORDINGS = RECORDED / "atc"
NPU_SMI_RECORDINGS = RECORDED / "npu_smi"
CANN_RECORDINGS = RECORDED / "cann"
SHIM_DIR = HERE / "shim"  # put on PYTHONPATH: `import acl` then finds the fake

# The fake host of `npu-check --fake`: one real machine (vllm-project/vllm-ascend issue 6672).
FAKE_HOST_NPU_SMI = "910b3_x8_idle_25.2.0"
FAKE_HOST_CANN_INFO = "ascend_toolkit_install_8.3.RC2.info"
FAKE_HOST_DEVICES = 8

_WRAPPER = """#!{python}
# FAKE {tool} (backend_ge/fakes): replays recorded output; refuses to run without {flag}=1.
import sys
sys.path.insert(0, {root!r})
from backend_ge.fakes.{module} import main
main()
"""


def enabled() -> bool:
    return os.environ.get(ENV_FLAG) == "1"


def refuse_unless_enabled(tool: str) -> None:
    """Exit with an explanation when a fake is run outside the tests and ``npu-check --fake``."""
    if not enabled():
        sys.stderr.write(
            f"{tool}: this is the platform's FAKE {tool} (backend_ge/fakes), which replays recorded output; "
            f"it runs only with {ENV_FLAG}=1 (tests, npu-check --fake). Install CANN for the real one.\n"
        )
        sys.exit(97)


def atc_exit_codes() -> dict[str, int]:
    """Recording name -> the exit code to replay with it."""
    table = json.loads((ATC_RECORDINGS / "fixtures.json").read_text())
    return {name: entry["exit"] for name, entry in table.items()}


def install_tools(bindir: str | os.PathLike, tools: tuple[str, ...] = ("atc", "npu-smi")) -> dict[str, Path]:
    """Write executable ``atc`` / ``npu-smi`` wrappers into ``bindir`` (put it first on PATH to use them)."""
    bindir = Path(bindir)
    bindir.mkdir(parents=True, exist_ok=True)
    modules = {"atc": "atc", "npu-smi": "npu_smi"}
    written = {}
    for tool in tools:
        path = bindir / tool
        path.write_text(
            _WRAPPER.format(
                python=sys.executable,
                tool=tool,
                flag=ENV_FLAG,
                root=str(HERE.parents[1]),
                module=modules[tool],
            )
        )
        path.chmod(0o755)
        written[tool] = path
    return written
