"""FAKE ``npu-smi``: ``npu-smi info`` prints a recorded real table (``recorded/npu_smi``).

``FAKE_NPU_SMI_TABLE`` names the recording (default: the fake host of ``npu-check --fake``, 8 x 910B3).
Every other subcommand is refused: there is no recording to replay for it.
"""

from __future__ import annotations

import os
import sys

from backend_ge.fakes import FAKE_HOST_NPU_SMI, NPU_SMI_RECORDINGS, refuse_unless_enabled


def main() -> None:
    refuse_unless_enabled("npu-smi")
    if sys.argv[1:] != ["info"]:
        sys.stderr.write(f"fake npu-smi replays only `npu-smi info`, not {' '.join(sys.argv[1:])!r}\n")
        sys.exit(2)
    name = os.environ.get("FAKE_NPU_SMI_TABLE", FAKE_HOST_NPU_SMI)
    sys.stdout.write((NPU_SMI_RECORDINGS / f"{name}.txt").read_text())
    sys.exit(0)
