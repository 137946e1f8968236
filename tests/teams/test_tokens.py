from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from apps.teams import services
from apps.teams.models import ApiToken, Membership
from tests.conftest import bearer_client

pytestmark = pytest.mark.django_db


def test_create_token_returns_secret_once_and_list_never_does(owner_client, team):
    response = owner_client.post("/api/v1/teams/vision/tokens/", {"name": "CI"}, format="json")
    assert response.status_code == 201, response.json()
    secret = response.json()["token"]
    assert secret.startswith(response.json()["prefix"] + "_")
    listed = owner_client.get("/api/v1/teams/vision/tokens/").json()["results"]
    assert len(listed) == 1 and "token" not in listed[0]
    detail = owner_client.get(f"/api/v1/teams/vision/tokens/{listed[0]['id']}/").json()
    assert "token" not in detail and secret not in str(detail)


def test_database_holds_no_token_plaintext(make_token):
    token, plaintext = make_token()
    secret = plaintext.split("_", 2)[2]  # the secret itself may contain underscores
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM teams_apitoken WHERE id = %s", [token.pk])
        row = cursor.fetchone()
    assert all(secret not in str(value) for value in row)
    assert token.secret_hash != secret and len(token.secret_hash) == 64


def test_bearer_token_authenticates_as_creator_narrowed_to_its_team(make_token, other_team, owner):
    Membership.objects.create(team=other_team, user=owner, role="owner")
    _, plaintext = make_token()
    client = bearer_client(plaintext)
    me = client.get("/api/v1/me/").json()
    assert me["username"] == "olivia"
    assert [t["slug"] for t in me["teams"]] == ["vision"]
    assert me["token"]["name"] == "ci"
    # The creator is an owner of 'speech' too, but this token belongs to 'vision' only.
    assert client.get("/api/v1/teams/speech/").status_code == 404
    assert client.get("/api/v1/teams/speech/members/").status_code == 404


def test_read_only_token_reads_but_cannot_write(make_token, viewer):
    _, plaintext = make_token(read_only=True)
    client = bearer_client(plaintext)
    assert client.get("/api/v1/teams/vision/members/").status_code == 200
    response = client.post("/api/v1/teams/vision/members/", {"user": "vera", "role": "owner"}, format="json")
    assert response.status_code == 403
    assert "read-only" in response.json()["message"]
    assert client.post("/api/v1/teams/vision/tokens/", {"name": "x"}, format="json").status_code == 403
    assert client.patch("/api/v1/teams/vision/", {"name": "x"}, format="json").status_code == 403


def test_read_write_token_of_owner_can_manage(make_token, viewer):
    _, plaintext = make_token()
    membership = Membership.objects.get(user=viewer)
    response = bearer_client(plaintext).patch(
        f"/api/v1/teams/vision/members/{membership.pk}/", {"role": "maintainer"}, format="json"
    )
    assert response.status_code == 200
    from apps.audit.models import AuditEvent

    assert AuditEvent.objects.get(action="member.role_changed").actor_label.startswith("olivia (token tgp_")


def test_token_cannot_create_teams(make_token):
    _, plaintext = make_token()
    response = bearer_client(plaintext).post("/api/v1/teams/", {"name": "New"}, format="json")
    assert response.status_code == 403


def test_expired_token_gets_401(make_token):
    token, plaintext = make_token(expires_at=timezone.now() + timedelta(hours=1))
    ApiToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    response = bearer_client(plaintext).get("/api/v1/me/")
    assert response.status_code == 401
    assert "expired" in response.json()["message"]
    assert response["WWW-Authenticate"].startswith("Bearer")


def test_revoked_token_gets_401_and_revoke_is_recorded(owner_client, make_token):
    token, plaintext = make_token()
    assert bearer_client(plaintext).get("/api/v1/me/").status_code == 200
    assert owner_client.delete(f"/api/v1/teams/vision/tokens/{token.pk}/").status_code == 204
    response = bearer_client(plaintext).get("/api/v1/me/")
    assert response.status_code == 401 and "revoked" in response.json()["message"]
    token.refresh_from_db()
    assert token.revoked_at is not None and token.status == "revoked"
    # Revoking again is harmless and adds no second event.
    assert owner_client.delete(f"/api/v1/teams/vision/tokens/{token.pk}/").status_code == 204
    from apps.audit.models import AuditEvent

    assert AuditEvent.objects.filter(action="token.revoked").count() == 1


@pytest.mark.parametrize("header", ["Bearer tgp_deadbeef_wrongsecret", "Bearer nonsense", "Bearer tgp__"])
def test_wrong_or_malformed_token_gets_401(make_token, header):
    make_token()
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=header)
    response = client.get("/api/v1/me/")
    assert response.status_code == 401
    assert response.json()["message"]


def test_token_stops_working_when_creator_leaves_team(make_token, owner, maintainer, team):
    _, plaintext = make_token(user=maintainer)
    assert bearer_client(plaintext).get("/api/v1/me/").status_code == 200
    Membership.objects.filter(user=maintainer, team=team).delete()
    response = bearer_client(plaintext).get("/api/v1/me/")
    assert response.status_code == 401
    assert "no longer" in response.json()["message"]


def test_maintainer_token_cannot_manage_tokens(make_token, maintainer):
    _, plaintext = make_token(user=maintainer)
    assert bearer_client(plaintext).get("/api/v1/teams/vision/tokens/").status_code == 403


def test_last_used_is_updated_at_most_once_a_minute(make_token):
    token, _ = make_token()
    start = timezone.now()
    services.touch_token_last_used(token, start)
    token.refresh_from_db()
    assert token.last_used_at == start
    services.touch_token_last_used(token, start + timedelta(seconds=30))
    token.refresh_from_db()
    assert token.last_used_at == start
    later = start + timedelta(seconds=61)
    services.touch_token_last_used(token, later)
    token.refresh_from_db()
    assert token.last_used_at == later


def test_authenticating_sets_last_used(make_token):
    token, plaintext = make_token()
    assert token.last_used_at is None
    bearer_client(plaintext).get("/api/v1/me/")
    token.refresh_from_db()
    assert token.last_used_at is not None


def test_token_validation_errors(owner_client):
    response = owner_client.post("/api/v1/teams/vision/tokens/", {"name": " "}, format="json")
    assert response.status_code == 400 and "name" in response.json()["fields"]
    past = (timezone.now() - timedelta(days=1)).isoformat()
    response = owner_client.post(
        "/api/v1/teams/vision/tokens/", {"name": "x", "expires_at": past}, format="json"
    )
    assert response.status_code == 400 and "future" in response.json()["fields"]["expires_at"][0]
    assert not ApiToken.objects.exists()


def test_token_list_filters_active(owner_client, make_token):
    revoked, _ = make_token(name="old")
    make_token(name="new")
    services.revoke_token(actor=revoked.created_by, token=revoked)
    names = [
        t["name"] for t in owner_client.get("/api/v1/teams/vision/tokens/?active=true").json()["results"]
    ]
    assert names == ["new"]


def test_secret_with_underscores_authenticates(make_token, monkeypatch):
    monkeypatch.setattr("apps.teams.services.secrets.token_urlsafe", lambda n: "ab_cd_" + "x" * 37)
    token, plaintext = make_token()
    assert plaintext == f"{token.display_prefix}_ab_cd_{'x' * 37}"
    assert bearer_client(plaintext).get("/api/v1/me/").status_code == 200
    assert bearer_client(plaintext[:-1]).get("/api/v1/me/").status_code == 401
