"""Shared fixtures: a team with three personas (owner, maintainer, viewer), an outsider who belongs only
to another team, and API clients for each."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from apps.teams import services
from apps.teams.models import Role
from tests.factories import MembershipFactory, TeamFactory, UserFactory

PASSWORD = "correct horse battery staple"


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
