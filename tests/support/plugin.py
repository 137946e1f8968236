"""The fixtures every test folder uses, registered once by ``tests/conftest.py`` (``pytest_plugins``).

Real processes are shared where a test only needs one running, and reset between tests:

* Chromium: one browser process per test module, a fresh context (cookies, storage) and page per test.
* The gateway (``manage.py gateway`` + HAProxy): one per test module. It renders everything from the database,
  so a test that calls ``start_gateway()`` gets the running one after it has synced with the test's rows;
  ``start_gateway(fresh=True)`` (and any second call in a test) starts a new process, for the tests about the
  process itself (restarts, kills, counters since a start).
* Host agents stay per test: a host's rows and credential die with each test's database flush, and the agents'
  tests are mostly about the process (crashes, restarts, quarantine, revocation).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from apps.registry.models import ModelVersion, RegisteredModel
from backend_ge.runtime import free_port
from tests.conftest import CHROMIUM, SCREENSHOTS, subprocess_database_url, wait_for
from tests.factories import ready_onnx_version
from tests.support.models import add_instance, classifier_onnx, make_version, scaler_onnx
from tests.support.servers import Agent, GatewayProcess, agent_env


# --- the artifact store and READY versions made by the real ONNX preparation path -------------------------
@pytest.fixture
def artifact_root(settings):
    """The artifact store in a fresh 0700 directory outside pytest's temp root, alone in it (a walk of its
    parent sees every write) but for the agents' fleet root (``<its parent>/fleet``): pytest keeps its temp
    root 0700, resetting the traverse access an agent running as root grants its Triton users on the way to
    the fleet root."""
    base = Path(tempfile.mkdtemp(prefix="ge-test-"))
    settings.ARTIFACT_ROOT = base / "artifacts"
    settings.ARTIFACT_ROOT.mkdir()
    yield settings.ARTIFACT_ROOT
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def make_ready_version(team, owner, artifact_root, tmp_path):
    """A READY classifier version converted by the real ONNX path (checker, shape inference, onnxruntime)."""

    def _make(
        model: RegisteredModel | None = None, scale: float = 1.0, slug: str = "classifier"
    ) -> ModelVersion:
        if model is None:
            model = RegisteredModel.objects.create(team=team, name=slug.title(), slug=slug, created_by=owner)
        return ready_onnx_version(
            model, classifier_onnx(scale), tmp_path, created_by=owner,
            preferred_batch_sizes=(4, 8), max_queue_delay_us=2000,
        )  # fmt: skip

    return _make


@pytest.fixture
def make_scaler_version(artifact_root, tmp_path):
    """A READY version of the scaler (input * scale), small enough to call thousands of times."""

    def _make(model: RegisteredModel, scale: float = 1.0) -> ModelVersion:
        return ready_onnx_version(
            model, scaler_onnx(scale), tmp_path, preferred_batch_sizes=(4, 8), max_queue_delay_us=100
        )

    return _make


# --- rows for tests that need no tritonserver --------------------------------------------------------------
@pytest.fixture
def shared_host(db):
    from django.utils import timezone

    from apps.fleet.models import Host

    return Host.objects.create(name="local", address="127.0.0.1", last_heartbeat_at=timezone.now())


@pytest.fixture
def instance(shared_host):
    return add_instance(shared_host)


@pytest.fixture
def classifier(team, owner):
    """The classifier model of team vision."""
    return RegisteredModel.objects.create(team=team, name="Classifier", slug="classifier", created_by=owner)


@pytest.fixture
def model(classifier):
    """The model most tests are about: the classifier (tests/registry's own ``model`` is ResNet 50, for
    its uploads; its version tests ask for ``classifier``)."""
    return classifier


@pytest.fixture
def version(model):
    return make_version(model, 1)


# --- host agents: a real agent process per test, with its own tritonserver ---------------------------------
@pytest.fixture
def start_agent(tmp_path, artifact_root, live_server):
    agents: list[Agent] = []

    def _start(name: str, labels: dict | None = None, **extra) -> Agent:
        var_dir = tmp_path / f"agent-{name}-var"
        var_dir.mkdir()
        # The host's own directory (beside the artifact store, see ``artifact_root``).
        env = agent_env(var_dir, Path(artifact_root).parent / "fleet", **extra)
        agent = Agent(name, env, tmp_path / f"agent-{name}.log", live_server.url, labels)
        agents.append(agent)
        return agent

    yield _start
    for agent in agents:
        agent.stop()


# --- the gateway: one per test module, synced with each test's rows ----------------------------------------
class _ModuleGateway:
    """The module's gateway process, its ports and log; each new start from a clean directory (as a test
    that starts its own gateway had), each restart within a test from the same one."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.env = os.environ.copy()
        self.env.update(
            DATABASE_URL=subprocess_database_url(),
            DEBUG="1",
            GATEWAY_DIR=str(directory / "gateway-0"),
            GATEWAY_BIND=f"127.0.0.1:{free_port()}",
            GATEWAY_GRPC_BIND=f"127.0.0.1:{free_port()}",
            GATEWAY_STATS_BIND=f"127.0.0.1:{free_port()}",
            GATEWAY_SYNC_INTERVAL_MS="500",
            GATEWAY_CHECK_INTERVAL_MS="300",
        )
        self.current: GatewayProcess | None = None
        self.started: list[GatewayProcess] = []

    def start(self, clean: bool) -> GatewayProcess:
        if self.current is not None:
            self.current.stop()
        if clean:
            self.env["GATEWAY_DIR"] = str(self.directory / f"gateway-{len(self.started)}")
        directory = Path(self.env["GATEWAY_DIR"])
        self.current = GatewayProcess(dict(self.env), directory, self.directory / "gateway.log")
        self.started.append(self.current)  # before start(): stopped at teardown even if it never answered
        return self.current.start()

    def stop(self) -> None:
        for gateway in self.started:
            gateway.stop()


@pytest.fixture(scope="module")
def _module_gateway(tmp_path_factory, django_db_setup):
    gateway = _ModuleGateway(tmp_path_factory.mktemp("gateway"))
    yield gateway
    gateway.stop()


@pytest.fixture
def gateway_env(_module_gateway) -> dict:
    """The gateway's environment: its binds (fixed for the module) and its directory."""
    return _module_gateway.env


def gateway_synced(gateway: GatewayProcess) -> bool:
    """Whether the running HAProxy holds the database's tokens, routes and limits (in its files and in its
    live maps): what a gateway started now would hold."""
    from apps.gateway.haproxy import Slots, render_map
    from apps.gateway.state import desired_state

    slots = Slots.read(gateway.directory / "slots.map", 1)
    try:
        wanted = desired_state().maps(slots)
    except KeyError:  # a deployment the gateway has not given a slot yet
        return False
    for name in ("tokens", "models", "limits"):
        path = gateway.directory / f"{name}.map"
        if not path.exists() or path.read_text() != render_map(wanted[name]):
            return False
        live = gateway.admin().ask(f"show map {path}")
        entries = {tuple(line.split(" ", 2)[1:]) for line in live.splitlines() if line.strip()}
        if entries != set(wanted[name].items()):
            return False
    return True


@pytest.fixture
def start_gateway(_module_gateway, settings):
    """The module's gateway, synced with this test's rows. ``fresh=True`` starts a new process from a clean
    directory (for tests about what a gateway holds since its start); a second call in a test restarts it
    from the same directory, as a restarted gateway command would. The test process pokes it through the
    same directory (``settings.GATEWAY_DIR``)."""
    from apps.gateway.services import poke_gateway

    calls: list[bool] = []
    settings.GATEWAY_DIR = Path(_module_gateway.env["GATEWAY_DIR"])  # where a change made before start pokes

    def _start(fresh: bool = False) -> GatewayProcess:
        current = _module_gateway.current
        if calls or fresh or current is None or not current.running:
            gateway = _module_gateway.start(clean=fresh or not calls)
        else:
            gateway = current
            settings.GATEWAY_DIR = gateway.directory
            poke_gateway()
            wait_for(lambda: gateway_synced(gateway), 15, f"the gateway to sync\n{gateway.output()}")
        calls.append(fresh)
        settings.GATEWAY_DIR = gateway.directory
        return gateway

    return _start


# --- headless Chromium (Debian's package; Playwright cannot download browsers here) -------------------------
@pytest.fixture(scope="module")
def browser():
    """One Chromium per test module. Playwright's sync API marks an event loop as running in this thread
    between its calls (Django then refuses ORM calls unless DJANGO_ALLOW_ASYNC_UNSAFE is set), so it lives no
    longer than the module that asked for it."""
    from playwright.sync_api import sync_playwright

    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run"],
        )  # fmt: skip
        yield browser
        browser.close()
    os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)


@pytest.fixture
def page(browser, live_server):
    """A Playwright page in a fresh browser context (no cookies or storage from another test)."""
    from django.db import connections

    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(15_000)
    yield page
    context.close()
    # Playwright's sync API runs the test in a context of its own (a greenlet), so the fixtures and the
    # test opened their database connection there: close it now, or it stays open after the test and
    # PostgreSQL refuses to drop the test database at the end ("being accessed by other users").
    connections.close_all()
