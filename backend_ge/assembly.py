"""The tree a tritonserver runs from: binary, libraries, backends and the python stubs' environment.

Everything comes from the PyPI package ``nvidia-pytriton`` and this interpreter's site-packages, but it is
laid out under one directory of its own (hard links, or copies across filesystems), owned by whoever
assembles it and readable by everyone. A server that runs as an unprivileged user therefore never needs
the platform's virtualenv, its interpreter or the source checkout - which may sit under a home or temp
directory nobody else can enter. Layout::

    <root>/tritonserver/bin/tritonserver
    <root>/tritonserver/lib/           nvidia_pytriton.libs (on LD_LIBRARY_PATH)
    <root>/backends/python/            libtriton_python.so, triton_python_backend_utils.py, the stub
    <root>/backends/ge/model.py
    <root>/python/                     a virtualenv for the stubs: pyvenv.cfg, bin/python3,
                                       lib/python3.X/site-packages (numpy, onnxruntime, backend_ge, ...)

Why a virtualenv: the stub embeds the interpreter of the ``libpython`` it links (Debian's), in isolated
mode, and finds its prefix through the first ``python3`` on ``PATH``. Putting ``<root>/python/bin`` first
makes that prefix this tree, whose ``pyvenv.cfg`` names the base interpreter that matches the linked
``libpython`` (its standard library), and whose site-packages holds exactly what a stub imports.
"""

from __future__ import annotations

import compileall
import importlib.metadata as metadata
import os
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent
# What a stub imports, with their requirements (extras left out).
STUB_DISTRIBUTIONS = ("numpy", "onnxruntime")
_PY = f"python{sys.version_info.major}.{sys.version_info.minor}"


class TritonError(RuntimeError):
    """tritonserver could not be started, answered with an error, or did not stop."""


class AssemblyError(TritonError):
    """The tritonserver tree could not be put together."""


@dataclass(frozen=True)
class TritonDistribution:
    """Where the pieces of the tritonserver bundled in nvidia-pytriton live."""

    binary: Path
    python_backend: Path  # holds libtriton_python.so and triton_python_backend_utils.py
    stub: Path
    libs: Path  # nvidia_pytriton.libs: shared libraries the binary needs on LD_LIBRARY_PATH

    @classmethod
    def find(cls) -> TritonDistribution:
        """Locate the distribution in the running interpreter's site-packages."""
        site = Path(sysconfig.get_paths()["purelib"])
        root = site / "pytriton" / "tritonserver"
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        dist = cls(
            binary=root / "bin" / "tritonserver",
            python_backend=root / "backends" / "python",
            stub=root / "python_backend_stubs" / version / "triton_python_backend_stub",
            libs=site / "nvidia_pytriton.libs",
        )
        missing = [p for p in (dist.binary, dist.python_backend, dist.stub, dist.libs) if not p.exists()]
        if missing:
            raise AssemblyError(
                "tritonserver from nvidia-pytriton is incomplete for Python "
                f"{version}: missing {', '.join(map(str, missing))}"
            )
        return dist


@dataclass(frozen=True)
class TritonRuntime:
    """An assembled tree (see the module docstring)."""

    root: Path

    @property
    def binary(self) -> Path:
        return self.root / "tritonserver" / "bin" / "tritonserver"

    @property
    def libs(self) -> Path:
        return self.root / "tritonserver" / "lib"

    @property
    def backends(self) -> Path:
        return self.root / "backends"

    @property
    def python(self) -> Path:
        """The stubs' virtualenv."""
        return self.root / "python"

    @property
    def python_bin(self) -> Path:
        return self.python / "bin"

    @property
    def site_packages(self) -> Path:
        return self.python / "lib" / _PY / "site-packages"


def _mkdir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o755)  # whatever the umask: servers may run as another user


def _mirror(src: Path, dst: Path) -> None:
    """``dst`` becomes ``src`` (a hard link when possible, else a copy); unchanged files are left alone."""
    if dst.exists() or dst.is_symlink():
        try:
            if os.path.samefile(src, dst):
                return
        except OSError:
            pass
        s, d = src.stat(), dst.lstat()
        if stat.S_ISREG(d.st_mode) and d.st_size == s.st_size and d.st_mtime >= s.st_mtime:
            return
    _mkdir(dst.parent)
    tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:  # another filesystem, or links not allowed
        shutil.copy2(src, tmp)
    # A file another user could not read would fail only when a stub imports it: make it readable now.
    mode = tmp.stat().st_mode
    if mode & 0o444 != 0o444:
        tmp.chmod(stat.S_IMODE(mode) | 0o444 | (0o111 if mode & 0o100 else 0))
    # rename keeps a running server that already mapped the old file safe
    os.replace(tmp, dst)


def _mirror_tree(src: Path, dst: Path, *, skip=lambda path: False) -> None:
    _mkdir(dst)
    for entry in sorted(src.iterdir()):
        if entry.name == "__pycache__" or skip(entry):
            continue
        if entry.is_dir() and not entry.is_symlink():
            _mirror_tree(entry, dst / entry.name, skip=skip)
        elif entry.is_file():
            _mirror(entry, dst / entry.name)


def assemble_backends(target: Path, dist: TritonDistribution | None = None) -> Path:
    """Write ``<target>/python/`` (library, utils, stub) and ``<target>/ge/model.py``; return target."""
    dist = dist or TritonDistribution.find()
    _mkdir(target / "python")
    _mkdir(target / "ge")
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        _mirror(dist.python_backend / name, target / "python" / name)
    _mirror(dist.stub, target / "python" / "triton_python_backend_stub")
    _mirror(_PACKAGE_DIR / "model.py", target / "ge" / "model.py")
    return target


def _distribution_closure(roots: tuple[str, ...]) -> list[metadata.Distribution]:
    from packaging.requirements import Requirement

    seen: dict[str, metadata.Distribution] = {}
    pending = list(roots)
    while pending:
        name = re.sub(r"[-_.]+", "-", pending.pop()).lower()
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            if name in roots:
                continue  # e.g. no onnxruntime on an NPU-only host
            raise AssemblyError(f"{name}, which the python stubs need, is not installed") from None
        seen[name] = dist
        for text in dist.requires or ():
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                pending.append(req.name)
    return list(seen.values())


def _mirror_distributions(site: Path, roots: tuple[str, ...]) -> None:
    for dist in _distribution_closure(roots):
        for relative in dist.files or ():
            if ".." in relative.parts or relative.is_absolute():
                continue  # console scripts outside site-packages
            src = Path(dist.locate_file(relative))
            if src.is_file():
                _mirror(src, site / relative)


def stub_libpython(stub: Path, env: dict[str, str]) -> Path:
    """The ``libpython`` the python backend stub loads (resolved like the dynamic linker does)."""
    try:
        out = subprocess.run(["ldd", str(stub)], env=env, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise AssemblyError(f"cannot inspect the python backend stub with ldd: {exc}") from None
    match = re.search(r"^\s*libpython\S*\s+=>\s+(\S+)", out, re.MULTILINE)
    if not match or not Path(match.group(1)).exists():
        raise AssemblyError(
            f"the python backend stub needs a libpython{sys.version_info.major}.{sys.version_info.minor} "
            f"this host does not have (install the distribution's libpython package):\n{out.strip()}"
        )
    return Path(match.group(1)).resolve()


def base_interpreter(libpython: Path) -> Path:
    """The interpreter whose standard library matches ``libpython``: ``<prefix>/bin/pythonX.Y`` for the
    closest ``<prefix>`` above the library that has ``lib/pythonX.Y/os.py``."""
    for prefix in libpython.parents:
        if (prefix / "lib" / _PY / "os.py").is_file() and (prefix / "bin" / _PY).is_file():
            return prefix / "bin" / _PY
    raise AssemblyError(f"no {_PY} interpreter with a standard library found for {libpython}")


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(text)
        tmp.chmod(0o644)
        os.replace(tmp, path)


def _assemble_python(runtime: TritonRuntime, dist: TritonDistribution) -> None:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(dist.libs), env.get("LD_LIBRARY_PATH")) if p)
    base = base_interpreter(stub_libpython(dist.stub, env))
    _mkdir(runtime.python_bin)
    _mkdir(runtime.site_packages)
    _write_if_changed(
        runtime.python / "pyvenv.cfg", f"home = {base.parent}\ninclude-system-site-packages = false\n"
    )
    for name in ("python", "python3", _PY):
        link = runtime.python_bin / name
        if not (link.is_symlink() and os.readlink(link) == str(base)):
            link.unlink(missing_ok=True)
            link.symlink_to(base)
    _mirror_distributions(runtime.site_packages, STUB_DISTRIBUTIONS)
    # backend_ge itself, without the recorded test fixtures; compiled here because a server that runs as
    # another user cannot write its __pycache__.
    _mirror_tree(_PACKAGE_DIR, runtime.site_packages / "backend_ge", skip=lambda p: p.name == "fakes")
    compileall.compile_dir(runtime.site_packages / "backend_ge", quiet=1)
    for pycache in (runtime.site_packages / "backend_ge").rglob("__pycache__"):
        pycache.chmod(0o755)
        for pyc in pycache.iterdir():
            pyc.chmod(0o644)


def assemble_runtime(target: str | os.PathLike, dist: TritonDistribution | None = None) -> TritonRuntime:
    """Lay out (or bring up to date) the tree under ``target``; cheap when nothing changed."""
    dist = dist or TritonDistribution.find()
    runtime = TritonRuntime(Path(target))
    _mkdir(runtime.root)
    _mirror(dist.binary, runtime.binary)
    _mirror_tree(dist.libs, runtime.libs)
    assemble_backends(runtime.backends, dist)
    _assemble_python(runtime, dist)
    return runtime
