"""Gateway metrics: HAProxy's exporter and its refusal counts (stick table over the admin socket) scraped in the
monitoring cycle into per-deployment and gateway-wide rows, exact per code; shown on the deployment and model
pages and in the chart API; /metrics/targets.json lists the gateway. A real HAProxy in front of a deployment
whose instance is down (every forwarded request a 503), so no tritonserver is needed."""

from __future__ import annotations

import os
import signal

import pytest
import tritonclient.grpc as grpcclient
from django.urls import reverse
from tritonclient.utils import InferenceServerException

from apps.gateway.metrics import scrape_gateway
from apps.gateway.models import GatewayMetrics, GatewayScrapeState
from apps.monitoring.tasks import scrape_instances
from apps.teams import services as team_services
from tests.conftest import client_for, wait_for
from tests.support.servers import grpc_error, requires_haproxy, team_rate_drained

pytestmark = [requires_haproxy, pytest.mark.django_db(transaction=True)]
MODEL = "vision__classifier"


@pytest.fixture
def metered_gateway(down_deployment, start_gateway, gateway_env, settings, make_token):
    """The gateway with a route to the down deployment, scraped once, no rows yet. Returns (gateway, token)."""
    settings.GATEWAY_METRICS_URL = f"http://{gateway_env['GATEWAY_STATS_BIND']}/metrics"
    gateway = start_gateway()
    _, secret = make_token(name="metrics")
    wait_for(lambda: gateway.infer(MODEL, secret)[0] == 503, 10, "the route (503: no instance)")
    scrape_gateway()  # what the wait sent is not part of the counts of the tests
    assert GatewayScrapeState.objects.get().last_error == ""
    GatewayMetrics.objects.all().delete()
    return gateway, secret


@pytest.mark.servers
def test_refusals_are_counted_exactly_per_code_per_deployment_and_gateway_wide(
    metered_gateway, down_deployment, team, other_team, outsider, client, owner
):
    gateway, secret = metered_gateway
    _, speech_secret = team_services.create_token(actor=outsider, team=other_team, name="speech")
    team.quota_requests_per_second = 2
    team.save()  # the save pokes the gateway; wait for the new limit
    wait_for(
        lambda: any(gateway.infer("vision__nothing", secret)[0] == 429 for _ in range(4)),
        10,
        "the limit of 2/s",
    )
    scrape_gateway()  # what the wait sent is not part of the counts below
    GatewayMetrics.objects.all().delete()

    statuses: dict[str, list[int]] = {}

    def send(label: str, call, times: int) -> None:
        statuses.setdefault(label, []).extend(call()[0] for _ in range(times))

    send("no token", lambda: gateway.infer(MODEL, None), 3)  # 401, names the deployment's model
    send("wrong token", lambda: gateway.infer(MODEL, "tgp_0123abcd_not-a-secret"), 2)  # 401 too
    send("no token, unknown model", lambda: gateway.infer("vision__ghost", None), 1)  # 401, gateway-wide
    send("off the allow-list", lambda: gateway.get("/v2/repository/index", secret), 2)  # 404, gateway-wide
    team_rate_drained(gateway, "vision")  # nothing of the wait above is left in the team's rate
    send("unknown model", lambda: gateway.infer("vision__ghost", secret), 1)  # 404 (within the 2/s)
    send("another team's model", lambda: gateway.infer(MODEL, speech_secret), 1)  # 404 for speech
    team_rate_drained(gateway, "vision")
    send("burst", lambda: gateway.infer(MODEL, secret), 8)  # 2 forwarded (503), then 429

    assert statuses["no token"] == [401] * 3 and statuses["wrong token"] == [401] * 2
    assert statuses["no token, unknown model"] == [401] and statuses["off the allow-list"] == [404] * 2
    assert statuses["unknown model"] == [404] and statuses["another team's model"] == [404]
    burst = statuses["burst"]
    assert set(burst) <= {503, 429} and burst.count(429) >= 3, burst
    forwarded, limited = burst.count(503), burst.count(429)

    result = scrape_instances()
    assert result["gateway_rows"] == 2, GatewayScrapeState.objects.get().last_error
    row = GatewayMetrics.objects.get(deployment=down_deployment)
    assert (row.requests, row.responses_5xx, row.responses_2xx) == (forwarded, forwarded, 0)
    # 401 and 429 naming the model count on its deployment; other teams' and unknown models' 404s do not.
    assert (row.responses_401, row.responses_429, row.responses_404) == (5, limited, 0)
    assert row.time_ms_sum >= 0
    everything = GatewayMetrics.objects.get(deployment=None)
    total = sum(len(codes) for codes in statuses.values())
    assert everything.requests == total
    assert (everything.responses_401, everything.responses_404, everything.responses_429) == (6, 4, limited)
    assert everything.responses_5xx == forwarded

    # A scrape with nothing new adds nothing.
    assert scrape_gateway() == 0
    assert GatewayMetrics.objects.get(deployment=down_deployment).responses_401 == 5

    client.force_login(owner)
    page = client.get(f"/teams/vision/deployments/{down_deployment.pk}/").content.decode()
    assert f'<dd id="gateway-requests">{forwarded}</dd>' in page
    assert f'<dd id="gateway-classes">0 / 0 / {forwarded}</dd>' in page
    assert f'<dd id="gateway-refused">5 / {limited}</dd>' in page
    page = client.get("/teams/vision/models/classifier/metrics/").content.decode()
    assert f'<dd id="gateway-requests">{forwarded}</dd>' in page and 'id="chart-gateway"' in page

    # The chart API carries the same figures beside Triton's, for the model and for the deployment.
    api = reverse("team-model-metrics", args=["vision", "classifier"])
    for query in ("?range=15m", f"?range=15m&deployment={down_deployment.pk}"):
        data = client_for(owner).get(api + query).json()["gateway"]
        assert data["totals"]["responses_401"] == 5 and data["totals"]["responses_429"] == limited
        assert data["totals"]["requests"] == forwarded and data["totals"]["responses_5xx"] == forwarded
        assert round(sum(data["rate_limited_per_second"]) * 60) == limited
        assert len(data["avg_ms"]) == 15
    # The outsider's team sees none of it; the staff fleet page carries the gateway-wide figures.
    assert client_for(outsider).get(api).status_code == 404
    assert client_for(owner).get(reverse("fleet-metrics")).json()["gateway"] is None


@pytest.mark.servers
def test_a_reload_restarts_the_counters_without_negative_or_double_counts(metered_gateway, down_deployment):
    gateway, secret = metered_gateway
    for _ in range(2):
        assert gateway.infer(MODEL, None)[0] == 401
    scrape_gateway()
    state = GatewayScrapeState.objects.get()
    old_pid = state.counters["pid"]
    # A reload: HAProxy's new worker starts every counter (exporter and stick table) at zero.
    master = int((gateway.directory / "haproxy.pid").read_text().split()[0])
    os.kill(master, signal.SIGUSR2)
    wait_for(
        lambda: scrape_gateway() is not None and GatewayScrapeState.objects.get().counters["pid"] != old_pid,
        10,
        "the new worker",
    )
    assert gateway.infer(MODEL, None)[0] == 401
    scrape_gateway()
    rows = GatewayMetrics.objects.filter(deployment=down_deployment)
    assert sum(rows.values_list("responses_401", flat=True)) == 3


def test_targets_json_lists_the_gateway(client, settings):
    settings.GATEWAY_METRICS_URL = "http://10.0.0.5:8404/metrics"
    groups = client.get("/metrics/targets.json", REMOTE_ADDR="127.0.0.1").json()
    gateway = [g for g in groups if g["labels"].get("job") == "gateway"]
    assert gateway == [
        {"targets": ["10.0.0.5:8404"], "labels": {"job": "gateway", "__metrics_path__": "/metrics"}}
    ]


@pytest.mark.servers
def test_without_the_admin_socket_the_exporter_still_counts_and_refusals_follow_later(
    metered_gateway, down_deployment, settings, tmp_path
):
    gateway, secret = metered_gateway
    for _ in range(2):
        assert gateway.infer(MODEL, None)[0] == 401
    assert gateway.infer(MODEL, secret)[0] == 503
    reachable, settings.GATEWAY_DIR = settings.GATEWAY_DIR, tmp_path / "elsewhere"
    assert scrape_gateway() == 2
    assert GatewayScrapeState.objects.get().last_error.startswith("admin socket: ")
    wide = GatewayMetrics.objects.get(deployment=None)
    assert (wide.requests, wide.responses_4xx, wide.responses_401) == (3, 2, 0)
    assert GatewayMetrics.objects.get(deployment=down_deployment).requests == 1

    assert gateway.infer(MODEL, None)[0] == 401
    settings.GATEWAY_DIR = reachable
    scrape_gateway()
    assert GatewayScrapeState.objects.get().last_error == ""
    assert GatewayMetrics.objects.get(deployment=None).responses_401 == 3
    assert GatewayMetrics.objects.get(deployment=down_deployment).responses_401 == 3


@pytest.mark.servers
def test_grpc_refusals_count_gateway_wide_with_their_http_equivalents(
    metered_gateway, down_deployment, make_token
):
    gateway, secret = metered_gateway
    # The gateway reads the model from the message: the refusals count for its deployment too.
    for _ in range(2):
        assert grpc_error(gateway.grpc_url, MODEL, "tgp_0_wrong").status() == "StatusCode.UNAUTHENTICATED"
    # An unknown model, and a method the gateway does not offer: its own "not found".
    assert grpc_error(gateway.grpc_url, "vision__missing", secret).status() == "StatusCode.NOT_FOUND"
    client = grpcclient.InferenceServerClient(gateway.grpc_url)
    with pytest.raises(InferenceServerException) as caught:
        client.unload_model(MODEL, headers={"authorization": f"Bearer {secret}"})
    client.close()
    assert caught.value.status() == "StatusCode.UNIMPLEMENTED"

    assert scrape_gateway() == 2
    wide = GatewayMetrics.objects.get(deployment=None)
    assert (wide.requests, wide.responses_401, wide.responses_404, wide.responses_429) == (4, 2, 2, 0)
    assert GatewayMetrics.objects.get(deployment=down_deployment).responses_401 == 2
