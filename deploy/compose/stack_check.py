"""``make stack-check``: docker-compose.yml started for real with podman-compose, and used as a user would.

The stack (docker-compose.yml with deploy/compose/stack-check.yml, rendered by render.py) comes up service by
service, each waited on through its own healthcheck. Then, through the stack's own endpoints: the first staff
user (``manage.py createsuperuser``, as an operator makes it) signs in, creates a team, an API token and a host
(REST API); the host-agent container joins with the host's one-time token; the seed's MLP and ResNet-50 are
uploaded (REST, chunked), converted by the worker and deployed; seed example 1 (curl, JSON) and seed example 3
(tritonclient) run through the gateway, their numbers checked against onnxruntime. Then:

- persistence: ``down`` and ``up`` keep models, versions, deployments, tokens and audit rows (volumes);
- restart policy: a killed web container and a killed host-agent container come back, and serving resumes;
- the data plane without the control plane: web, agent-api, worker and beat stopped for 60 s under gateway load
  fail 0 requests, and once started again the agent reports and a change is served;
- upgrade in place: the platform image rebuilt from a newer commit that adds a migration (a fixture) replaces
  web, agent-api, worker and beat under load: the migration runs once, nothing is lost, the agent reconnects,
  no request fails;
- bad input: the stack refuses to render without SECRET_KEY or POSTGRES_PASSWORD (one line naming it); the
  host-agent image exits with a clear message without its platform URL or its credential;
- any service log line at ERROR fails the check.

    .venv/bin/python deploy/compose/stack_check.py [--keep] [--json FILE] [--outage-seconds 60]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import requests

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from backend_ge.runtime import free_port  # noqa: E402  (ports it handed out lately are not handed out again)


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _load("compose_render", HERE / "render.py")
images = _load("deploy_images", ROOT / "deploy" / "images.py")

PROJECT = "tgestack"
COMPOSE = ROOT / "docker-compose.yml"
OVERRIDE = HERE / "stack-check.yml"
DATA_IMAGE = "triton-ge-stack-data:latest"
UPGRADE_IMAGE = "triton-ge-platform:stack-upgrade"
CONTROL_PLANE = ("web", "agent-api", "worker", "beat")
PLATFORM = ("web", "agent-api", "worker", "beat", "gateway")
HOST = "stack-node"
TEAM = "stack"
HTTPS = {"X-Forwarded-Proto": "https"}  # what the operator's TLS endpoint in front of web sets
# CHOWN 0, DAC_READ_SEARCH 2, FOWNER 3, KILL 5, SETGID 6, SETUID 7: compose's cap_add for the agent, as CapEff.
AGENT_CAPABILITIES = sum(1 << bit for bit in (0, 2, 3, 5, 6, 7))
FIXTURE_MIGRATION = '''"""A fixture of ``make stack-check``'s upgrade: a newer commit that adds a migration."""
from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("audit", "0001_initial")]
    operations = [
        migrations.RunSQL(
            "CREATE TABLE stack_check_upgrade (id serial PRIMARY KEY, applied_at timestamptz DEFAULT now()); "
            "INSERT INTO stack_check_upgrade DEFAULT VALUES",
            "DROP TABLE stack_check_upgrade",
        )
    ]
'''


class CheckFailed(RuntimeError):
    pass


def say(message: str) -> None:
    print(f"stack-check: {message}", flush=True)


def wait_for(predicate, timeout: float, what: str, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise CheckFailed(f"timed out after {timeout:.0f} s waiting for {what}")


def podman(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    try:
        return images.podman(*args, check=check, timeout=timeout)
    except images.BuildFailed as exc:
        raise CheckFailed(str(exc)) from exc


class Stack:
    """The ports, secrets and rendered compose file of one check, and podman-compose on them."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = {
            name: free_port()
            for name in (
                "pg",
                "redis",
                "web",
                "agent_api",
                "gw",
                "gw_grpc",
                "gw_stats",
                "t_http",
                "t_grpc",
                "t_metrics",
            )
        }
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "CONTAINERS_CONF": os.environ["CONTAINERS_CONF"],
            "SECRET_KEY": secrets.token_urlsafe(50),
            "POSTGRES_PASSWORD": secrets.token_urlsafe(24),
            "ALLOWED_HOSTS": "127.0.0.1,localhost",
            "STACK_DATA_IMAGE": DATA_IMAGE,
            "STACK_PG_PORT": str(self.port["pg"]),
            "STACK_REDIS_PORT": str(self.port["redis"]),
            "STACK_WEB_PORT": str(self.port["web"]),
            "STACK_AGENT_API_PORT": str(self.port["agent_api"]),
            "STACK_GATEWAY_PORT": str(self.port["gw"]),
            "STACK_GATEWAY_GRPC_PORT": str(self.port["gw_grpc"]),
            "STACK_GATEWAY_STATS_PORT": str(self.port["gw_stats"]),
            "PLATFORM_URL": f"http://127.0.0.1:{self.port['agent_api']}",
            "AGENT_JOIN_TOKEN": "",
        }
        self.file = workdir / "compose.yml"
        self.logs: dict[str, str] = {}
        self.write()

    @property
    def web(self) -> str:
        return f"http://127.0.0.1:{self.port['web']}"

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.port['gw']}"

    def write(self, **changes: str) -> None:
        self.env.update(changes)
        project = render.render([COMPOSE, OVERRIDE], self.env)
        for service in project["services"].values():
            service.pop("build", None)  # the images are built already (make images)
        self.file.write_text(render.dump(project))

    def compose(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        command = ["podman-compose", "-p", PROJECT, "-f", str(self.file), *args]
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env=self.env, cwd=self.workdir
        )
        if result.returncode != 0:
            raise CheckFailed(
                f"podman-compose {' '.join(args)}: {(result.stderr or result.stdout).strip()[-2000:]}"
            )
        return result

    def up(self, *services: str, recreate: bool = False) -> None:
        """``up -d --no-deps``; ``recreate``: the services' containers are stopped (gracefully) and removed
        first, since podman-compose's ``--force-recreate`` also recreates the services that depend on them
        (the host agent on agent-api: its tritonserver would restart)."""
        if recreate:
            for service in services:
                podman("rm", "-f", "-t", "30", self.container(service), timeout=120)
        self.compose("up", "-d", "--no-deps", *services)
        for service in services:
            if podman("container", "exists", self.container(service), check=False).returncode != 0:
                raise CheckFailed(f"podman-compose up made no container for {service}")

    def container(self, service: str) -> str:
        return f"{PROJECT}_{service}_1"

    def collect_logs(self) -> None:
        """Every container's log so far (a recreated container starts a new one)."""
        names = podman("ps", "-a", "--format", "{{.Names}}", check=False).stdout.split()
        for name in names:
            if name.startswith(f"{PROJECT}_"):
                logs = podman("logs", name, check=False)
                self.logs[
                    f"{name}#{podman('inspect', '--format', '{{.Id}}', name, check=False).stdout.strip()[:12]}"
                ] = logs.stdout + logs.stderr


def healthy(name: str) -> bool:
    """The container runs and its compose healthcheck passes. podman 4.3 runs no healthcheck on its own
    without systemd: ``podman healthcheck run`` runs the container's own test and records the result."""
    status = podman("inspect", "--format", "{{.State.Status}}", name, check=False).stdout.strip()
    if status != "running":
        return False
    return podman("healthcheck", "run", name, check=False, timeout=120).returncode == 0


def wait_healthy(stack: Stack, services, timeout: float = 300) -> None:
    for service in services:
        wait_for(lambda s=service: healthy(stack.container(s)), timeout, f"{service}'s healthcheck", 2)


# ------------------------------------------------------------------------------------------------ the API
class Api:
    """The REST API as a signed-in staff user behind the operator's TLS endpoint (session + CSRF), or with a
    team's bearer token."""

    def __init__(self, base: str, token: str | None = None) -> None:
        self.base = base
        self.token = token
        self.cookies: dict[str, str] = {}

    def sign_in(self, username: str, password: str) -> None:
        page = requests.get(f"{self.base}/login/", headers=HTTPS, timeout=30)
        self.cookies.update(page.cookies.get_dict())
        csrf = self.cookies["csrftoken"]
        reply = requests.post(
            f"{self.base}/login/",
            data={"username": username, "password": password, "csrfmiddlewaretoken": csrf},
            headers={**HTTPS, "Referer": f"https://127.0.0.1:{self.base.rsplit(':', 1)[1]}/login/"},
            cookies=self.cookies,
            allow_redirects=False,
            timeout=30,
        )
        self.cookies.update(reply.cookies.get_dict())
        if "sessionid" not in self.cookies:
            raise CheckFailed(f"signing in as {username} failed: HTTP {reply.status_code}")

    def request(self, method: str, path: str, **kwargs):
        headers = {**HTTPS, **kwargs.pop("headers", {})}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        else:
            headers["X-CSRFToken"] = self.cookies.get("csrftoken", "")
            headers["Origin"] = f"https://127.0.0.1:{self.base.rsplit(':', 1)[1]}"
        reply = requests.request(
            method, f"{self.base}{path}", headers=headers, cookies=self.cookies, timeout=120, **kwargs
        )
        if reply.status_code >= 400:
            raise CheckFailed(f"{method} {path}: HTTP {reply.status_code} {reply.text[:500]}")
        return reply.json() if reply.content else None


def tgp_client(stack: Stack, token: str):
    from tgp.client import Client, UploadJournal

    def behind_tls(request) -> None:  # the operator's TLS endpoint: https outside, plain HTTP to web
        request.headers.update(HTTPS)
        if request.url.scheme == "https":  # the URLs the API answers with are the https ones users see
            request.url = request.url.copy_with(scheme="http")

    client = Client(
        stack.web, token, TEAM, timeout=300, journal=UploadJournal(stack.workdir / "uploads.json")
    )
    client.http.event_hooks["request"].append(behind_tls)
    return client


def write_models(workdir: Path) -> dict[str, Path]:
    import onnx

    from backend_ge import examples

    paths = {}
    for name, build in (("mlp", examples.build_mlp), ("resnet50", examples.build_resnet50)):
        path = workdir / f"{name}.onnx"
        onnx.save(build(), path)
        paths[name] = path
    return paths


def reference(path: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs), strict=True))


def signature(path: Path) -> tuple[str, list[int], str]:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    (item,) = model.graph.input
    dims = [d.dim_value for d in item.type.tensor_type.shape.dim[1:]]
    return item.name, dims, model.graph.output[0].name


def triton_name(model: str) -> str:
    return f"{TEAM}__{model}"


# --------------------------------------------------------------------------------------------- the calls
def seed_example_1(stack: Stack, token: str, path: Path) -> dict:
    """Seed example 1's curl with its JSON body (ResNet-50, [1, 3, 224, 224] FP32) through the gateway."""
    x = np.random.default_rng(1).random((1, 3, 224, 224), dtype=np.float32)
    body = stack.workdir / "body.json"
    body.write_text(json.dumps({"inputs": [{"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32",
                                            "data": x.ravel().tolist()}]}))  # fmt: skip
    result = subprocess.run(
        ["curl", "-sS", "-X", "POST", f"{stack.gateway}/v2/models/{triton_name('resnet50')}/infer",
         "-H", "Content-Type: application/json", "-H", f"Authorization: Bearer {token}", "-d", f"@{body}",
         "-w", "\n%{http_code}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    text, _, code = result.stdout.rpartition("\n")
    if code != "200":
        raise CheckFailed(f"seed example 1 answered HTTP {code}: {text[:300]}")
    payload = json.loads(text)
    (output,) = payload["outputs"]
    got = np.array(output["data"], dtype=np.float32).reshape(output["shape"])
    expected = reference(path, {"input": x})["output"]
    if output["shape"] != [1, 1000] or not np.allclose(got, expected, rtol=1e-3, atol=1e-4):
        raise CheckFailed("seed example 1's output does not match onnxruntime's")
    return {"shape": output["shape"], "top5": np.argsort(got[0])[-5:][::-1].tolist(),
            "max_abs_diff": float(np.abs(got - expected).max())}  # fmt: skip


def seed_example_3(stack: Stack, token: str, path: Path) -> dict:
    """Seed example 3 (tritonclient over HTTP) through the gateway, with the team's token."""
    import tritonclient.http as httpclient

    headers = {"Authorization": f"Bearer {token}"}
    client = httpclient.InferenceServerClient(url=stack.gateway.removeprefix("http://"))
    model = triton_name("resnet50")
    server_ready = client.is_server_ready(headers=headers)
    model_ready = client.is_model_ready(model, headers=headers)
    input_data = np.random.randn(1, 3, 224, 224).astype(np.float32)
    inputs = [httpclient.InferInput("input", input_data.shape, "FP32")]
    inputs[0].set_data_from_numpy(input_data)
    outputs = [httpclient.InferRequestedOutput("output")]
    results = client.infer(model_name=model, inputs=inputs, outputs=outputs, headers=headers)
    output_data = results.as_numpy("output")
    client.close()
    expected = reference(path, {"input": input_data})["output"]
    if not (server_ready and model_ready) or output_data.shape != (1, 1000):
        raise CheckFailed(f"seed example 3: ready {server_ready}/{model_ready}, shape {output_data.shape}")
    if not np.allclose(output_data, expected, rtol=1e-3, atol=1e-4):
        raise CheckFailed("seed example 3's output does not match onnxruntime's")
    return {"server_ready": server_ready, "model_ready": model_ready, "shape": list(output_data.shape),
            "top5": np.argsort(output_data[0])[-5:][::-1].tolist()}  # fmt: skip


class Load:
    """Bounded gateway load on the MLP: a few client threads, each request checked against onnxruntime."""

    def __init__(
        self, stack: Stack, token: str, path: Path, threads: int = 3, max_requests: int = 200_000
    ) -> None:
        name, dims, output = signature(path)
        self.x = np.random.default_rng(3).standard_normal((2, *dims)).astype(np.float32)
        self.expected = reference(path, {name: self.x})[output]
        self.url = f"{stack.gateway}/v2/models/{triton_name('mlp')}/infer"
        self.body = {"inputs": [{"name": name, "shape": list(self.x.shape), "datatype": "FP32",
                                 "data": self.x.ravel().tolist()}]}  # fmt: skip
        self.headers = {"Authorization": f"Bearer {token}"}
        self.output = output
        self.sent = self.failed = 0
        self.failures: list[str] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.max_requests = max_requests
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self) -> None:
        session = requests.Session()
        while not self.stop.is_set():
            with self.lock:
                if self.sent >= self.max_requests:
                    return
                self.sent += 1
            error = None
            try:
                reply = session.post(self.url, json=self.body, headers=self.headers, timeout=30)
                if reply.status_code != 200:
                    error = f"HTTP {reply.status_code} {reply.text[:200]}"
                else:
                    got = np.array(reply.json()["outputs"][0]["data"], dtype=np.float32).reshape(
                        self.expected.shape
                    )
                    if not np.allclose(got, self.expected, rtol=1e-3, atol=1e-4):
                        error = "wrong numbers"
            except requests.RequestException as exc:
                error = f"{type(exc).__name__}: {exc}"[:200]
            if error:
                with self.lock:
                    self.failed += 1
                    self.failures.append(error)
            time.sleep(0.02)

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)

    def figures(self) -> dict:
        return {"sent": self.sent, "failed": self.failed, "first_failures": self.failures[:5]}


def call_ok(stack: Stack, token: str, path: Path) -> bool:
    load = Load(stack, token, path, threads=1, max_requests=1)
    load._run()
    return load.failed == 0


# ------------------------------------------------------------------------------------------ the check
def manage(stack: Stack, code: str) -> dict:
    result = podman("exec", stack.container("web"), "python", "manage.py", "shell", "-c", code, timeout=120)
    return json.loads(result.stdout.strip().splitlines()[-1])


COUNTS = """
import json
from apps.audit.models import AuditEvent
from apps.deployments.models import Deployment
from apps.registry.models import ModelVersion, RegisteredModel
from apps.teams.models import ApiToken
print(json.dumps({"models": RegisteredModel.objects.count(), "versions": ModelVersion.objects.count(),
                  "deployments": Deployment.objects.count(), "tokens": ApiToken.objects.count(),
                  "audit_rows": AuditEvent.objects.count()}))
"""


def refusals(stack: Stack) -> dict:
    """Bad input: the stack without its secrets; the agent image without its URL or credential."""
    found = {}
    for variable in ("SECRET_KEY", "POSTGRES_PASSWORD"):
        env = {k: v for k, v in stack.env.items() if k != variable}
        try:
            render.render([COMPOSE, OVERRIDE], env)
        except render.MissingVariable as exc:
            line = str(exc)
            if variable not in line or "\n" in line:
                raise CheckFailed(
                    f"the refusal without {variable} does not name it on one line: {line!r}"
                ) from exc
            found[variable] = line
        else:
            raise CheckFailed(f"the stack rendered without {variable}")
    agent = "triton-ge-host-agent:latest"
    no_url = podman("run", "--rm", "--network", "host", agent, check=False, timeout=120)
    if no_url.returncode == 0 or "--platform URL or PLATFORM_URL" not in no_url.stderr:
        raise CheckFailed(
            f"the agent image without a platform URL: exit {no_url.returncode} {no_url.stderr[-300:]}"
        )
    found["agent_without_url"] = no_url.stderr.strip().splitlines()[-1]
    no_credential = podman(
        "run",
        "--rm",
        "--network",
        "host",
        agent,
        "--platform",
        "http://127.0.0.1:9",
        check=False,
        timeout=120,
    )
    if no_credential.returncode == 0 or "No host credential" not in no_credential.stderr:
        raise CheckFailed(f"the agent image without a credential: exit {no_credential.returncode}")
    found["agent_without_credential"] = no_credential.stderr.strip().splitlines()[-1]
    return found


def ensure_images() -> None:
    for image in (images.PLATFORM_IMAGE, images.AGENT_IMAGE):
        if not images.image_exists(image):
            raise CheckFailed(f"image {image} is missing: build it first (make images)")
    if not images.image_exists(DATA_IMAGE):
        base = (
            images.DEBIAN_BASE
            if images.image_exists(images.DEBIAN_BASE)
            else images.resolve_base(None, False)
        )
        say(f"building {DATA_IMAGE} (PostgreSQL and Redis from Debian's packages) on {base}")
        podman("build", "--network", "host", "--build-arg", f"BASE_IMAGE={base}", "-t", DATA_IMAGE,
               "-f", str(HERE / "data.Containerfile"), str(HERE), timeout=1800)  # fmt: skip


def remove_leftovers() -> None:
    names = podman("ps", "-a", "--format", "{{.Names}}", check=False).stdout.split()
    for name in [n for n in names if n.startswith(f"{PROJECT}_")]:
        podman("rm", "-f", "-t", "5", name, check=False)
    volumes = podman("volume", "ls", "--format", "{{.Name}}", check=False).stdout.split()
    for volume in [v for v in volumes if v.startswith(f"{PROJECT}_")]:
        podman("volume", "rm", "-f", volume, check=False)


def start(stack: Stack) -> float:
    """Up in the order of the healthchecks the services depend on; seconds to all healthy."""
    started = time.monotonic()
    stack.up("postgres", "redis")
    wait_healthy(stack, ("postgres", "redis"))
    stack.up("web")  # migrates, then serves
    wait_healthy(stack, ("web",))
    stack.up("agent-api", "worker", "beat", "gateway")
    wait_healthy(stack, ("agent-api", "worker", "beat", "gateway"))
    return time.monotonic() - started


def kill(stack: Stack, service: str) -> float:
    """SIGKILL the container's main process (a crash, not a stop): its restart policy brings it back."""
    name = stack.container(service)
    pid = int(podman("inspect", "--format", "{{.State.Pid}}", name).stdout.strip())
    started = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    wait_for(
        lambda: podman("inspect", "--format", "{{.State.Pid}}", name, check=False).stdout.strip() not in ("", "0", str(pid)),
        120, f"{service} to be restarted by its restart policy",
    )  # fmt: skip
    wait_healthy(stack, (service,))
    return time.monotonic() - started


def build_upgrade(workdir: Path) -> str:
    """The platform image from a newer commit: the checkout's sources plus a fixture migration, committed."""
    tree = workdir / "upgrade"
    tree.mkdir()
    for name in ("Dockerfile", ".dockerignore", "pyproject.toml", "manage.py", "Procfile", "README.md"):
        shutil.copy2(ROOT / name, tree / name)
    for name in ("serving_platform", "apps", "backend_ge", "hostagent", "tgp", "frontend", "agent"):
        shutil.copytree(ROOT / name, tree / name, symlinks=True,
                        ignore=shutil.ignore_patterns("node_modules", "__pycache__"))  # fmt: skip
    (tree / "apps" / "audit" / "migrations" / "0002_stack_check_upgrade.py").write_text(FIXTURE_MIGRATION)
    git = ["git", "-C", str(tree), "-c", "user.name=stack-check", "-c", "user.email=stack-check@localhost"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "Fixture: a newer commit that adds a migration"], check=True)
    commit = subprocess.run(
        [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    base = images.DEBIAN_BASE if images.image_exists(images.DEBIAN_BASE) else images.PUBLIC_BASE
    seconds = images.build(
        "platform", UPGRADE_IMAGE, {"BASE_IMAGE": base, "AGENT_BASE_IMAGE": base}, context=tree, quiet=True
    )
    say(f"upgrade image {UPGRADE_IMAGE} built from fixture commit {commit} in {seconds:.0f} s")
    return commit


ERROR_MARKS = (" ERROR", "[ERROR]", "ERROR/", "FATAL", "Traceback")


def error_lines(stack: Stack) -> list[str]:
    stack.collect_logs()
    found = []
    for name, text in stack.logs.items():
        for line in text.splitlines():
            if any(mark in line for mark in ERROR_MARKS) and not images.expected_refusal(line):
                found.append(f"{name}: {line[:300]}")
    return found


def run(keep: bool, outage_seconds: float) -> dict:
    images.containers_conf()
    ensure_images()
    workdir = Path(tempfile.mkdtemp(prefix="stack-check-"))
    stack = Stack(workdir)
    figures: dict = {}
    try:
        remove_leftovers()
        figures["refusals"] = refusals(stack)
        say(
            f"refused without secrets: {figures['refusals']['SECRET_KEY']} | {figures['refusals']['POSTGRES_PASSWORD']}"
        )
        # The upgrade's image is built while the stack starts and serves (most of that is waiting).
        upgrade: dict = {}

        def build_in_background() -> None:
            try:
                upgrade["commit"] = build_upgrade(workdir)
            except Exception as exc:  # reported when the upgrade step needs the image
                upgrade["error"] = exc

        builder = threading.Thread(target=build_in_background, daemon=True)
        builder.start()
        figures["up_to_healthy_s"] = round(start(stack), 1)
        say(f"up -> every service healthy in {figures['up_to_healthy_s']} s")

        password = secrets.token_urlsafe(16)
        podman("exec", "-e", f"DJANGO_SUPERUSER_PASSWORD={password}", stack.container("web"), "python", "manage.py",
               "createsuperuser", "--noinput", "--username", "ops", "--email", "ops@example.com", timeout=120)  # fmt: skip
        staff = Api(stack.web)
        staff.sign_in("ops", password)
        staff.request("POST", "/api/v1/teams/", json={"name": "Stack", "slug": TEAM})
        token = staff.request(
            "POST", f"/api/v1/teams/{TEAM}/tokens/", json={"name": "stack-check", "role": "admin"}
        )["token"]
        host = staff.request("POST", "/api/v1/hosts/", json={"name": HOST, "address": "127.0.0.1"})
        instance = staff.request("POST", "/api/v1/instances/", json={
            "host": HOST, "name": "cpu-0", "http_port": stack.port["t_http"], "grpc_port": stack.port["t_grpc"],
            "metrics_port": stack.port["t_metrics"]})  # fmt: skip
        say(f"team {TEAM}, a token and host {HOST} created through the API")
        stack.write(AGENT_JOIN_TOKEN=host["join_token"])
        stack.up("host-agent")
        wait_healthy(stack, ("host-agent",))
        stack.write(AGENT_JOIN_TOKEN="")  # joined: the credential is in the fleet volume now
        caps = podman(
            "exec", stack.container("host-agent"), "grep", "CapEff", "/proc/1/status"
        ).stdout.split()[-1]
        if int(caps, 16) != AGENT_CAPABILITIES:
            raise CheckFailed(f"the host agent runs with capabilities {caps}, not {AGENT_CAPABILITIES:016x}")
        figures["agent_capabilities"] = caps
        say(f"host agent joined; its capabilities: {caps} (CHOWN DAC_READ_SEARCH FOWNER KILL SETGID SETUID)")

        paths = write_models(workdir)
        client = tgp_client(stack, token)
        for name in ("mlp", "resnet50"):
            client.create_model(name, slug=name)
            version = client.upload(paths[name], name)
            client.wait_for_version(name, version["number"], timeout=900)
            client.deploy(name, version["number"], instances=[instance["id"]])
        for name in ("mlp", "resnet50"):
            client.wait_for_deployment(name, timeout=900)
        say("MLP and ResNet-50 uploaded, converted and SERVING")
        figures["seed_example_1"] = seed_example_1(stack, token, paths["resnet50"])
        figures["seed_example_3"] = seed_example_3(stack, token, paths["resnet50"])
        say(f"seed example 1 (curl): {figures['seed_example_1']}")
        say(f"seed example 3 (tritonclient): {figures['seed_example_3']}")

        before = manage(stack, COUNTS)
        stack.collect_logs()
        stack.compose("down")  # volumes stay
        figures["up_again_to_healthy_s"] = round(start(stack), 1)
        stack.up("host-agent")
        wait_healthy(stack, ("host-agent",))
        after = manage(stack, COUNTS)
        if after != before:
            raise CheckFailed(f"down/up lost rows: before {before}, after {after}")
        wait_for(lambda: call_ok(stack, token, paths["mlp"]), 300, "the MLP to answer after down/up", 2)
        figures["kept_across_down_up"] = after
        say(f"down + up kept {after}; serving again")

        for service in ("web", "host-agent"):
            seconds = kill(stack, service)
            wait_for(
                lambda: call_ok(stack, token, paths["mlp"]), 300, f"serving after {service} was killed", 1
            )
            figures[f"{service}_killed_back_s"] = round(seconds, 1)
            say(f"{service} killed: restarted by its policy and healthy in {seconds:.0f} s; serving resumed")
        staff.request("GET", "/api/v1/hosts/")  # the session survives a web restart

        with Load(stack, token, paths["mlp"]) as load:
            time.sleep(3)
            stack.compose("stop", *CONTROL_PLANE)
            stopped = time.monotonic()
            say(f"web, agent-api, worker and beat stopped for {outage_seconds:.0f} s under gateway load")
            time.sleep(outage_seconds)
            stack.compose("start", "agent-api", "web", "worker", "beat")
            wait_healthy(stack, CONTROL_PLANE)
            figures["control_plane_down_s"] = round(time.monotonic() - stopped, 1)
            time.sleep(3)
        figures["outage"] = load.figures()
        say(f"control plane outage: {figures['outage']}")
        if load.failed:
            raise CheckFailed(
                f"{load.failed} of {load.sent} requests failed while the control plane was down"
            )
        # They pick up where they were: the agent reports again, and a change made now is carried out.
        host_row = wait_for(
            lambda: (row := staff.request("GET", f"/api/v1/hosts/{HOST}/"))["status"] == "online" and row,
            120, "the host to be online again",
        )  # fmt: skip
        resnet = client.deployment_of("resnet50")
        api = Api(stack.web, token)
        api.request("POST", f"/api/v1/teams/{TEAM}/deployments/{resnet['id']}/undeploy/")
        listed = lambda: [m["name"] for m in requests.get(f"{stack.gateway}/v2/models", timeout=10,  # noqa: E731
                          headers={"Authorization": f"Bearer {token}"}).json()["models"]]  # fmt: skip
        wait_for(
            lambda: triton_name("resnet50") not in listed(), 180, "ResNet-50's undeploy to reach the gateway"
        )
        figures["after_outage"] = {"host_status": host_row["status"], "undeployed_after_restart": True}
        say("after the outage: the host is online and an undeploy made then reached the gateway")

        builder.join(timeout=1800)
        if "commit" not in upgrade:
            raise CheckFailed(f"the upgrade image was not built: {upgrade.get('error', 'timed out')}")
        commit = upgrade["commit"]
        stack.collect_logs()
        with Load(stack, token, paths["mlp"]) as load:
            time.sleep(3)
            stack.write(STACK_PLATFORM_IMAGE=UPGRADE_IMAGE)
            stack.up("web", recreate=True)
            wait_healthy(stack, ("web",))
            stack.up("agent-api", "worker", "beat", recreate=True)
            wait_healthy(stack, ("agent-api", "worker", "beat"))
            time.sleep(5)
        upgraded = manage(
            stack,
            COUNTS
            + """
from django.db import connection
with connection.cursor() as c:
    c.execute("SELECT count(*) FROM stack_check_upgrade")
    rows = c.fetchone()[0]
    c.execute("SELECT count(*) FROM django_migrations WHERE app = 'audit' AND name = '0002_stack_check_upgrade'")
    applied = c.fetchone()[0]
print(json.dumps({"fixture_rows": rows, "applied": applied}))
""",
        )
        figures["upgrade"] = {"commit": commit, **upgraded, **load.figures()}
        say(f"upgrade in place: {figures['upgrade']}")
        if upgraded != {"fixture_rows": 1, "applied": 1}:
            raise CheckFailed(f"the fixture migration did not run exactly once: {upgraded}")
        if load.failed:
            raise CheckFailed(f"{load.failed} of {load.sent} requests failed during the upgrade")
        counts = manage(stack, COUNTS)
        if any(counts[k] < before[k] for k in before):
            raise CheckFailed(f"the upgrade lost rows: before {before}, after {counts}")
        wait_for(lambda: call_ok(stack, token, paths["mlp"]), 60, "serving after the upgrade")
        # The agent reconnected to the upgraded platform, speaking a protocol version it serves.
        since = time.time()
        row = wait_for(
            lambda: (r := staff.request("GET", f"/api/v1/hosts/{HOST}/")).get("heartbeat_age_seconds") is not None
            and r["status"] == "online" and r["heartbeat_age_seconds"] < time.time() - since + 1 and r,
            120, "the agent's heartbeat to the upgraded platform",
        )  # fmt: skip
        figures["after_upgrade"] = {
            k: row.get(k) for k in ("status", "agent_protocol", "agent_protocol_served")
        }
        if row.get("agent_protocol_served") is False:
            raise CheckFailed(f"the upgraded platform refuses the agent: {figures['after_upgrade']}")
        say(f"after the upgrade: host {figures['after_upgrade']}; serving")

        errors = error_lines(stack)
        if errors:
            raise CheckFailed("service log lines at ERROR:\n" + "\n".join(errors[:30]))
        return figures
    except Exception:
        stack.collect_logs()
        for name, text in stack.logs.items():
            print(f"--- {name}\n" + "\n".join(text.splitlines()[-30:]), file=sys.stderr)
        raise
    finally:
        if keep:
            say(f"kept: podman-compose -p {PROJECT} -f {stack.file} down -v")
        else:
            try:
                stack.compose("down", "-v", timeout=300)
            except CheckFailed as exc:
                say(f"teardown: {exc}")
            remove_leftovers()
            podman("rmi", "-f", UPGRADE_IMAGE, check=False)
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="Leave the stack running for a look.")
    parser.add_argument("--json", type=Path, help="Write the figures to this file.")
    parser.add_argument(
        "--outage-seconds", type=float, default=60.0, help="How long the control plane stays down."
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        figures = run(args.keep, args.outage_seconds)
    except (CheckFailed, render.MissingVariable) as exc:
        print(f"stack-check: FAILED: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # a client error (tgp, requests): the step that failed is in the traceback above
        print(f"stack-check: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        raise
    figures["seconds"] = round(time.monotonic() - started)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    say(f"passed in {figures['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
