"""Rows for alert tests: a SERVING deployment of one model on one instance, a writer of recorded metric
minute rows, and a clock the tests hold still (``now`` is passed to the evaluator)."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.utils import timezone

from apps.alerts.models import AlertRule
from apps.deployments.models import Deployment, DeploymentInstance, DeploymentState, PlacementState
from apps.monitoring.models import ModelMetrics
from tests.support.models import add_instance, make_version


@pytest.fixture
def clock():
    """A frozen 'now' on a minute boundary; tests move it forward explicitly."""
    return timezone.now().replace(second=0, microsecond=0)


@pytest.fixture
def serving(team, owner, shared_host, clock):
    from apps.registry.models import RegisteredModel

    model = RegisteredModel.objects.create(team=team, name="Classifier", slug="classifier", created_by=owner)
    version = make_version(model, 1)
    instance = add_instance(shared_host)
    deployment = Deployment.objects.create(
        team=team, model=model, active_version=version, state=DeploymentState.SERVING, created_by=owner
    )
    Deployment.objects.filter(pk=deployment.pk).update(created_at=clock - timedelta(hours=2))
    deployment.refresh_from_db()
    placement = DeploymentInstance.objects.create(
        deployment=deployment, instance=instance, served_version=version, state=PlacementState.READY
    )
    return {
        "model": model,
        "version": version,
        "instance": instance,
        "host": shared_host,
        "deployment": deployment,
        "placement": placement,
    }


@pytest.fixture
def record_minute(team, serving):
    """Write one recorded minute row of the served model (what the scraper writes)."""

    def _write(
        bucket,
        success: int,
        failure: int = 0,
        p99_ms: float | None = None,
        mean_ms: float = 2.0,
        client_errors: int = 0,
    ):
        total = success + failure
        return ModelMetrics.objects.create(
            bucket=bucket.replace(second=0, microsecond=0),
            team=team,
            model=serving["model"],
            version=serving["version"],
            instance=serving["instance"],
            success=success,
            failure=failure,
            client_errors=client_errors,
            inferences=total,
            executions=total,
            request_us=total * mean_ms * 1000,
            p99_us=p99_ms * 1000 if p99_ms is not None else None,
            quantile_requests=total if p99_ms is not None else 0,
        )

    return _write


@pytest.fixture
def make_rule(team):
    def _make(kind, **fields) -> AlertRule:
        fields.setdefault("name", kind.replace("_", " "))
        return AlertRule.objects.create(team=team, kind=kind, **fields)

    return _make


@pytest.fixture
def receiver():
    """An HTTP server on 127.0.0.1 that answers with the next status of ``statuses`` (then 200) and keeps
    every body it got."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            length = int(self.headers["Content-Length"])
            server.bodies.append(json.loads(self.rfile.read(length)))
            server.headers.append(dict(self.headers))
            code = server.statuses.pop(0) if server.statuses else 200
            self.send_response(code)
            self.end_headers()
            self.wfile.write(b"receiver says %d" % code)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.bodies, server.headers, server.statuses = [], [], []
    server.url = f"http://127.0.0.1:{server.server_address[1]}/hooks/alerts?key=abc"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
