"""What a host agent's heartbeat says about its host: its facts (CPUs, memory, platform) and its NPU inventory
as ``npu-smi`` reports it. Read on the host, sent over the agent API (``apps.fleet.agent_api.heartbeat``)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import platform
from pathlib import Path

from backend_ge import npu_smi

log = logging.getLogger(__name__)


def npu_inventory() -> dict | None:
    """``npu-smi info`` of this host as JSON for the heartbeat; None without npu-smi (or when it failed)."""
    try:
        inventory = npu_smi.read_inventory()
    except (npu_smi.NpuSmiError, ValueError) as exc:
        log.warning("npu-smi failed: %s", exc)
        return None
    if inventory is None:
        return None
    return {
        "npu_smi_version": inventory.npu_smi_version,
        "driver_version": inventory.driver_version,
        "chips": [dataclasses.asdict(chip) for chip in inventory.chips],
    }


def host_facts() -> dict:
    facts = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                facts["memory_mb"] = int(line.split()[1]) // 1024
    return facts
