"""``backend_ge.npu_smi`` against recorded real ``npu-smi`` output (sources in fixtures/npu_smi/README.md).

The runner tests put a fake ``npu-smi`` on PATH that replays a recorded table, because no Ascend driver is
installed here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from backend_ge import fakes
from backend_ge.npu_smi import (
    NpuProcess,
    NpuSmiError,
    parse_npu_smi_info,
    parse_npu_smi_usages,
    read_inventory,
)

FIXTURES = fakes.NPU_SMI_RECORDINGS


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_910b3_table_with_processes():
    inventory = parse_npu_smi_info(fixture("910b3_x8_processes_24.1.rc2.txt"))

    assert (inventory.npu_smi_version, inventory.driver_version) == ("24.1.rc2", "24.1.rc2")
    assert inventory.npu_ids == list(range(8))
    assert len(inventory.chips) == 8
    assert {chip.soc_version for chip in inventory.chips} == {"Ascend910B3"}
    assert all(chip.healthy and chip.chip_id == 0 and chip.device_id is None for chip in inventory.chips)
    assert [chip.hbm_used_mb for chip in inventory.chips] == [
        54592, 54592, 54590, 54590, 53395, 53322, 53401, 53401
    ]  # fmt: skip
    assert {chip.hbm_total_mb for chip in inventory.chips} == {65536}
    first = inventory.chips[0]
    assert first.power_w == 96.8
    assert first.temperature_c == 32
    assert first.bus_id == "0000:C1:00.0"
    assert (first.memory_used_mb, first.memory_total_mb) == (0, 0)
    assert (first.device_memory_used_mb, first.device_memory_total_mb) == (54592, 65536)
    assert inventory.chips[7].bus_id == "0000:42:00.0"

    assert len(inventory.processes) == 8
    assert inventory.processes[0] == NpuProcess(0, 0, 277624, "", 51270)
    assert inventory.processes[7] == NpuProcess(7, 0, 1008596, "", 50079)
    assert inventory.processes_on(4, 0) == [NpuProcess(4, 0, 1007953, "", 50080)]


def test_910b3_idle_table_has_no_processes():
    inventory = parse_npu_smi_info(fixture("910b3_x8_idle_25.2.0.txt"))

    assert inventory.driver_version == "25.2.0"
    assert len(inventory.chips) == 8
    assert inventory.processes == []
    assert [chip.power_w for chip in inventory.chips] == [98.2, 96.8, 94.2, 99.9, 92.3, 102.4, 101.6, 98.8]
    assert [chip.temperature_c for chip in inventory.chips] == [41, 41, 41, 42, 45, 46, 45, 47]
    assert inventory.chips[0].hbm_used_mb == 3445
    assert inventory.chips[7].hbm_used_mb == 3411
    assert {chip.aicore_percent for chip in inventory.chips} == {0}


def test_a3_board_two_dies_per_npu_with_phy_ids():
    inventory = parse_npu_smi_info(fixture("ascend910_a3_x8x2_processes_25.3.rc1.txt"))

    assert inventory.driver_version == "25.3.rc1"
    assert inventory.npu_ids == list(range(8))
    assert len(inventory.chips) == 16
    assert [(c.npu_id, c.chip_id, c.device_id) for c in inventory.chips[:4]] == [
        (0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)
    ]  # fmt: skip
    assert inventory.chips[15].device_id == 15
    # The board reports power once per NPU: the second die prints "-".
    assert inventory.chips[0].power_w == 166.9
    assert inventory.chips[1].power_w is None
    assert inventory.chips[1].bus_id == "0000:9F:00.0"
    assert (inventory.chips[1].hbm_used_mb, inventory.chips[1].hbm_total_mb) == (46084, 65536)
    # The table prints the family name with its prefix; it is not doubled.
    assert inventory.chips[0].soc_version == "Ascend910"
    assert inventory.processes == [
        NpuProcess(0, 0, 2173027, "", 43266),
        NpuProcess(0, 1, 2173030, "", 43266),
        NpuProcess(1, 0, 2173031, "", 43266),
        NpuProcess(1, 1, 2173032, "", 43266),
    ]


def test_atlas_300i_duo_cards_two_chips_each_without_hbm():
    inventory = parse_npu_smi_info(fixture("310p3_duo_x2_25.2.0.txt"))

    assert inventory.driver_version == "25.2.0"
    assert inventory.npu_ids == [64, 32832]
    assert [(c.npu_id, c.chip_id, c.device_id) for c in inventory.chips] == [
        (64, 0, 0), (64, 1, 1), (32832, 0, 2), (32832, 1, 3)
    ]  # fmt: skip
    assert {chip.soc_version for chip in inventory.chips} == {"Ascend310P3"}
    assert all(chip.power_w is None for chip in inventory.chips)  # printed as NA
    assert all(chip.hbm_used_mb is None and chip.hbm_total_mb is None for chip in inventory.chips)
    assert [(c.memory_used_mb, c.memory_total_mb) for c in inventory.chips] == [
        (1526, 44280), (1429, 43693), (1623, 44280), (1308, 43693)
    ]  # fmt: skip
    assert (inventory.chips[1].device_memory_used_mb, inventory.chips[1].device_memory_total_mb) == (
        1429,
        43693,
    )
    assert [c.bus_id for c in inventory.chips] == ["0000:03:00.0"] * 2 + ["0000:83:00.0"] * 2
    assert inventory.processes == []


def test_atlas_300i_duo_with_large_npu_id():
    inventory = parse_npu_smi_info(fixture("310p3_duo_npu1792_24.1.rc2.txt"))

    assert inventory.driver_version == "24.1.rc2"
    assert inventory.npu_ids == [1792]
    assert [(c.chip_id, c.memory_used_mb, c.memory_total_mb) for c in inventory.chips] == [
        (0, 1821, 44280),
        (1, 1041, 43693),
    ]
    assert {c.temperature_c for c in inventory.chips} == {36}


def test_older_910a_reports_ddr_beside_hbm():
    inventory = parse_npu_smi_info(fixture("910a_x8_22.0.3.1.txt"))

    assert (inventory.npu_smi_version, inventory.driver_version) == ("22.0.3.1", "22.0.3.1")
    assert len(inventory.chips) == 8
    assert {chip.soc_version for chip in inventory.chips} == {"Ascend910A"}
    chip = inventory.chips[3]
    assert (chip.npu_id, chip.power_w, chip.temperature_c) == (3, 191.7, 42)
    assert (chip.hugepages_used, chip.hugepages_total) == (15, 15)
    assert (chip.memory_used_mb, chip.memory_total_mb) == (1866, 15077)
    assert (chip.hbm_used_mb, chip.hbm_total_mb) == (0, 32768)
    # Models live in HBM, so the DDR figure must not be reported as device memory.
    assert (chip.device_memory_used_mb, chip.device_memory_total_mb) == (0, 32768)
    assert inventory.chips[7].bus_id == "0000:3D:00.0"


def test_atlas_300_inference_card_with_four_310_chips():
    inventory = parse_npu_smi_info(fixture("310_atlas800_3000_21.0.4.txt"))

    # The tool and driver versions differ here: the driver is what the fleet page must show.
    assert (inventory.npu_smi_version, inventory.driver_version) == ("21.0.4", "21.0.4.B030")
    assert inventory.npu_ids == [6]
    assert [(c.chip_id, c.device_id, c.temperature_c) for c in inventory.chips] == [
        (0, 3, 73), (1, 4, 74), (2, 5, 70), (3, 6, 65)
    ]  # fmt: skip
    assert {(c.hugepages_used, c.hugepages_total) for c in inventory.chips} == {(0, 970)}
    assert inventory.chips[0].memory_used_mb == 2703
    assert {c.memory_total_mb for c in inventory.chips} == {8192}
    assert {c.soc_version for c in inventory.chips} == {"Ascend310"}


def test_inventory_to_dict_is_json_with_soc_version():
    inventory = parse_npu_smi_info(fixture("ascend910_a3_x8x2_processes_25.3.rc1.txt"))

    data = json.loads(json.dumps(inventory.to_dict()))

    assert data["driver_version"] == "25.3.rc1"
    assert len(data["chips"]) == 16
    assert data["chips"][1] == {
        "npu_id": 0,
        "chip_id": 1,
        "device_id": 1,
        "name": "Ascend910",
        "health": "OK",
        "power_w": None,
        "temperature_c": 37,
        "hugepages_used": 0,
        "hugepages_total": 0,
        "bus_id": "0000:9F:00.0",
        "aicore_percent": 0,
        "memory_used_mb": 0,
        "memory_total_mb": 0,
        "hbm_used_mb": 46084,
        "hbm_total_mb": 65536,
        "soc_version": "Ascend910",
    }
    assert data["processes"][0] == {
        "npu_id": 0,
        "chip_id": 0,
        "pid": 2173027,
        "name": "",
        "memory_mb": 43266,
        "container_pid": None,
    }


def test_usages_of_a_two_chip_card():
    chips = parse_npu_smi_usages(fixture("usages_310p3_duo.txt"))

    assert [(c.npu_id, c.chip_id) for c in chips] == [(1, 0), (1, 1)]
    assert chips[0].fields["DDR Capacity(MB)"] == "44280"
    assert chips[1].fields["DDR Capacity(MB)"] == "43693"
    assert [c.aicore_percent for c in chips] == [0, 0]
    assert [c.memory_usage_percent for c in chips] == [3, 3]
    assert [c.hbm_usage_percent for c in chips] == [None, None]  # 310P has no HBM
    assert [c.rate("Ctrlcpu Usage Rate(%)") for c in chips] == [2, 3]
    assert chips[0].rate("DDR Bandwidth Usage Rate(%)") == 51
    assert len(chips[0].fields) == 14
    assert json.loads(json.dumps(chips[1].to_dict()))["chip_id"] == 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("hello world\n", r"line 1: not part of an npu-smi table: 'hello world'"),
        ("", "no 'npu-smi <version>  Version: <driver>' header"),
        ("| totally | unrelated |\n", r"line 1: data row before the table header"),
    ],
)
def test_garbage_raises_value_error_naming_the_line(text, expected):
    with pytest.raises(ValueError, match=expected):
        parse_npu_smi_info(text)


def test_unreadable_chip_row_names_its_line_number():
    lines = fixture("910b3_x8_idle_25.2.0.txt").splitlines()
    lines[10] = lines[10].replace("3418 / 65536", "lots of memory")  # line 11: NPU 1's chip row

    with pytest.raises(ValueError, match=r"line 11: expected a chip row .*lots of memory"):
        parse_npu_smi_info("\n".join(lines))


def test_table_cut_after_an_npu_row_is_an_error():
    lines = fixture("910b3_x8_idle_25.2.0.txt").splitlines()

    with pytest.raises(ValueError, match="NPU 0 row has no chip row"):
        parse_npu_smi_info("\n".join(lines[:7]))


def test_usages_garbage_raises_value_error_naming_the_line():
    with pytest.raises(ValueError, match=r"line 2: not a 'key : value' line: 'garbage'"):
        parse_npu_smi_usages("NPU ID : 1\ngarbage\n")
    with pytest.raises(ValueError, match="no 'Chip ID' line"):
        parse_npu_smi_usages(fixture("usages_310p3_duo.txt").rsplit("Chip ID", 1)[0])


def install_fake_npu_smi(directory: Path, *, output: str = "", stderr: str = "", exit_code: int = 0) -> Path:
    """Write an executable ``npu-smi`` that prints ``output`` for ``npu-smi info`` and exits ``exit_code``."""
    (directory / "stdout.txt").write_text(output)
    (directory / "stderr.txt").write_text(stderr)
    script = directory / "npu-smi"
    script.write_text(
        f"#!{sys.executable}\n"
        "import pathlib, sys\n"
        "here = pathlib.Path(__file__).parent\n"
        "assert sys.argv[1:] == ['info'], sys.argv\n"
        "sys.stdout.write((here / 'stdout.txt').read_text())\n"
        "sys.stderr.write((here / 'stderr.txt').read_text())\n"
        f"sys.exit({exit_code})\n"
    )
    script.chmod(0o755)
    return script


def test_read_inventory_runs_npu_smi_from_path(tmp_path, monkeypatch):
    install_fake_npu_smi(tmp_path, output=fixture("310p3_duo_x2_25.2.0.txt"))
    monkeypatch.setenv("PATH", str(tmp_path))

    inventory = read_inventory()

    assert inventory is not None
    assert inventory.driver_version == "25.2.0"
    assert inventory.npu_ids == [64, 32832]
    assert len(inventory.chips) == 4


def test_read_inventory_returns_none_without_npu_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: a CPU-only host

    assert read_inventory() is None


def test_read_inventory_reports_a_failing_npu_smi(tmp_path, monkeypatch):
    install_fake_npu_smi(tmp_path, stderr="simulated driver failure\n", exit_code=3)
    monkeypatch.setenv("PATH", str(tmp_path))

    with pytest.raises(NpuSmiError, match="exited with status 3: simulated driver failure"):
        read_inventory()


def test_read_inventory_reports_a_hanging_npu_smi(tmp_path, monkeypatch):
    install_fake_npu_smi(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))
    seen = {}

    def hanging_runner(args, **kwargs):
        seen.update(kwargs, args=args)
        raise subprocess.TimeoutExpired(args, kwargs["timeout"])

    with pytest.raises(NpuSmiError, match="did not finish within 2.5 s"):
        read_inventory(runner=hanging_runner, timeout=2.5)
    assert seen["args"] == [str(tmp_path / "npu-smi"), "info"]
    assert seen["timeout"] == 2.5


def test_read_inventory_rejects_unreadable_output(tmp_path, monkeypatch):
    install_fake_npu_smi(tmp_path, output="hello world\n")
    monkeypatch.setenv("PATH", str(tmp_path))

    with pytest.raises(ValueError, match="line 1"):
        read_inventory()
