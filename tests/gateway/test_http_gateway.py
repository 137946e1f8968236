"""The gateway over HTTP with real HAProxy, host agents and tritonservers: tokens, tenancy, the allow-list and
the per-team rate limit."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from datetime import timedelta

import pytest
from django.utils import timezone

from apps.teams import services as team_services
from backend_ge.runtime import API_KEY_HEADER
from tests.conftest import wait_for
from tests.support.models import INFER_BODY, output_of
from tests.support.servers import requires_haproxy, team_rate_drained

pytestmark = [pytest.mark.triton, requires_haproxy, pytest.mark.django_db(transaction=True)]

# Paths a tenant must not reach through the gateway, with a valid token: every one is a 404.
PATH_TRICKS = [
    ("GET", "/v2/repository/index"),
    ("POST", "/v2/repository/index"),
    ("POST", "/v2/repository/models/vision__scaler/load"),
    ("POST", "/v2/repository/models/vision__scaler/unload"),
    ("GET", "/v2/models/stats"),
    ("GET", "/v2/models/vision__scaler/stats"),
    ("GET", "/v2/systemsharedmemory/status"),
    ("POST", "/v2/systemsharedmemory/region/x/register"),
    ("GET", "/v2/cudasharedmemory/status"),
    ("GET", "/v2/trace/setting"),
    ("POST", "/v2/logging"),
    ("GET", "/v2/models/vision__scaler/../speech__scaler"),
    ("GET", "/v2/models/vision__scaler/versions/1/../../../speech__scaler/ready"),
    ("GET", "/v2//models/vision__scaler"),
    ("GET", "/v2/models//vision__scaler"),
    ("GET", "/v2/models/vision%5F%5Fscaler"),
    ("GET", "/v2/models/vision_%5fscaler"),
    ("GET", "/v2/models/vision__scaler%2Fready"),
    ("GET", "/v2/models/vision%2D%2Dscaler"),
    ("GET", "/v2/models/vision__scaler__candidate"),
    ("GET", "/v2/models/VISION__scaler"),
    ("GET", "/v2/models/vision__scaler/versions/0/ready"),
    ("GET", "/v2/models/vision__scaler/versions/-1/ready"),
    ("GET", "/v2/models/vision__scaler/infer"),
    ("POST", "/v2/models/vision__scaler/ready"),
    ("DELETE", "/v2/models/vision__scaler"),
    ("GET", "/v2/models/vision__scaler/"),
    ("GET", "/metrics"),
]


def test_tokens_tenancy_and_allow_list(
    two_teams_on_a_shared_instance, start_gateway, make_token, owner, outsider, other_team
):
    gateway = start_gateway()
    _, secret = make_token(name="client")
    _, read_only = make_token(name="dashboard", read_only=True)
    inference, inference_secret = team_services.create_token(
        actor=owner, team=owner.memberships.get().team, name="edge", inference_only=True
    )
    _, speech_secret = team_services.create_token(actor=outsider, team=other_team, name="speech")

    # The right token: 200 with the team's own model; read-only and inference-only tokens infer too.
    status, answer = wait_for(
        lambda: (r := gateway.infer("vision__scaler", secret))[0] == 200 and r, 15, "the first routed request"
    )
    assert answer["model_name"] == "vision__scaler" and answer["model_version"] == "1"
    assert output_of(answer) == [2.0, 4.0, 6.0, 8.0]
    assert gateway.infer("vision__scaler", read_only)[0] == 200
    assert gateway.infer("vision__scaler", inference_secret)[0] == 200
    # Each deployment is its own backend with its own health checks: the second may come up a moment later.
    status, answer = wait_for(
        lambda: (r := gateway.infer("speech__scaler", speech_secret))[0] == 200 and r, 10, "the speech model"
    )
    assert output_of(answer) == [3.0, 6.0, 9.0, 12.0]
    assert gateway.get("/v2/models/vision__scaler/ready", secret)[0] == 200
    assert gateway.get("/v2/models/vision__scaler/versions/1/ready", secret)[0] == 200
    status, metadata = gateway.get("/v2/models/vision__scaler", secret)
    assert status == 200 and metadata["name"] == "vision__scaler"
    assert gateway.get("/v2/models/vision__scaler/config", secret)[0] == 200
    assert gateway.get("/v2/health/live")[0] == 200 and gateway.get("/v2/health/ready")[0] == 200

    # Missing and wrong tokens: 401 with a KServe-style error.
    for token in (None, "tgp_0000_nope", secret[:-2] + "xx", "not-a-token", secret + "x"):
        status, body = gateway.infer("vision__scaler", token)
        assert status == 401 and "token" in body["error"], (token, status, body)

    # Another team's model on the same shared instance is the same 404 as a model that does not exist.
    other = gateway.infer("speech__scaler", secret)
    missing = gateway.infer("vision__nothing", secret)
    assert other[0] == missing[0] == 404
    assert other[1]["error"] == "Request for unknown model: 'speech__scaler' is not found"
    assert missing[1]["error"] == "Request for unknown model: 'vision__nothing' is not found"
    assert gateway.get("/v2/models/speech__scaler", secret)[0] == 404

    for method, path in PATH_TRICKS:
        status, body = gateway.request(method, path, secret, b"{}" if method == "POST" else None)
        assert status == 404, (method, path, status, body)

    # Revocation takes effect within 5 s (the revoke pokes the gateway; its loop would catch it anyway).
    team_services.revoke_token(actor=owner, token=inference)
    revoked_at = time.monotonic()
    wait_for(lambda: gateway.infer("vision__scaler", inference_secret)[0] == 401, 5, "the revocation")
    assert time.monotonic() - revoked_at < 5
    assert gateway.infer("vision__scaler", secret)[0] == 200


def test_expired_token_is_refused_at_its_expiry(two_teams_on_a_shared_instance, start_gateway, make_token):
    gateway = start_gateway()
    _, secret = make_token(name="short", expires_at=timezone.now() + timedelta(seconds=3))
    wait_for(lambda: gateway.infer("vision__scaler", secret)[0] == 200, 3, "the token to work")
    status, body = wait_for(
        lambda: (r := gateway.infer("vision__scaler", secret))[0] == 401 and r, 5, "the token to expire"
    )
    assert body["error"] == "the API token has expired; create a new one"


def test_team_rate_limit_answers_429_naming_the_limit(
    two_teams_on_a_shared_instance, start_gateway, make_token, team
):
    team.quota_requests_per_second = 5
    team.save()
    gateway = start_gateway()
    _, secret = make_token(name="client")
    wait_for(lambda: gateway.infer("vision__scaler", secret)[0] == 200, 5, "the first request")
    team_rate_drained(gateway, "vision")  # the whole limit for the requests below
    statuses = [gateway.get("/v2/models/vision__scaler/ready", secret) for _ in range(12)]
    codes = [status for status, _ in statuses]
    assert codes.count(200) >= 4 and codes.count(429) >= 5, codes
    limited = next(body for status, body in statuses if status == 429)
    assert limited["error"] == "rate limit exceeded: team vision may send 5 requests per second"


def test_triton_refuses_direct_calls_without_the_instance_key(two_teams_on_a_shared_instance):
    instance = two_teams_on_a_shared_instance
    base = instance.endpoint_url()

    def call(method: str, path: str, headers: dict | None = None) -> int:
        body = INFER_BODY if method == "POST" else None
        request = urllib.request.Request(base + path, data=body, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code

    # Without the key: inference, metadata, statistics, the repository API - all 403. Health stays open.
    for method, path in [
        ("POST", "/v2/models/vision__scaler/infer"),
        ("GET", "/v2/models/vision__scaler"),
        ("GET", "/v2/models/vision__scaler/config"),
        ("GET", "/v2/models/stats"),
        ("POST", "/v2/repository/index"),
    ]:
        assert call(method, path) == 403, (method, path)
        assert call(method, path, {API_KEY_HEADER: "not-the-key"}) == 403, (method, path)
    assert call("GET", "/v2/health/ready") == 200
    # The platform holds the key.
    assert call("POST", "/v2/models/vision__scaler/infer", instance.key_headers()) == 200
