"""API fuzz: schemathesis generates requests for every operation of ``/api/schema/`` and sends them with an
owner's API token; any 5xx, or an answer that the schema does not describe (status code, content type, body,
headers), fails the test.

Bounded: FUZZ_EXAMPLES examples per operation (hypothesis, derandomized so CI runs the same cases) and a
FUZZ_BUDGET_SECONDS time budget over all of them. It runs in schemathesis' WSGI mode, in this process, against
the test database with seeded rows (a team, a model with a READY version, a deployment on an instance), and
the socket guard lets the application connect to loopback addresses only.
"""

from __future__ import annotations

import os
import socket
import time

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from apps.deployments import services as deployment_services
from apps.deployments.models import PlacementState
from apps.fleet.models import Host, InstanceState, TritonInstance
from apps.registry.models import ModelVersion, RegisteredModel, VersionState
from apps.teams import services as team_services
from tests.support.models import CLASSIFIER_SIGNATURE

pytestmark = [pytest.mark.fuzz, pytest.mark.django_db]

FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "12"))
FUZZ_BUDGET_SECONDS = float(os.environ.get("FUZZ_BUDGET_SECONDS", "150"))
LOOPBACK = ("127.", "::1", "localhost")
# Valid requests, and requests that break the schema on purpose (each must be refused with a 4xx).
GENERATION_MODES = [
    getattr(__import__("schemathesis").GenerationMode, name)
    for name in os.environ.get("FUZZ_MODES", "POSITIVE,NEGATIVE").split(",")
]
# Rows the seeded team has, so that generated requests reach real objects and not only 404s.
KNOWN_PATH_VALUES = {"team_slug": "vision", "model_slug": "classifier", "number": 1}
# Path prefixes whose {id} is a seeded row (filled in by the `seeded` fixture).
KNOWN_IDS = ("/deployments/{id}", "/instances/{id}")


@pytest.fixture
def loopback_only(monkeypatch):
    """Refuses any connection the application tries to open to a non-loopback address."""
    original = socket.socket.connect

    def connect(sock, address):
        host = address[0] if isinstance(address, tuple) else ""
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not str(host).startswith(LOOPBACK):
            raise AssertionError(f"the API fuzz tried to reach {address}")
        return original(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)


@pytest.fixture
def seeded(owner, team):
    """A model with a READY version deployed on a (stopped, loopback) instance, and the owner's token."""
    model = RegisteredModel.objects.create(team=team, name="Classifier", slug="classifier", created_by=owner)
    version = ModelVersion.objects.create(
        model=model, number=1, state=VersionState.READY, signature=CLASSIFIER_SIGNATURE, config_text=""
    )
    host = Host.objects.create(name="local", address="127.0.0.1")
    instance = TritonInstance.objects.create(
        host=host, name="cpu-0", http_port=1, grpc_port=2, metrics_port=3, state=InstanceState.STOPPED
    )  # no tritonserver in this test: the instance is stopped, so the playground answers 409
    deployment = deployment_services.deploy_version(
        actor=owner, model=model, version=version, instances=[instance]
    )
    deployment.placements.update(state=PlacementState.READY, served_version=version)
    deployment_services.placement_finished(deployment.placements.get())
    _, secret = team_services.create_token(actor=owner, team=team, name="fuzz")
    return {"secret": secret, "/deployments/{id}": deployment.pk, "/instances/{id}": instance.pk}


@pytest.fixture
def api_schema(settings):
    import schemathesis
    from django.core.signals import request_finished, request_started
    from django.core.wsgi import get_wsgi_application
    from django.db import close_old_connections

    settings.DEBUG = False  # the schema and the answers as production serves them (no browsable API)
    # As Django's test client does: a request must not close the test's database connection (and with it
    # the transaction that holds the seeded rows).
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield schemathesis.openapi.from_wsgi("/api/schema/", get_wsgi_application())
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


def _register_upload_chunks_as_binary() -> None:
    """Resumable uploads send their chunks as application/offset+octet-stream (the tus protocol)."""
    import schemathesis

    schemathesis.serializer.alias("application/offset+octet-stream", "application/octet-stream")


def _checks():
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    return [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
    ]


def _label(operation) -> str:
    return f"{operation.method.upper()} {operation.path}"


def _describe(exc: BaseException) -> str:
    text = str(exc)
    for inner in getattr(exc, "exceptions", ()):
        text += f"\n  - {type(inner).__name__}: {str(inner)[:600]}"
    return text[:3000]


def _operation_test(operation, known_path_values: dict, headers: dict, statuses: dict):
    """A hypothesis test sending FUZZ_EXAMPLES generated requests to one operation and checking each answer."""
    checks = _checks()
    label = _label(operation)
    strategies = [
        operation.as_strategy(mode, path_parameters=known_path_values or None) for mode in GENERATION_MODES
    ]

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=st.one_of(*strategies))
    def run(case):
        response = case.call_and_validate(headers=headers, checks=checks)
        statuses.setdefault(label, set()).add(response.status_code)

    return run


def _is_destructive(operation) -> bool:
    # Deleting the team, its members or tokens would leave every later operation with nothing to reach.
    return operation.method.lower() == "delete"


def test_no_operation_answers_5xx_or_outside_its_schema(api_schema, seeded, loopback_only):
    _register_upload_chunks_as_binary()
    operations = [result.ok() for result in api_schema.get_all_operations()]
    operations.sort(key=_is_destructive)  # deletions last
    headers = {"Authorization": f"Bearer {seeded['secret']}"}
    failures: dict[str, str] = {}
    statuses: dict[str, set[int]] = {}
    deadline = time.monotonic() + FUZZ_BUDGET_SECONDS
    ran = []
    for operation in operations:
        if time.monotonic() > deadline:
            break
        known = {k: v for k, v in KNOWN_PATH_VALUES.items() if f"{{{k}}}" in operation.path}
        for prefix in KNOWN_IDS:
            if prefix in operation.path:
                known["id"] = seeded[prefix]
        try:
            _operation_test(operation, known, headers, statuses)()
        except Unsatisfiable:
            pass  # no valid input could be generated for it: nothing was sent
        except (Exception, BaseExceptionGroup) as exc:  # every operation's failures, reported together
            failures[_label(operation)] = _describe(exc)
        ran.append(_label(operation))
    assert len(ran) >= len(operations) * 0.8, f"the time budget covered only {len(ran)} of {len(operations)}"
    assert not failures, "\n\n".join(f"{label}:\n{text}" for label, text in failures.items())
    # The seeded rows were reached, not only 404s.
    for label in (
        "GET /api/v1/teams/{team_slug}/deployments/{id}/",
        "GET /api/v1/teams/{team_slug}/models/{model_slug}/versions/{number}/",
        "GET /api/v1/teams/{team_slug}/models/{model_slug}/metrics/",
    ):
        assert 200 in statuses.get(label, set()), (label, statuses.get(label))
