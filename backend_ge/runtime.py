"""Launch and control a real ``tritonserver`` with the GE backend, without docker or Django.

The server runs from a tree :func:`backend_ge.assembly.assemble_runtime` lays out (binary, libraries,
backends, the python stubs' environment). :class:`TritonServer` starts it with explicit model control,
loopback binding and every API but the open ones (health, inference, metadata, statistics by default)
restricted to a key the caller holds, optionally as another (unprivileged) user; it is what the host agent
uses.
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
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from backend_ge.assembly import (
    AssemblyError,
    TritonDistribution,
    TritonError,
    TritonRuntime,
    assemble_backends,
    assemble_runtime,
)
from backend_ge.sandbox import ServerUser, become

__all__ = [
    "API_KEY_HEADER",
    "DEFAULT_OPEN_APIS",
    "GRPC_API_KEY_HEADER",
    "REPOSITORY_KEY_HEADER",
    "TRITON_APIS",
    "AssemblyError",
    "TritonDistribution",
    "TritonError",
    "TritonRuntime",
    "TritonServer",
    "assemble_backends",
    "assemble_runtime",
]

# Triton's API groups, as --http-restricted-api and --grpc-restricted-protocol name them.
TRITON_APIS = (
    "health",
    "metadata",
    "inference",
    "shared-memory",
    "model-config",
    "model-repository",
    "statistics",
    "trace",
    "logging",
)
# What stays open on an instance for now; every other group needs the instance key.
DEFAULT_OPEN_APIS = ("health", "inference", "metadata", "statistics")
# The header that carries the instance key over HTTP. Over gRPC Triton reads the metadata key
# ``triton-grpc-protocol-<header>`` instead (lower case: gRPC metadata keys are).
API_KEY_HEADER = "x-ge-instance-key"
GRPC_API_KEY_HEADER = f"triton-grpc-protocol-{API_KEY_HEADER}"
REPOSITORY_KEY_HEADER = API_KEY_HEADER  # the name it had when only the repository API was restricted
# tritonserver's own default ports (HTTP, gRPC, metrics): `python -m backend_ge serve` and `bench` use them.
DEFAULT_HTTP_PORT, DEFAULT_GRPC_PORT, DEFAULT_METRICS_PORT = 8000, 8001, 8002
_PACKAGE_DIR = Path(__file__).resolve().parent

# Environment variables a server (and so every python stub) inherits; anything else - database URLs,
# broker passwords, the platform's secret key - stays with the caller.
_ENV_NAMES = frozenset({"PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "LANG", "LANGUAGE", "TZ", "TMPDIR"})
_ENV_PREFIXES = ("LC_", "ASCEND_", "TOOLCHAIN_", "NPU_", "OMP_", "ORT_", "GE_")
_ENV_SECRETS = frozenset({"GE_REPOSITORY_KEY"})


# Ports free_port() handed out lately in this process (bounded: a long-lived caller does not grow it).
_HANDED_OUT: deque[int] = deque(maxlen=4096)
_HANDED_OUT_LOCK = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free right now and that this process has not handed out lately.

    The kernel picks a random free port and may pick the same one again once the probing socket is closed:
    three calls in a row repeated a port in 11 of 30,000 tries here, e.g. a gateway's inference and stats
    ports, which HAProxy then bound twice (SO_REUSEPORT) and answered some inference connections from the
    stats frontend. Another process may still take the port before the caller binds it.
    """
    with _HANDED_OUT_LOCK:
        for _ in range(100):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _HANDED_OUT:
                _HANDED_OUT.append(port)
                return port
    raise OSError(f"no port on {host} that was not handed out already")


def server_environment(
    runtime: TritonRuntime,
    base: Mapping[str, str] | None = None,
    *,
    home: Path | None = None,
    include_checkout: bool = True,
) -> dict[str, str]:
    """Environment for tritonserver and the python stubs it spawns: an allow-list of ``base`` (default:
    this process's environment) plus the runtime tree's libraries and python first."""
    source = os.environ if base is None else base
    env = {
        k: v
        for k, v in source.items()
        if (k in _ENV_NAMES or k.startswith(_ENV_PREFIXES)) and k not in _ENV_SECRETS
    }
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(runtime.libs), env.get("LD_LIBRARY_PATH")) if p)
    # The stub's embedded interpreter takes its prefix from the first `python3` on PATH: the runtime's
    # virtualenv, which holds numpy, onnxruntime and backend_ge.
    env["PATH"] = os.pathsep.join(p for p in (str(runtime.python_bin), env.get("PATH") or os.defpath) if p)
    # Read by backend_ge/model.py (the stub ignores PYTHONPATH): a source checkout's tests and pyACL from
    # CANN's set_env.sh are found this way; a directory the server's user cannot enter is skipped. A
    # server run as another user imports backend_ge from the runtime tree only, not from the checkout.
    checkout = str(_PACKAGE_DIR.parent) if include_checkout else ""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), checkout) if p)
    if not env["PYTHONPATH"]:
        del env["PYTHONPATH"]
    if home is not None:
        env["HOME"] = str(home)
    return env


def _interrupt_when_parent_dies() -> None:
    # Linux delivers the signal when the thread that started the child exits: a killed launcher then
    # still stops its server gracefully instead of leaving it running with nobody holding the key.
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGINT)


class TritonServer:
    """One tritonserver process serving a model repository with the GE backend.

    Models are loaded explicitly (``load_model``) or with ``load_models`` at start. The API groups in
    ``open_apis`` (see :data:`TRITON_APIS`) answer anyone who reaches the ports; every other group -
    repository (load/unload), model config, logging, trace, shared memory - needs ``api_key`` in the
    :data:`API_KEY_HEADER` header (gRPC: :data:`GRPC_API_KEY_HEADER`). This object sends it on every call.

    ``user`` runs the server and its python stubs as that (unprivileged) user: it needs read access to the
    repository and the ``runtime`` tree, and gets ``<workdir>/run`` as its own working directory. The log
    and the runtime tree (by default ``<workdir>/runtime``) stay the caller's.

    ``auto_complete_config=False`` serves configs as written, for callers whose configs are complete (the
    platform's are): with it on, the python backend starts an extra stub for every load to ask
    ``auto_complete_config`` and then sleeps 1 s in that stub's health check (``StubLauncher::UpdateHealth``
    in Triton 2.51), which is most of a small model's load time. Minimal seed configs (``backend: "ge"``
    alone) need it on.

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
        api_key: str | None = None,
        repository_key: str | None = None,
        open_apis: Sequence[str] = DEFAULT_OPEN_APIS,
        runtime: TritonRuntime | None = None,
        user: ServerUser | None = None,
        load_models: Sequence[str] = (),
        backend_config: Sequence[str] = (),
        extra_args: Sequence[str] = (),
        exit_timeout: int = 30,
        die_with_parent: bool = False,
        auto_complete_config: bool = True,
    ) -> None:
        unknown = sorted(set(open_apis) - set(TRITON_APIS))
        if unknown:
            raise ValueError(f"unknown Triton API group(s) {unknown}; known: {', '.join(TRITON_APIS)}")
        self.model_repository = Path(model_repository).resolve()
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="ge-triton-"))
        self.address = address
        self.http_port = http_port or free_port(address)
        self.grpc_port = grpc_port or free_port(address)
        self.metrics_port = metrics_port or free_port(address)
        self.api_key = api_key or repository_key or secrets.token_urlsafe(24)
        self.open_apis = tuple(open_apis)
        self.runtime = runtime
        self.user = user
        self.load_models = list(load_models)
        self.backend_config = list(backend_config)
        self.extra_args = list(extra_args)
        self.exit_timeout = exit_timeout
        self.die_with_parent = die_with_parent
        self.auto_complete_config = auto_complete_config
        self.log_path = self.workdir / "tritonserver.log"
        self.run_dir = self.workdir / "run"
        self.process: subprocess.Popen | None = None

    @property
    def repository_key(self) -> str:
        """The instance key (it was the repository API's only, hence the name)."""
        return self.api_key

    @property
    def restricted_apis(self) -> tuple[str, ...]:
        return tuple(api for api in TRITON_APIS if api not in self.open_apis)

    def key_headers(self, protocol: str = "http") -> dict[str, str]:
        """Headers that unlock the restricted APIs: pass them to tritonclient's ``headers=``."""
        return {(GRPC_API_KEY_HEADER if protocol == "grpc" else API_KEY_HEADER): self.api_key}

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
            f"--exit-timeout-secs={self.exit_timeout}",
            "--allow-gpu-metrics=false",
            "--log-verbose=0",
        ]
        if self.restricted_apis:
            # The same header name for both protocols: Triton prefixes it for gRPC itself.
            spec = f"{','.join(self.restricted_apis)}:{API_KEY_HEADER}={self.api_key}"
            cmd += [f"--http-restricted-api={spec}", f"--grpc-restricted-protocol={spec}"]
        if not self.auto_complete_config:
            cmd.append("--disable-auto-complete-config")
        cmd += [f"--load-model={name}" for name in self.load_models]
        cmd += [f"--backend-config={item}" for item in self.backend_config]
        return cmd + self.extra_args

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> TritonServer:
        """Start the process and wait until it is live (and ready, when models were named at start)."""
        if self.process is not None and self.process.poll() is None:
            return self
        self.workdir.mkdir(parents=True, exist_ok=True)
        runtime = self.runtime or assemble_runtime(self.workdir / "runtime")
        self._prepare_run_dir()
        # Opened here, not by the server: a server running as another user writes through this descriptor
        # and cannot swap the file for a link to something the caller would then read or append to.
        fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        if self.user is not None:
            # Its own /dev/shm, then exactly the user's ids: see sandbox.become().
            preexec = become(self.user, die_with_parent=self.die_with_parent)
        else:
            preexec = _interrupt_when_parent_dies if self.die_with_parent else None
        try:
            self.process = subprocess.Popen(
                [str(runtime.binary), *self.command(runtime.backends)],
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=subprocess.STDOUT,
                env=server_environment(runtime, home=self.run_dir, include_checkout=self.user is None),
                cwd=self.run_dir,
                # Own process group: a Ctrl-C in the caller's terminal is handled by stop(), which lets
                # in-flight requests finish instead of the server and the caller racing each other.
                start_new_session=True,
                preexec_fn=preexec,
            )
        finally:
            os.close(fd)
        self._wait_until(self.is_ready if self.load_models else self.is_live, timeout, "live")
        return self

    def _prepare_run_dir(self) -> None:
        run = self.run_dir
        if run.is_symlink():
            run.unlink()
        run.mkdir(exist_ok=True)
        if self.user is not None:
            os.chown(run, self.user.uid, self.user.gid, follow_symlinks=False)
        run.chmod(0o700)

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
        self, method: str, path: str, body: dict | None = None, *, timeout: float = 10.0
    ) -> tuple[int, dict]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://{self.http_url}{path}", data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        # Always: which API groups are open is the server's setting, not something each call should know.
        req.add_header(API_KEY_HEADER, self.api_key)
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
        status, reply = self._request("POST", f"/v2/repository/models/{name}/load", body, timeout=timeout)
        if status != 200:
            raise TritonError(f"loading model {name!r} failed ({status}): {reply.get('error', reply)}")

    def unload_model(self, name: str, *, dependents: bool = False, timeout: float = 60.0) -> None:
        body = {"parameters": {"unload_dependents": dependents}}
        status, reply = self._request("POST", f"/v2/repository/models/{name}/unload", body, timeout=timeout)
        if status != 200:
            raise TritonError(f"unloading model {name!r} failed ({status}): {reply.get('error', reply)}")

    def repository_index(self) -> list[dict]:
        """Every model in the repository with its state (READY, UNAVAILABLE + reason, ...)."""
        status, reply = self._request("POST", "/v2/repository/index", {})
        if status != 200:
            raise TritonError(f"repository index failed ({status}): {reply}")
        return reply if isinstance(reply, list) else []

    def model_config(self, name: str) -> dict:
        """The config Triton serves ``name`` with (JSON, as its model configuration API gives it)."""
        status, reply = self._request("GET", f"/v2/models/{name}/config")
        if status != 200:
            raise TritonError(f"config of {name} failed ({status}): {reply.get('error', reply)}")
        return reply

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
