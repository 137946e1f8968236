"""Parse Ascend's ``npu-smi`` output into an NPU inventory, and run it on a host.

``npu-smi info`` prints one table with two rows per chip::

    | NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
    | Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
    | 0     910B3               | OK            | 96.8        32                0    / 0             |
    | 0                         | 0000:C1:00.0  | 0           0    / 0          54592/ 65536         |

followed (on most drivers) by a process table. Column widths change between driver versions (22.x, 24.x,
25.x), 310/310P cards have no HBM column and repeat the NPU row once per chip (Atlas 300I Duo: two chips
per card), and A3 boards show a ``Chip  Phy-ID`` header with two dies per NPU. The parser therefore splits
rows on ``|`` and reads whitespace-separated fields inside each cell instead of trusting fixed offsets.

Everything here is plain Python: ``backend_ge`` is imported on NPU hosts that have no Django.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

HEALTH_STATES = ("OK", "Warning", "Alarm", "Critical")

_HEADER = re.compile(r"^\|\s*npu-smi\s+(?P<tool>\S+)\s+Version:\s*(?P<driver>\S+)\s*\|$")
# Lines drawn only with box characters: "+----+", "+====+", and the "|" variant some manuals print.
_RULE = re.compile(r"^[+|][-=+|]*$")
_NPU_CELL = re.compile(r"^(?P<npu>\d+)\s+(?P<name>\S+)$")
_NPU_VALUES = re.compile(r"^(?P<power>\S+)\s+(?P<temp>\S+)\s+(?P<hp_used>\d+)\s*/\s*(?P<hp_total>\d+)$")
_CHIP_CELL = re.compile(r"^(?P<chip>\d+)(?:\s+(?P<device>\d+|NA|-))?$")
_CHIP_VALUES = re.compile(
    r"^(?P<aicore>\S+)\s+(?P<mem_used>\d+)\s*/\s*(?P<mem_total>\d+)"
    r"(?:\s+(?P<hbm_used>\d+)\s*/\s*(?P<hbm_total>\d+))?$"
)
_PROCESS_IDS = re.compile(r"^(?P<npu>\d+)\s+(?P<chip>\d+)$")
_NO_PROCESSES = re.compile(r"^No running processes found in NPU (?P<npu>\d+)$")
_KEY_VALUE = re.compile(r"^(?P<key>[^:]+?)\s*:\s*(?P<value>.*)$")


class NpuSmiError(RuntimeError):
    """``npu-smi`` is installed but failed: non-zero exit, timeout, or output this module cannot read."""


@dataclass(frozen=True)
class NpuChip:
    """One chip (what the runtime calls a device) from ``npu-smi info``.

    ``npu_id`` is the card id that ``npu-smi ... -i`` takes; ``chip_id`` the chip on that card (0 and 1 on an
    Atlas 300I Duo or an A3 board). ``device_id`` is the second number of the chip row: the logical device
    (``Chip Device`` header, 310/310P) or the physical id (``Chip Phy-ID`` header, A3); 910/910B tables
    leave it out. ``None`` means npu-smi printed ``NA``/``-`` or no value.
    """

    npu_id: int
    chip_id: int
    device_id: int | None
    name: str
    health: str
    power_w: float | None
    temperature_c: int | None
    hugepages_used: int
    hugepages_total: int
    bus_id: str
    aicore_percent: int | None
    memory_used_mb: int
    memory_total_mb: int
    hbm_used_mb: int | None = None
    hbm_total_mb: int | None = None

    @property
    def soc_version(self) -> str:
        """The ``atc --soc_version`` for this chip: the table name prefixed with ``Ascend``.

        A3 tables already print ``Ascend910``; that is a family name, not a compilable SoC, so it is
        returned unchanged rather than doubled.
        """
        return self.name if self.name.startswith("Ascend") else f"Ascend{self.name}"

    @property
    def healthy(self) -> bool:
        """True only for ``OK``; Warning, Alarm and Critical chips should not get new work."""
        return self.health == "OK"

    @property
    def device_memory_used_mb(self) -> int:
        """Memory models live in: HBM where the chip has it (910 family), otherwise DDR (310/310P)."""
        return self.hbm_used_mb if self.hbm_total_mb else self.memory_used_mb

    @property
    def device_memory_total_mb(self) -> int:
        """Total of :attr:`device_memory_used_mb`'s pool (910A reports DDR beside HBM; HBM is what counts)."""
        return self.hbm_total_mb if self.hbm_total_mb else self.memory_total_mb

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict, including the derived ``soc_version`` so readers need not know the rule."""
        return {**asdict(self), "soc_version": self.soc_version}


@dataclass(frozen=True)
class NpuProcess:
    """A process holding device memory, from the process table under the chips."""

    npu_id: int
    chip_id: int
    pid: int
    name: str
    memory_mb: int
    # Newer drivers add "Process id in container"; NA when the process is not in a container.
    container_pid: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)


@dataclass
class NpuInventory:
    """Everything ``npu-smi info`` says about a host: driver version, chips, and device processes."""

    npu_smi_version: str
    driver_version: str
    chips: list[NpuChip] = field(default_factory=list)
    processes: list[NpuProcess] = field(default_factory=list)

    @property
    def npu_ids(self) -> list[int]:
        """Card ids in table order, each once (a 300I Duo card has two chips under one id)."""
        return list(dict.fromkeys(chip.npu_id for chip in self.chips))

    def processes_on(self, npu_id: int, chip_id: int) -> list[NpuProcess]:
        """Processes that hold memory on one chip."""
        return [p for p in self.processes if p.npu_id == npu_id and p.chip_id == chip_id]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict for storing the inventory with a host heartbeat."""
        return {
            "npu_smi_version": self.npu_smi_version,
            "driver_version": self.driver_version,
            "chips": [chip.to_dict() for chip in self.chips],
            "processes": [process.to_dict() for process in self.processes],
        }


@dataclass(frozen=True)
class ChipUsages:
    """One chip's block from ``npu-smi info -t usages -i <id>``: raw ``key : value`` fields kept as text.

    Field names differ by chip (310P: ``DDR ...``, ``Vectorcore``, ``DVPP ...``; 910B: ``HBM ...``), so all
    fields are kept and the common ones get typed accessors.
    """

    npu_id: int
    chip_id: int
    fields: dict[str, str]

    def rate(self, key: str) -> int | None:
        """An integer field such as ``"Aicore Usage Rate(%)"``; None when absent or ``NA``."""
        return _int_or_none(self.fields.get(key))

    @property
    def aicore_percent(self) -> int | None:
        """AI Core utilisation, the NPU's main compute load figure."""
        return self.rate("Aicore Usage Rate(%)")

    @property
    def hbm_usage_percent(self) -> int | None:
        """HBM occupancy; None on chips without HBM (310/310P)."""
        return self.rate("HBM Usage Rate(%)")

    @property
    def memory_usage_percent(self) -> int | None:
        """Occupancy of the model memory: HBM where present, else DDR (older drivers call it Memory)."""
        for key in ("HBM Usage Rate(%)", "DDR Usage Rate(%)", "Memory Usage Rate(%)"):
            if key in self.fields:
                return self.rate(key)
        return None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)


def parse_npu_smi_info(text: str) -> NpuInventory:
    """Parse the table printed by ``npu-smi info``.

    Raises ``ValueError`` naming the line number and text of the first line that fits no known row, so a
    new driver layout is reported instead of silently dropping chips.
    """
    tool_version = driver_version = None
    chips: list[NpuChip] = []
    processes: list[NpuProcess] = []
    section = None  # None before the chip table header, then "chips", then "processes".
    pending_npu: tuple[int, str, str, dict[str, str]] | None = None

    for lineno, line in _lines(text):
        if not line or _RULE.match(line):
            continue

        def fail(reason: str, lineno: int = lineno, line: str = line) -> ValueError:
            return ValueError(f"npu-smi info, line {lineno}: {reason}: {line!r}")

        header = _HEADER.match(line)
        if header:
            tool_version, driver_version = header["tool"], header["driver"]
            continue
        if not line.startswith("|"):
            raise fail("not part of an npu-smi table")
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        first = cells[0]

        if first.startswith("NPU") and "Health" in line:
            section = "chips"
            continue
        if first.startswith("Chip") and "Bus-Id" in line:
            continue
        if first.startswith("NPU") and "Process id" in line:
            if pending_npu:
                raise fail("process table starts before the chip row of the previous NPU row")
            section = "processes"
            continue

        if section == "chips":
            if pending_npu is None:
                pending_npu = _read_npu_row(cells)
                if pending_npu is None:
                    raise fail("expected an NPU row (id, name, health)")
                continue
            chip = _read_chip_row(cells, pending_npu)
            if chip is None:
                raise fail("expected a chip row (chip id, Bus-Id, AICore, memory) after the NPU row")
            chips.append(chip)
            pending_npu = None
        elif section == "processes":
            if len(cells) == 1 and _NO_PROCESSES.match(first):
                continue
            process = _read_process_row(cells)
            if process is None:
                raise fail("expected a process row (NPU chip | pid | name | memory)")
            processes.append(process)
        else:
            raise fail("data row before the table header")

    if driver_version is None:
        raise ValueError("npu-smi info: no 'npu-smi <version>  Version: <driver>' header line found")
    if pending_npu is not None:
        raise ValueError(f"npu-smi info: NPU {pending_npu[0]} row has no chip row after it")
    return NpuInventory(tool_version or "", driver_version, chips, processes)


def parse_npu_smi_usages(text: str) -> list[ChipUsages]:
    """Parse ``npu-smi info -t usages -i <id>``: a card header, then one block per chip ending in ``Chip ID``.

    Raises ``ValueError`` naming the line for a line that is not ``key : value`` or a block with no
    ``Chip ID``.
    """
    npu_id: int | None = None
    current: dict[str, str] = {}
    chips: list[ChipUsages] = []
    for lineno, line in _lines(text):
        if not line:
            continue
        match = _KEY_VALUE.match(line)
        if not match:
            raise ValueError(f"npu-smi usages, line {lineno}: not a 'key : value' line: {line!r}")
        key, value = match["key"], match["value"].strip()
        if key == "NPU ID":
            npu_id = _int_or_raise(value, lineno, line)
        elif key == "Chip Count":
            continue
        elif key == "Chip ID":
            if npu_id is None:
                raise ValueError(f"npu-smi usages, line {lineno}: 'Chip ID' before 'NPU ID': {line!r}")
            chips.append(ChipUsages(npu_id, _int_or_raise(value, lineno, line), current))
            current = {}
        else:
            current[key] = value
    if current:
        raise ValueError("npu-smi usages: the last block has no 'Chip ID' line (output cut short?)")
    if not chips:
        raise ValueError("npu-smi usages: no chip blocks found")
    return chips


def read_inventory(
    runner: Callable[..., subprocess.CompletedProcess] = subprocess.run,
    timeout: float = 10,
    executable: str = "npu-smi",
) -> NpuInventory | None:
    """Run ``npu-smi info`` and parse it; None on hosts without ``npu-smi`` (CPU-only hosts).

    Raises :class:`NpuSmiError` when the tool exists but fails or hangs (a wedged driver makes npu-smi
    block, so the heartbeat must not wait forever), and ``ValueError`` for output it cannot read.
    """
    path = shutil.which(executable)
    if path is None:
        return None
    try:
        result = runner([path, "info"], capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise NpuSmiError(f"npu-smi info did not finish within {timeout:g} s") from exc
    if result.returncode != 0:
        detail = (result.stderr or result.stdout or "").strip()[-500:]
        raise NpuSmiError(f"npu-smi info exited with status {result.returncode}: {detail or 'no output'}")
    return parse_npu_smi_info(result.stdout)


def _lines(text: str) -> Iterator[tuple[int, str]]:
    for lineno, raw in enumerate(text.splitlines(), start=1):
        yield lineno, raw.strip()


def _read_npu_row(cells: list[str]) -> tuple[int, str, str, dict[str, str]] | None:
    if len(cells) != 3:
        return None
    ident, values = _NPU_CELL.match(cells[0]), _NPU_VALUES.match(cells[2])
    if not ident or not values or not cells[1]:
        return None
    return int(ident["npu"]), ident["name"], cells[1], values.groupdict()


def _read_chip_row(cells: list[str], npu: tuple[int, str, str, dict[str, str]]) -> NpuChip | None:
    if len(cells) != 3:
        return None
    ident, values = _CHIP_CELL.match(cells[0]), _CHIP_VALUES.match(cells[2])
    if not ident or not values or not cells[1]:
        return None
    npu_id, name, health, npu_values = npu
    return NpuChip(
        npu_id=npu_id,
        chip_id=int(ident["chip"]),
        device_id=_int_or_none(ident["device"]),
        name=name,
        health=health,
        power_w=_float_or_none(npu_values["power"]),
        temperature_c=_int_or_none(npu_values["temp"]),
        hugepages_used=int(npu_values["hp_used"]),
        hugepages_total=int(npu_values["hp_total"]),
        bus_id=cells[1],
        aicore_percent=_int_or_none(values["aicore"]),
        memory_used_mb=int(values["mem_used"]),
        memory_total_mb=int(values["mem_total"]),
        hbm_used_mb=_int_or_none(values["hbm_used"]),
        hbm_total_mb=_int_or_none(values["hbm_total"]),
    )


def _read_process_row(cells: list[str]) -> NpuProcess | None:
    if len(cells) not in (4, 5):
        return None
    ids = _PROCESS_IDS.match(cells[0])
    if not ids or not cells[1].isdigit() or not cells[3].isdigit():
        return None
    return NpuProcess(
        npu_id=int(ids["npu"]),
        chip_id=int(ids["chip"]),
        pid=int(cells[1]),
        name=cells[2],  # Empty in many real tables: npu-smi cannot see names across PID namespaces.
        memory_mb=int(cells[3]),
        container_pid=_int_or_none(cells[4]) if len(cells) == 5 else None,
    )


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


def _float_or_none(value: str) -> float | None:
    # Second dies of an A3 NPU print "-" and 310P cards "NA": the board reports power once per card.
    try:
        return float(value)
    except ValueError:
        return None


def _int_or_raise(value: str, lineno: int, line: str) -> int:
    if not value.isdigit():
        raise ValueError(f"npu-smi usages, line {lineno}: expected a number: {line!r}")
    return int(value)
