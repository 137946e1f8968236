"""Shared fixtures: a team with three personas (owner, maintainer, viewer), an outsider who belongs only
to another team, and API clients for each."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from pathlib import Path

import pytest
from rest_framework.test import APIClient

from apps.teams import services
from apps.teams.models import Role
from backend_ge import fakes
from tests.factories import MembershipFactory, TeamFactory, UserFactory

PASSWORD = "correct horse battery staple"

# The fixtures every folder shares (artifact store, agents, gateway, browser, rows): one plugin module.
pytest_plugins = ["tests.support.plugin"]


@pytest.fixture
def team(db):
    return TeamFactory(name="Vision", slug="vision")


@pytest.fixture
def other_team(db):
    return TeamFactory(name="Speech", slug="speech")


@pytest.fixture
def owner(team):
    return MembershipFactory(team=team, user=UserFactory(username="olivia"), role=Role.OWNER).user


@pytest.fixture
def maintainer(team):
    return MembershipFactory(team=team, user=UserFactory(username="max"), role=Role.MAINTAINER).user


@pytest.fixture
def viewer(team):
    return MembershipFactory(team=team, user=UserFactory(username="vera"), role=Role.VIEWER).user


@pytest.fixture
def outsider(other_team):
    return MembershipFactory(team=other_team, user=UserFactory(username="oscar"), role=Role.OWNER).user


def client_for(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


@pytest.fixture
def owner_client(owner):
    return client_for(owner)


@pytest.fixture
def maintainer_client(maintainer):
    return client_for(maintainer)


@pytest.fixture
def viewer_client(viewer):
    return client_for(viewer)


@pytest.fixture
def outsider_client(outsider):
    return client_for(outsider)


def bearer_client(secret: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    return client


@pytest.fixture
def make_token(owner, team):
    """Create a token in ``team`` (by the owner unless ``user`` is given); returns (token, plaintext)."""

    def _make(name="ci", read_only=False, expires_at=None, user=None):
        return services.create_token(
            actor=user or owner, team=team, name=name, read_only=read_only, expires_at=expires_at
        )

    return _make


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings):
    # PBKDF2's deliberate slowness protects real passwords; in tests it only slows every persona down.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def subprocess_database_url() -> str:
    """DATABASE_URL of the running test database, for worker and agent subprocesses."""
    from django.db import connection

    db = connection.settings_dict
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    user = db["USER"] or "postgres"
    auth = f"{user}:{db['PASSWORD']}@" if db["PASSWORD"] else f"{user}@"
    return f"postgres://{auth}{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


# --- headless Chromium (Debian's package; Playwright cannot download browsers here) --------------------
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SCREENSHOTS = Path(__file__).resolve().parents[1] / "var" / "screenshots"
requires_chromium = pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed (apt install chromium)"
)


def wait_for(predicate, timeout: float, message: str = "condition", interval: float = 0.1):
    """Poll ``predicate`` until it returns something truthy (returned), or fail after ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {message}")


# --- a fake `atc` on PATH that replays recorded real ATC runs (no CANN here): backend_ge/fakes/atc.py ------
ATC_FIXTURES = fakes.ATC_RECORDINGS
EXIT_CODES = fakes.atc_exit_codes()


@pytest.fixture
def fake_atc(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    atc = fakes.install_tools(bindir, ("atc",))["atc"]
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv(fakes.ENV_FLAG, "1")
    argv_file = tmp_path / "atc-argv.json"
    monkeypatch.setenv("FAKE_ATC_ARGV", str(argv_file))

    def replay(name: str, **env):
        monkeypatch.setenv("FAKE_ATC_FIXTURE", str(ATC_FIXTURES / f"{name}.txt"))
        monkeypatch.setenv("FAKE_ATC_EXIT", str(EXIT_CODES[name]))
        for key, value in env.items():
            monkeypatch.setenv(key, str(value))
        return argv_file

    replay.path = str(atc)
    replay.argv_file = argv_file
    yield replay
    # A killed worker leaves its atc orphaned (ATC runs in its own session): stop the ones this test started.
    pids = Path(str(argv_file) + ".pids")
    if pids.exists():
        for line in pids.read_text().split("\n"):
            if line.strip():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(line.split()[0]), signal.SIGKILL)


# --- the order modules run in ----------------------------------------------------------------------------------
REAL_SERVER_MARKS = ("triton", "servers", "browser", "fuzz")


def pytest_collection_modifyitems(config, items) -> None:
    """Modules with the most real-server tests first, the rest in their own order after them: with several
    workers (``make test``: each takes whole modules) the long modules start at once and the short ones fill in
    at the end, instead of a long module starting last and running alone. The order is the same in every
    worker, as pytest-xdist requires."""
    live: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        live[module] = live.get(module, 0) + any(item.get_closest_marker(m) for m in REAL_SERVER_MARKS)
    items.sort(key=lambda item: -live[item.nodeid.split("::", 1)[0]])
