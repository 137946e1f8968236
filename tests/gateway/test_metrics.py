"""Gateway metrics: HAProxy's exporter scraped in the monitoring cycle into per-deployment rows, shown on the
deployment and model pages; /metrics/targets.json lists the gateway. A real HAProxy in front of a deployment
whose instance is down (every request a 503), so no tritonserver is needed."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.deployments.models import Deployment, DeploymentInstance, DeploymentState, PlacementState
from apps.gateway.metrics import scrape_gateway
from apps.gateway.models import GatewayMetrics
from apps.monitoring.tasks import scrape_instances
from tests.conftest import wait_for
from tests.deployments.conftest import add_instance, make_version, model, shared_host  # noqa: F401
from tests.gateway.conftest import requires_haproxy

pytestmark = [requires_haproxy, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def down_deployment(team, owner, shared_host, model):  # noqa: F811 - the imported fixtures
    version = make_version(model, 1)
    instance = add_instance(shared_host, port=1)  # nothing listens on port 1: the server is DOWN
    deployment = Deployment.objects.create(
        team=team, model=model, active_version=version, state=DeploymentState.SERVING, created_by=owner
    )
    DeploymentInstance.objects.create(
        deployment=deployment, instance=instance, served_version=version, state=PlacementState.READY
    )
    return deployment


def test_scrape_writes_per_deployment_rows_and_pages_show_them(
    down_deployment, start_gateway, gateway_env, make_token, settings, client, owner
):
    settings.GATEWAY_METRICS_URL = f"http://{gateway_env['GATEWAY_STATS_BIND']}/metrics"
    gateway = start_gateway()
    _, secret = make_token(name="metrics")
    wait_for(
        lambda: gateway.infer("vision__classifier", secret)[0] == 503, 10, "the route (503: no instance)"
    )
    assert scrape_gateway() == 0  # the first scrape is the baseline
    for _ in range(3):
        assert gateway.infer("vision__classifier", secret)[0] == 503
    assert gateway.infer("vision__classifier", None)[0] == 401
    result = scrape_instances()
    assert result["gateway_rows"] == 2

    row = GatewayMetrics.objects.get(deployment=down_deployment)
    assert (row.requests, row.responses_5xx, row.responses_2xx) == (3, 3, 0)
    assert row.time_ms_sum >= 0
    everything = GatewayMetrics.objects.get(deployment=None)
    assert everything.requests == 4 and everything.responses_4xx == 1 and everything.responses_5xx == 3

    # A scrape with nothing new adds nothing.
    assert scrape_gateway() == 0
    assert GatewayMetrics.objects.get(deployment=down_deployment).requests == 3

    client.force_login(owner)
    page = client.get(f"/teams/vision/deployments/{down_deployment.pk}/").content.decode()
    assert '<dd id="gateway-requests">3</dd>' in page and '<dd id="gateway-classes">0 / 0 / 3</dd>' in page
    page = client.get("/teams/vision/models/classifier/metrics/").content.decode()
    assert '<dd id="gateway-requests">3</dd>' in page
    assert GatewayMetrics.objects.filter(bucket__gte=timezone.now() - timedelta(minutes=2)).count() == 2
