"""Gateway metrics with a real tritonserver behind the gateway: successes per deployment, and a 404 answered by
the deployment's instance (a version it does not serve) counted on that deployment, unlike the gateway's own."""

from __future__ import annotations

import pytest

from apps.deployments.models import Deployment
from apps.gateway.metrics import scrape_gateway
from apps.gateway.models import GatewayMetrics, GatewayScrapeState
from tests.conftest import wait_for
from tests.support.servers import requires_haproxy

pytestmark = [pytest.mark.triton, requires_haproxy, pytest.mark.django_db(transaction=True)]


def test_an_instances_404_counts_on_its_deployment_and_successes_by_class(
    two_teams_on_a_shared_instance,
    start_gateway,
    gateway_env,
    make_token,
    settings,
):
    settings.GATEWAY_METRICS_URL = f"http://{gateway_env['GATEWAY_STATS_BIND']}/metrics"
    gateway = start_gateway()
    _, secret = make_token(name="client")
    wait_for(lambda: gateway.infer("vision__scaler", secret)[0] == 200, 15, "the first routed request")
    scrape_gateway()  # what the wait sent is not part of the counts below
    GatewayMetrics.objects.all().delete()

    assert [gateway.infer("vision__scaler", secret)[0] for _ in range(3)] == [200] * 3
    status, body = gateway.infer("vision__scaler", secret, version=7)  # Triton: no such version
    assert status == 404, body
    assert gateway.infer("speech__scaler", secret)[0] == 404  # another team's: the gateway's own 404

    scrape_gateway()
    assert GatewayScrapeState.objects.get().last_error == ""
    vision = Deployment.objects.get(team__slug="vision")
    row = GatewayMetrics.objects.get(deployment=vision)
    assert (row.responses_2xx, row.responses_4xx, row.responses_404) == (3, 1, 1)
    assert row.requests >= 4 and row.time_ms_sum > 0
    assert not GatewayMetrics.objects.filter(deployment__team__slug="speech").exists()
    wide = GatewayMetrics.objects.get(deployment=None)
    assert (wide.responses_2xx, wide.responses_404, wide.responses_401) == (3, 2, 0)
