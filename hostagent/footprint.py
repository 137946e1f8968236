"""What one loaded copy of a model takes, measured by the agent around the load (the scheduler's footprint).

- NPU (the instance has devices and ``npu-smi`` answers): the HBM used on the instance's devices after the
  load minus before. ``npu-smi`` counts every process on the chip, so the difference is the model's weights
  and work buffers only when no other load ran on the instance meanwhile (the agent loads several models of
  an instance at once): a load that overlapped another gives no figure.
- CPU: the model's python stubs' PSS (the ``triton_python_backend_stub`` children of the tritonserver whose
  model file lies under ``<repository>/<model>/``) plus the tritonserver's own RSS growth across the load
  (left out when another load overlapped it: that growth is shared). PSS, not RSS: the stubs share the
  interpreter and onnxruntime's pages, which PSS divides between them (~31 MiB PSS against ~73 MiB RSS for a
  small model, see DESIGN.md), so the sum over many models stays true.

A figure that cannot be read (another user's /proc entries, no npu-smi, a failed run) is None: the platform
then keeps its estimate. Linux only, like the agent.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from backend_ge import npu_smi

log = logging.getLogger(__name__)

PROC = Path("/proc")
STUB_NAME = "triton_python_backend_stub"


def _status_kb(pid: int, key: str, proc: Path = PROC) -> int | None:
    """A ``kB`` line of ``/proc/<pid>/status`` (VmRSS) or ``smaps_rollup`` (Pss)."""
    path = proc / str(pid) / ("status" if key.startswith("Vm") else "smaps_rollup")
    try:
        for line in path.read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_kb(pid: int, proc: Path = PROC) -> int | None:
    return _status_kb(pid, "VmRSS", proc)


def pss_kb(pid: int, proc: Path = PROC) -> int | None:
    return _status_kb(pid, "Pss", proc)


def _cmdline(pid: int, proc: Path) -> list[str]:
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _parent(pid: int, proc: Path) -> int | None:
    try:
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so read after the last ')'.
        return int((proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def stub_pids(server_pid: int, model_name: str, proc: Path = PROC) -> list[int]:
    """The python stubs of ``model_name`` started by the tritonserver ``server_pid``: the stub's first
    argument is ``<repository>/<model>/<version>/model.py``."""
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or _parent(int(entry.name), proc) != server_pid:
            continue
        argv = _cmdline(int(entry.name), proc)
        if len(argv) >= 2 and Path(argv[0]).name == STUB_NAME:
            parts = Path(argv[1]).parts
            if len(parts) >= 3 and parts[-3] == model_name:
                found.append(int(entry.name))
    return sorted(found)


def hbm_used_mb(device_ids: Sequence[int], read: Callable[[], npu_smi.NpuInventory | None]) -> int | None:
    """Device memory used on these devices as ``npu-smi info`` reports it (ids as the pool template numbers
    them: the chip's device id where the table has one, else its NPU id)."""
    try:
        inventory = read()
    except (npu_smi.NpuSmiError, ValueError) as exc:
        log.warning("npu-smi for the footprint: %s", exc)
        return None
    if inventory is None:
        return None
    wanted = set(device_ids)
    chips = [c for c in inventory.chips if (c.device_id if c.device_id is not None else c.npu_id) in wanted]
    return sum(chip.device_memory_used_mb for chip in chips) if chips else None


@dataclass
class Meter:
    """Readings before a load; ``finish()`` reads again after it and returns the footprint in MiB."""

    server_pid: int
    model_name: str
    device_ids: list[int] = field(default_factory=list)
    read_inventory: Callable[[], npu_smi.NpuInventory | None] = npu_smi.read_inventory
    proc: Path = PROC
    hbm_before: int | None = None
    rss_before: int | None = None

    def __post_init__(self) -> None:
        if self.device_ids:
            self.hbm_before = hbm_used_mb(self.device_ids, self.read_inventory)
        self.rss_before = rss_kb(self.server_pid, self.proc)

    def finish(self, alone: bool = True) -> int | None:
        """The footprint in MiB; ``alone``: no other load on the instance overlapped this one."""
        if self.device_ids and self.hbm_before is not None:
            if not alone:
                return None  # the chip's figure holds the other loads too: keep the estimate
            after = hbm_used_mb(self.device_ids, self.read_inventory)
            return None if after is None else max(1, after - self.hbm_before)
        rss_after = rss_kb(self.server_pid, self.proc)
        stubs = [pss_kb(pid, self.proc) for pid in stub_pids(self.server_pid, self.model_name, self.proc)]
        if not stubs or None in stubs or self.rss_before is None or rss_after is None:
            return None  # no stub seen (a non-python backend) or /proc not readable: keep the estimate
        growth = max(0, rss_after - self.rss_before) if alone else 0
        return max(1, math.ceil((sum(stubs) + growth) / 1024))


def start(server_pid: int | None, model_name: str, device_ids: Sequence[int] | None) -> Meter | None:
    """A meter for a load about to happen, or None when there is no server process to read."""
    if not server_pid:
        return None
    try:
        return Meter(server_pid, model_name, list(device_ids or ()))
    except OSError as exc:  # a measurement never stops a load
        log.warning("footprint of %s: %s", model_name, exc)
        return None
