"""The team's request rate quota: every member reads it (API and settings page), only platform staff change it
(audited, bounded, a 400 that says what to fix), and the real gateway enforces a change within 5 s with a 429
that names the limit."""

from __future__ import annotations

import time

import pytest

from apps.audit.models import AuditEvent
from apps.teams import services
from apps.teams.models import Team
from tests.conftest import bearer_client, client_for, wait_for
from tests.factories import MembershipFactory, UserFactory
from tests.support.servers import grpc_error, requires_haproxy, team_rate_drained

MODEL = "vision__classifier"  # the model of down_deployment

URL = "/api/v1/teams/vision/"


@pytest.fixture
def staff(db):
    return UserFactory(username="ops", is_staff=True)


def test_members_read_the_quota_and_only_staff_change_it(
    owner_client, viewer_client, outsider_client, owner, team, staff, settings
):
    assert (
        viewer_client.get(URL).json()["quota_requests_per_second"]
        == settings.GATEWAY_DEFAULT_REQUESTS_PER_SECOND
    )
    response = owner_client.patch(URL, {"quota_requests_per_second": 5000}, format="json")
    assert response.status_code == 403 and "platform staff" in response.json()["message"]
    assert outsider_client.patch(URL, {"quota_requests_per_second": 5}, format="json").status_code == 404
    assert owner_client.patch(URL, {"name": "Vision"}, format="json").status_code == 200

    response = client_for(staff).patch(URL, {"quota_requests_per_second": 25}, format="json")
    assert response.status_code == 200 and response.json()["quota_requests_per_second"] == 25
    assert Team.objects.get(slug="vision").quota_requests_per_second == 25
    event = AuditEvent.objects.get(action="team.quota_changed")
    assert (event.actor, event.team, event.details["from"], event.details["to"]) == (
        staff,
        team,
        settings.GATEWAY_DEFAULT_REQUESTS_PER_SECOND,
        25,
    )
    assert viewer_client.get(URL).json()["quota_requests_per_second"] == 25
    # Staff may not rename a team they are not in; nothing is written when part of a request is refused.
    response = client_for(staff).patch(URL, {"quota_requests_per_second": 30, "name": "X"}, format="json")
    assert response.status_code == 403 and Team.objects.get(slug="vision").quota_requests_per_second == 25


@pytest.mark.parametrize("value", [0, -1, services.MAX_REQUESTS_PER_SECOND + 1, "5", 2.5, True, None, [5]])
def test_a_bad_quota_is_a_400_that_says_what_to_fix(staff, team, value):
    response = client_for(staff).patch(URL, {"quota_requests_per_second": value}, format="json")
    assert response.status_code == 400, response.json()
    assert "whole number of requests per second from 1 to 100000" in str(response.json())
    assert not AuditEvent.objects.filter(action="team.quota_changed").exists()


def test_a_staff_members_api_token_cannot_change_quotas(team, make_token):
    ops = UserFactory(username="ops-owner", is_staff=True)
    MembershipFactory(team=team, user=ops, role="owner")
    _, secret = make_token(name="ops", user=ops)
    response = bearer_client(secret).patch(URL, {"quota_requests_per_second": 9}, format="json")
    assert response.status_code == 403


def test_settings_page_shows_the_quota_and_staff_set_it(client, owner, team, staff):
    client.force_login(owner)
    page = client.get("/teams/vision/settings/").content.decode()
    assert (
        f'<dd id="quota-rps">{team.quota_requests_per_second}</dd>' in page and 'id="quota-form"' not in page
    )
    assert (
        client.post(
            "/teams/vision/settings/", {"op": "set_quota", "quota_requests_per_second": 3}
        ).status_code
        == 403
    )

    MembershipFactory(team=team, user=staff, role="viewer")
    client.force_login(staff)
    assert 'id="quota-form"' in client.get("/teams/vision/settings/").content.decode()
    response = client.post("/teams/vision/settings/", {"op": "set_quota", "quota_requests_per_second": 0})
    assert response.status_code == 400 and "greater than or equal to 1" in response.content.decode()
    response = client.post("/teams/vision/settings/", {"op": "set_quota", "quota_requests_per_second": 7})
    assert response.status_code == 302
    assert Team.objects.get(pk=team.pk).quota_requests_per_second == 7
    assert AuditEvent.objects.filter(action="team.quota_changed", details__to=7).exists()


@requires_haproxy
@pytest.mark.servers
@pytest.mark.django_db(transaction=True)
def test_a_changed_quota_takes_effect_at_the_gateway_within_5_seconds(
    down_deployment,
    start_gateway,
    make_token,
    staff,
):
    gateway = start_gateway()
    _, secret = make_token(name="client")
    wait_for(lambda: gateway.infer(MODEL, secret)[0] == 503, 10, "the route (503: no instance)")
    burst = [gateway.infer(MODEL, secret)[0] for _ in range(6)]
    assert 429 not in burst, burst  # the default quota

    response = client_for(staff).patch(URL, {"quota_requests_per_second": 2}, format="json")
    assert response.status_code == 200
    changed = time.monotonic()

    def limited():
        answers = [gateway.infer(MODEL, secret) for _ in range(4)]
        return next((body for status, body in answers if status == 429), None)

    body = wait_for(limited, 5, "the new quota at the gateway", interval=0.2)
    assert time.monotonic() - changed < 5
    assert body["error"] == "rate limit exceeded: team vision may send 2 requests per second"


def test_the_admin_shows_the_quota_but_changes_go_through_the_audited_service(client, team):
    admin = UserFactory(username="root", is_staff=True, is_superuser=True)
    client.force_login(admin)
    response = client.get(f"/admin/teams/team/{team.pk}/change/")
    page = response.content.decode()
    assert response.status_code == 200 and 'name="name"' in page  # the change form
    assert 'name="quota_requests_per_second"' not in page
    assert f'<div class="readonly">{team.quota_requests_per_second}</div>' in page


@requires_haproxy
@pytest.mark.servers
@pytest.mark.django_db(transaction=True)
def test_grpc_over_the_quota_is_resource_exhausted_naming_the_limit(
    down_deployment,
    start_gateway,
    make_token,
    team,
):
    team.quota_requests_per_second = 1
    team.save()
    gateway = start_gateway()
    _, secret = make_token(name="client")
    wait_for(lambda: gateway.infer(MODEL, secret)[0] in (503, 429), 10, "the route")
    team_rate_drained(gateway, "vision")  # the route's wait is not part of the team's rate below
    statuses = [grpc_error(gateway.grpc_url, "vision__missing", secret) for _ in range(3)]
    codes = [error.status() for error in statuses]
    # Admitted (an unknown model), then over the limit.
    assert codes[0] == "StatusCode.NOT_FOUND" and "StatusCode.RESOURCE_EXHAUSTED" in codes[1:], codes
    limited = next(e for e in statuses if e.status() == "StatusCode.RESOURCE_EXHAUSTED")
    assert limited.message() == "rate limit exceeded: team vision may send 1 requests per second"
