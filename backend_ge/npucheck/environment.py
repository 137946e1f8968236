"""What ``npu-check`` needs from the host, found the way the serving path finds it, and what is missing.

Each missing prerequisite becomes one line that says what to do. The CANN toolkit version comes from the
``ascend_toolkit_install.info`` its installer writes into ``<toolkit>/<arch>-linux/`` (``version=...``);
``set_env.sh`` exports the toolkit directory as ``ASCEND_TOOLKIT_HOME`` and ``ASCEND_HOME_PATH``.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from backend_ge import fakes, npu_smi
from backend_ge.fakes import FAKE_HOST_CANN_INFO, FAKE_HOST_NPU_SMI

SET_ENV = "/usr/local/Ascend/ascend-toolkit/set_env.sh"
TOOLKIT_ENV = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
INSTALL_INFO = "ascend_toolkit_install.info"

# Run in the Python that serves models: is `acl` importable, and is it pyACL (not PyPI's unrelated `acl`)?
_ACL_PROBE = """
import json, sys
try:
    import acl
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
    sys.exit(0)
print(json.dumps({"file": getattr(acl, "__file__", None), "fake": bool(getattr(acl, "FAKE", False)),
                  "pyacl": all(hasattr(acl, a) for a in ("init", "rt", "mdl"))}))
"""


@dataclass
class Environment:
    """The host as npu-check sees it; ``missing`` lists what keeps the check from running."""

    python: str
    atc: str | None = None
    cann_version: str | None = None
    cann_info: str | None = None
    npu_smi: str | None = None
    npu_smi_version: str | None = None
    driver_version: str | None = None
    chips: list[dict] = field(default_factory=list)
    device: int = 0
    device_chip: dict | None = None
    soc_version: str = ""
    acl_module: str | None = None
    acl_fake: bool = False
    triton: str | None = None
    missing: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        chip = self.device_chip or {}
        names = sorted({c["name"] for c in self.chips})
        memory = ""
        if chip:
            used, total = _device_memory(chip)
            memory = f", {'HBM' if chip.get('hbm_total_mb') else 'memory'} {used}/{total} MB"
        return (
            f"CANN {self.cann_version or 'version unknown'}, driver {self.driver_version or '?'}, "
            f"{len(self.chips)} x {'/'.join(names) or '?'} (device {self.device}: {chip.get('health', '?')}"
            f"{memory}), soc {self.soc_version or '?'}, acl from {self.acl_module or '?'}"
        )


def _device_memory(chip: Mapping) -> tuple[int, int]:
    if chip.get("hbm_total_mb"):
        return chip["hbm_used_mb"], chip["hbm_total_mb"]
    return chip["memory_used_mb"], chip["memory_total_mb"]


def chip_for_device(chips: list[npu_smi.NpuChip], device: int) -> npu_smi.NpuChip | None:
    """The chip pyACL calls ``device``: the one whose Device column says so (310P), else the n-th chip."""
    for chip in chips:
        if chip.device_id == device:
            return chip
    return chips[device] if 0 <= device < len(chips) else None


def find_cann_version(atc: str | None, env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(version, info file) from the toolkit's install info, looked up from set_env.sh's variables or atc."""
    roots = [Path(env[k]) for k in TOOLKIT_ENV if env.get(k)]
    if atc:
        roots += list(Path(atc).resolve().parents)[:4]
    arch = f"{platform.machine()}-linux"
    for root in roots:
        candidates = [
            root / arch / INSTALL_INFO,
            root / INSTALL_INFO,
            *sorted(root.glob(f"*-linux/{INSTALL_INFO}")),
        ]
        for info in candidates:
            if info.is_file():
                fields = dict(
                    line.split("=", 1)
                    for line in info.read_text(errors="replace").splitlines()
                    if "=" in line
                )
                if fields.get("version"):
                    return fields["version"].strip(), str(info)
    return None, None


def probe_acl(env: Mapping[str, str] | None = None, python: str = sys.executable) -> dict:
    """Import ``acl`` in a fresh ``python`` with the environment tritonserver's stubs will get."""
    try:
        done = subprocess.run(
            [python, "-c", _ACL_PROBE],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(env or os.environ),
        )
    except subprocess.TimeoutExpired:
        return {"error": "importing acl did not finish within 120 s"}
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]}


def probe(device: int = 0, soc_version: str = "") -> Environment:
    """Look at this host with the current environment (PATH, set_env.sh's variables, PYTHONPATH)."""
    found = Environment(python=sys.executable, device=device)
    found.atc = shutil.which("atc")
    if not found.atc:
        found.missing.append(
            f"atc: not on PATH - install the CANN toolkit and source its set_env.sh (e.g. {SET_ENV})"
        )
    found.cann_version, found.cann_info = find_cann_version(found.atc, os.environ)
    if found.atc and not found.cann_version:
        found.notes.append(f"no {INSTALL_INFO} found under ${'/$'.join(TOOLKIT_ENV)} or next to atc")

    _probe_npus(found, soc_version)

    acl = probe_acl()
    if "error" in acl:
        found.missing.append(
            f"pyACL: `import acl` fails in {sys.executable} ({acl['error']}) - source CANN's set_env.sh "
            "before starting; never `pip install acl` (that PyPI package is unrelated)"
        )
    elif not acl.get("pyacl"):
        found.missing.append(
            f"pyACL: the `acl` imported from {acl.get('file')} is not pyACL (no acl.init/rt/mdl) - it is "
            "probably PyPI's unrelated `acl`: pip uninstall acl, then source CANN's set_env.sh"
        )
    else:
        found.acl_module, found.acl_fake = acl.get("file"), acl.get("fake", False)

    from backend_ge.runtime import TritonDistribution, TritonError

    try:
        found.triton = str(TritonDistribution.find().binary)
    except TritonError as exc:
        found.missing.append(f"tritonserver: {exc} - reinstall nvidia-pytriton (make install)")
    return found


def _probe_npus(found: Environment, soc_version: str) -> None:
    try:
        inventory = npu_smi.read_inventory()
    except (npu_smi.NpuSmiError, ValueError) as exc:
        found.npu_smi = shutil.which("npu-smi")
        found.missing.append(f"npu-smi: {exc} - check the Ascend driver (dmesg, /dev/davinci*)")
        return
    if inventory is None:
        found.missing.append("npu-smi: not on PATH - install the Ascend NPU driver (npu-smi ships with it)")
        found.soc_version = soc_version
        return
    found.npu_smi = shutil.which("npu-smi")
    found.npu_smi_version, found.driver_version = inventory.npu_smi_version, inventory.driver_version
    found.chips = [chip.to_dict() for chip in inventory.chips]
    chip = chip_for_device(inventory.chips, found.device)
    if chip is None:
        found.missing.append(
            f"NPU device {found.device}: npu-smi lists {len(inventory.chips)} chip(s) - choose --device "
            f"0..{len(inventory.chips) - 1}"
        )
        found.soc_version = soc_version
        return
    found.device_chip = chip.to_dict()
    if not chip.healthy:
        found.missing.append(
            f"NPU device {found.device}: health is {chip.health}, not OK - see `npu-smi info -t health "
            f"-i {chip.npu_id}`"
        )
    found.soc_version = soc_version or chip.soc_version
    if soc_version and soc_version != chip.soc_version:
        found.notes.append(f"--soc-version {soc_version} differs from npu-smi's {chip.soc_version}")
    if not soc_version and chip.name.startswith("Ascend"):
        found.missing.append(
            f"soc version: npu-smi names the chip {chip.name!r}, a family rather than a SoC - pass "
            "--soc-version with the exact SoC (see CANN's documentation for this board)"
        )


@contextlib.contextmanager
def fake_host(workdir: Path, atc_by_model: Mapping[str, str] | None = None) -> Iterator[dict[str, str]]:
    """The project's fakes in place of CANN for the duration: fake ``atc``/``npu-smi`` first on PATH, the
    ``acl`` shim on PYTHONPATH, a toolkit directory holding a recorded install info, ``GE_FAKES=1``."""
    bindir = workdir / "fake-bin"
    fakes.install_tools(bindir)
    toolkit = workdir / "fake-cann" / "ascend-toolkit" / "latest"
    (toolkit / "aarch64-linux").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(fakes.CANN_RECORDINGS / FAKE_HOST_CANN_INFO, toolkit / "aarch64-linux" / INSTALL_INFO)
    overrides = {
        fakes.ENV_FLAG: "1",
        "PATH": os.pathsep.join([str(bindir), os.environ.get("PATH", "")]),
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(fakes.SHIM_DIR), os.environ.get("PYTHONPATH", "")) if p
        ),
        "ASCEND_TOOLKIT_HOME": str(toolkit),
        "ASCEND_HOME_PATH": str(toolkit),
        "FAKE_ATC_OM": "pyacl",
        "FAKE_ATC_BY_MODEL": json.dumps(dict(atc_by_model or {})),
        "FAKE_NPU_SMI_TABLE": FAKE_HOST_NPU_SMI,
    }
    saved = {key: os.environ.get(key) for key in overrides}
    os.environ.update(overrides)
    try:
        yield overrides
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
