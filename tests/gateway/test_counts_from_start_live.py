"""No lost counts at a start: requests made before the platform's first scrape of a tritonserver its agent
started, and of an HAProxy worker its gateway command started, are on the model's metrics (the API the pages
draw), exactly; a gateway worker of unknown start keeps the baseline rule. Real agent, tritonserver and HAProxy."""

from __future__ import annotations

import pytest

from apps.gateway.metrics import scrape_gateway
from apps.gateway.models import GatewayMetrics, GatewayScrapeState
from apps.monitoring.models import ModelMetrics, ScrapeState
from apps.monitoring.tasks import scrape_instances
from tests.conftest import wait_for
from tests.support.servers import requires_haproxy

pytestmark = [pytest.mark.triton, requires_haproxy, pytest.mark.django_db(transaction=True)]
CALLS = 30


def test_requests_before_the_first_scrape_are_on_the_models_metrics(
    two_teams_on_a_shared_instance, start_gateway, gateway_env, make_token, settings, owner_client
):
    instance = two_teams_on_a_shared_instance
    assert instance.server_started_at is not None  # the agent said when it started the server
    assert not ScrapeState.objects.exists() and not ModelMetrics.objects.exists()  # never scraped
    settings.GATEWAY_METRICS_URL = f"http://{gateway_env['GATEWAY_STATS_BIND']}/metrics"
    gateway = start_gateway(fresh=True)
    worker = gateway.admin().worker_pid()
    wait_for(
        lambda: any(
            w["pid"] == worker
            for workers in GatewayScrapeState.objects.values_list("started_workers", flat=True)
            for w in workers
        ),
        10,
        "the gateway command to record its HAProxy worker",
    )
    _, secret = make_token(name="client")
    statuses: list[int] = []

    def call() -> bool:
        statuses.append(gateway.infer("vision__scaler", secret)[0])
        return statuses[-1] == 200

    wait_for(call, 15, "the first routed request")
    statuses += [gateway.infer("vision__scaler", secret)[0] for _ in range(CALLS - 1)]
    answered = statuses.count(200)
    assert answered == CALLS and set(statuses) <= {200, 401, 404, 503}, (
        statuses
    )  # before the token and route are in

    result = scrape_instances()  # the platform's first scrape of both
    assert result["failures"] == 0 and result["rows"] >= 1 and result["gateway_rows"] >= 1, result
    metrics = owner_client.get("/api/v1/teams/vision/models/scaler/metrics/?range=1h").json()
    [version] = metrics["versions"]
    # Triton counted the deploy's smoke inference too (the agent's own check of the served model, as on any
    # model deployed since an instance's first scrape); the gateway counted exactly the clients' calls.
    assert (version["totals"]["requests"], version["totals"]["failure"]) == (answered + 1, 0)
    assert metrics["gateway"]["totals"]["responses_2xx"] == answered
    wide = GatewayMetrics.objects.get(deployment=None)  # its 2xx also hold the harness's health probes
    assert wide.responses_401 == statuses.count(401) and wide.responses_2xx > answered

    # Scraped again with nothing new: the same process and worker keep deltas, nothing counts twice.
    scrape_instances()
    again = owner_client.get("/api/v1/teams/vision/models/scaler/metrics/?range=1h").json()
    assert again["versions"][0]["totals"]["requests"] == answered + 1
    assert again["gateway"]["totals"]["responses_2xx"] == answered


def test_a_gateway_worker_of_unknown_start_is_only_the_baseline(
    two_teams_on_a_shared_instance, start_gateway, gateway_env, make_token, settings
):
    settings.GATEWAY_METRICS_URL = f"http://{gateway_env['GATEWAY_STATS_BIND']}/metrics"
    gateway = start_gateway(fresh=True)
    _, secret = make_token(name="client")
    wait_for(lambda: gateway.infer("vision__scaler", secret)[0] == 200, 15, "the first routed request")
    GatewayScrapeState.objects.update(started_workers=[])  # e.g. started before the platform recorded starts
    assert scrape_gateway() == 0
    assert gateway.infer("vision__scaler", secret)[0] == 200
    assert scrape_gateway() >= 1
    assert GatewayMetrics.objects.get(deployment__model__team__slug="vision").responses_2xx == 1
