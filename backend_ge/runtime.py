"""Launch and control a real ``tritonserver`` with the GE backend, without docker or Django.

The server binary, the python backend library, its utils and the stub all come from the PyPI package
``nvidia-pytriton``; :func:`assemble_backends` lays them out the way Triton expects and adds
``<backends>/ge/model.py``. :class:`TritonServer` starts the binary with explicit model control, loopback
binding and the repository API restricted by a key the caller holds, and is what the host agent uses.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

REPOSITORY_KEY_HEADER = "x-ge-repository-key"
_PACKAGE_DIR = Path(__file__).resolve().parent


class TritonError(RuntimeError):
    """tritonserver could not be started, answered with an error, or did not stop."""


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
            raise TritonError(
                "tritonserver from nvidia-pytriton is incomplete for Python "
                f"{version}: missing {', '.join(map(str, missing))}"
            )
        return dist


def _copy_if_changed(src: Path, dst: Path) -> None:
    if (
        dst.exists()
        and dst.stat().st_size == src.stat().st_size
        and dst.stat().st_mtime >= src.stat().st_mtime
    ):
        return
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copy2(src, tmp)
    # rename keeps a running server that already mapped the old file safe
    os.replace(tmp, dst)


def assemble_backends(target: Path, dist: TritonDistribution | None = None) -> Path:
    """Write ``<target>/python/`` (library, utils, stub) and ``<target>/ge/model.py``; return target."""
    dist = dist or TritonDistribution.find()
    python_dir = target / "python"
    ge_dir = target / "ge"
    python_dir.mkdir(parents=True, exist_ok=True)
    ge_dir.mkdir(parents=True, exist_ok=True)
    _copy_if_changed(dist.python_backend / "libtriton_python.so", python_dir / "libtriton_python.so")
    _copy_if_changed(
        dist.python_backend / "triton_python_backend_utils.py", python_dir / "triton_python_backend_utils.py"
    )
    _copy_if_changed(dist.stub, python_dir / "triton_python_backend_stub")
    _copy_if_changed(_PACKAGE_DIR / "model.py", ge_dir / "model.py")
    return target


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free right now (another process may still take it before us)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_environment(dist: TritonDistribution, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver and the python stubs it spawns."""
    env = dict(os.environ if base is None else base)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(dist.libs), env.get("LD_LIBRARY_PATH", "")) if p)
    # The stub's embedded interpreter finds site-packages through the first `python` on PATH; without the
    # venv's bin first it fails with "No module named numpy".
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in (venv_bin, env.get("PATH", "")) if p)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE_DIR.parent), env.get("PYTHONPATH", "")) if p)
    return env


def _interrupt_when_parent_dies() -> None:
    # Linux delivers the signal when the thread that started the child exits: a killed launcher then
    # still stops its server gracefully instead of leaving it running with nobody holding the key.
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGINT)


class TritonServer:
    """One tritonserver process serving a model repository with the GE backend.

    Models are loaded explicitly (``load_model``) or with ``load_models`` at start. Inference is open on the
    HTTP/gRPC ports; the model-repository API needs the ``repository_key`` in the ``REPOSITORY_KEY_HEADER``
    header, so only the holder of the key can load or unload models.

    ``die_with_parent`` asks Linux to SIGINT the server when the *thread* that called ``start()`` ends; use
    it from a main thread (CLI, tests), not from a short-lived worker thread.
    """

    def __init__(
        self,
        model_repository: str | os.PathLike,
        *,
        workdir: str | os.PathLike | None = None,
        address: str = "127.0.0.1",
        http_port: int = 0,
        grpc_port: int = 0,
        metrics_port: int = 0,
        repository_key: str | None = None,
        load_models: Sequence[str] = (),
        backend_config: Sequence[str] = (),
        extra_args: Sequence[str] = (),
        exit_timeout: int = 30,
        die_with_parent: bool = False,
    ) -> None:
        self.model_repository = Path(model_repository).resolve()
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="ge-triton-"))
        self.address = address
        self.http_port = http_port or free_port(address)
        self.grpc_port = grpc_port or free_port(address)
        self.metrics_port = metrics_port or free_port(address)
        self.repository_key = repository_key or secrets.token_urlsafe(24)
        self.load_models = list(load_models)
        self.backend_config = list(backend_config)
        self.extra_args = list(extra_args)
        self.exit_timeout = exit_timeout
        self.die_with_parent = die_with_parent
        self.log_path = self.workdir / "tritonserver.log"
        self.process: subprocess.Popen | None = None

    # -- addresses -------------------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        """``host:port`` as tritonclient.http expects it."""
        return f"{self.address}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.address}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.address}:{self.metrics_port}/metrics"

    def command(self, backends: Path) -> list[str]:
        """The tritonserver command line (without the binary path's environment)."""
        key = f"{REPOSITORY_KEY_HEADER}={self.repository_key}"
        cmd = [
            "--model-repository",
            str(self.model_repository),
            "--model-control-mode=explicit",
            f"--backend-directory={backends}",
            f"--http-address={self.address}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.address}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.address}",
            f"--metrics-port={self.metrics_port}",
            f"--http-restricted-api=model-repository:{key}",
            f"--grpc-restricted-protocol=model-repository:{key}",
            f"--exit-timeout-secs={self.exit_timeout}",
            "--allow-gpu-metrics=false",
            "--log-verbose=0",
        ]
        cmd += [f"--load-model={name}" for name in self.load_models]
        cmd += [f"--backend-config={item}" for item in self.backend_config]
        return cmd + self.extra_args

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> TritonServer:
        """Start the process and wait until it is live (and ready, when models were named at start)."""
        if self.process is not None and self.process.poll() is None:
            return self
        dist = TritonDistribution.find()
        backends = assemble_backends(self.workdir / "backends", dist)
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps writing to it after we return
        try:
            self.process = subprocess.Popen(
                [str(dist.binary), *self.command(backends)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=server_environment(dist),
                cwd=self.workdir,
                # Own process group: a Ctrl-C in the caller's terminal is handled by stop(), which lets
                # in-flight requests finish instead of the server and the caller racing each other.
                start_new_session=True,
                preexec_fn=_interrupt_when_parent_dies if self.die_with_parent else None,
            )
        finally:
            log.close()
        self._wait_until(self.is_ready if self.load_models else self.is_live, timeout, "live")
        return self

    def _wait_until(self, check, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise TritonError(
                    f"tritonserver exited with code {self.process.returncode} before becoming {what}:\n"
                    + self.log_tail()
                )
            if check():
                return
            time.sleep(0.1)
        raise TritonError(f"tritonserver did not become {what} within {timeout:.0f}s:\n" + self.log_tail())

    def stop(self, timeout: float | None = None) -> int | None:
        """Ask the server to exit (SIGINT: in-flight requests finish); SIGKILL only after ``timeout``."""
        proc = self.process
        if proc is None:
            return None
        timeout = self.exit_timeout + 5 if timeout is None else timeout
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        return proc.returncode

    def close(self) -> None:
        """Stop the server and remove a work directory this object created."""
        self.stop()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    # -- HTTP API --------------------------------------------------------------------------------------
    def _request(
        self, method: str, path: str, body: dict | None = None, *, key: bool = False, timeout: float = 10.0
    ) -> tuple[int, dict]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://{self.http_url}{path}", data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if key:
            req.add_header(REPOSITORY_KEY_HEADER, self.repository_key)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
                status = resp.status
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return 0, {}
        try:
            return status, json.loads(raw) if raw else {}
        except ValueError:
            return status, {"error": raw.decode(errors="replace")}

    def is_live(self) -> bool:
        return self._request("GET", "/v2/health/live", timeout=2)[0] == 200

    def is_ready(self) -> bool:
        return self._request("GET", "/v2/health/ready", timeout=2)[0] == 200

    def is_model_ready(self, name: str, version: str = "") -> bool:
        path = f"/v2/models/{name}" + (f"/versions/{version}" if version else "") + "/ready"
        return self._request("GET", path, timeout=2)[0] == 200

    def load_model(self, name: str, config: dict | str | None = None, timeout: float = 300.0) -> None:
        """Load (or reload) a model from the repository; raise with Triton's message on failure.

        ``config`` overrides the repository's config.pbtxt (Triton takes it as JSON).
        """
        body: dict = {}
        if config is not None:
            body["parameters"] = {"config": config if isinstance(config, str) else json.dumps(config)}
        status, reply = self._request(
            "POST", f"/v2/repository/models/{name}/load", body, key=True, timeout=timeout
        )
        if status != 200:
            raise TritonError(f"loading model {name!r} failed ({status}): {reply.get('error', reply)}")

    def unload_model(self, name: str, *, dependents: bool = False, timeout: float = 60.0) -> None:
        body = {"parameters": {"unload_dependents": dependents}}
        status, reply = self._request(
            "POST", f"/v2/repository/models/{name}/unload", body, key=True, timeout=timeout
        )
        if status != 200:
            raise TritonError(f"unloading model {name!r} failed ({status}): {reply.get('error', reply)}")

    def repository_index(self) -> list[dict]:
        """Every model in the repository with its state (READY, UNAVAILABLE + reason, ...)."""
        status, reply = self._request("POST", "/v2/repository/index", {}, key=True)
        if status != 200:
            raise TritonError(f"repository index failed ({status}): {reply}")
        return reply if isinstance(reply, list) else []

    def model_statistics(self, name: str = "") -> list[dict]:
        """``model_stats`` entries from the statistics API (all models when ``name`` is empty)."""
        path = f"/v2/models/{name}/stats" if name else "/v2/models/stats"
        status, reply = self._request("GET", path)
        if status != 200:
            raise TritonError(f"statistics for {name or 'all models'} failed ({status}): {reply}")
        return reply.get("model_stats", [])


def prepare_repository(
    source: str | os.PathLike, target: str | os.PathLike
) -> tuple[list[str], dict[str, str]]:
    """Write a servable copy of ``source`` into ``target``: normalized configs, linked version directories.

    Seed-style configs (``platform: "graph_executor"``, top-level ``step`` blocks) are rewritten for the GE
    backend; a model directory without ``config.pbtxt`` gets ``backend: "ge"`` and is completed from its
    model file at load time. Returns ``(models, {model: problem})`` for directories that could not be used.
    """
    from backend_ge import config as ge_config  # protobuf and tritonclient: only needed here

    source, target = Path(source).resolve(), Path(target)
    if not source.is_dir():
        raise TritonError(f"model repository {source} is not a directory")
    target.mkdir(parents=True, exist_ok=True)
    models: list[str] = []
    problems: dict[str, str] = {}
    for model_dir in sorted(p for p in source.iterdir() if p.is_dir() and not p.name.startswith(".")):
        name = model_dir.name
        config_file = model_dir / "config.pbtxt"
        if config_file.is_file():
            try:
                cfg = ge_config.normalize_config(ge_config.parse_config(config_file.read_text()))
            except ValueError as e:
                problems[name] = f"{config_file}: {e}"
                continue
            if cfg.name and cfg.name != name:
                problems[name] = f"{config_file}: name {cfg.name!r} differs from its directory {name!r}"
                continue
            text = ge_config.render_config(cfg)
        else:
            text = f'name: "{name}"\nbackend: "ge"\n'
        out = target / name
        if out.is_symlink() or out.is_file():
            out.unlink()
        elif out.exists():
            shutil.rmtree(out)
        out.mkdir()
        for entry in model_dir.iterdir():
            if entry.name != "config.pbtxt":
                (out / entry.name).symlink_to(entry)
        (out / "config.pbtxt").write_text(text)
        models.append(name)
    return models, problems


def model_load_order(repository: str | os.PathLike, names: Iterable[str]) -> list[list[str]]:
    """Models grouped so that every ensemble comes after the models it chains."""
    plain, ensembles = [], []
    for name in names:
        config_file = Path(repository) / name / "config.pbtxt"
        text = config_file.read_text() if config_file.is_file() else ""
        (ensembles if '"ensemble"' in text else plain).append(name)
    return [group for group in (plain, ensembles) if group]


def load_all(server: TritonServer, names: Iterable[str], parallel: int = 4) -> dict[str, str]:
    """Load models (ensembles last), ``parallel`` at a time; return ``{name: error}`` for failures."""
    from concurrent.futures import ThreadPoolExecutor

    failures: dict[str, str] = {}

    def load(name: str) -> None:
        try:
            server.load_model(name)
        except TritonError as e:
            failures[name] = str(e)

    for group in model_load_order(server.model_repository, names):
        with ThreadPoolExecutor(max_workers=parallel) as pool:
            list(pool.map(load, group))
    return failures
