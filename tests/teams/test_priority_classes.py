"""Priority classes on tokens and teams: the API and the team page set them (owners only, bad values 400
naming the field), the audit log records changes, and the gateway's token map carries the class it applies."""

from __future__ import annotations

import pytest

from apps.audit.models import AuditEvent
from apps.gateway.state import desired_state
from apps.teams import services
from apps.teams.models import ApiToken

pytestmark = pytest.mark.django_db


def token_class_in_gateway(token: ApiToken) -> str:
    value = desired_state().tokens[f"{token.prefix}:{token.secret_hash}"]
    return value.split(":")[2]


def test_a_token_follows_its_team_default_unless_it_names_a_class(owner_client, owner, team):
    created = owner_client.post(
        "/api/v1/teams/vision/tokens/", {"name": "nightly", "priority_class": "batch"}, format="json"
    )
    assert created.status_code == 201, created.content
    assert created.json()["priority_class"] == "batch"
    assert created.json()["effective_priority_class"] == "batch"
    default = owner_client.post("/api/v1/teams/vision/tokens/", {"name": "app"}, format="json").json()
    assert default["priority_class"] == "" and default["effective_priority_class"] == "interactive"

    nightly, app = ApiToken.objects.get(name="nightly"), ApiToken.objects.get(name="app")
    assert token_class_in_gateway(nightly) == "batch"
    assert token_class_in_gateway(app) == "interactive"

    answer = owner_client.patch("/api/v1/teams/vision/", {"default_priority_class": "batch"}, format="json")
    assert answer.status_code == 200 and answer.json()["default_priority_class"] == "batch"
    assert token_class_in_gateway(app) == "batch"
    listed = {t["name"]: t for t in owner_client.get("/api/v1/teams/vision/tokens/").json()["results"]}
    assert listed["app"]["effective_priority_class"] == "batch"

    changed = owner_client.patch(
        f"/api/v1/teams/vision/tokens/{app.pk}/", {"priority_class": "interactive"}, format="json"
    )
    assert changed.status_code == 200 and changed.json()["effective_priority_class"] == "interactive"
    assert token_class_in_gateway(app) == "interactive"
    actions = set(AuditEvent.objects.filter(team=team).values_list("action", flat=True))
    assert {"team.priority_class_changed", "token.priority_class_changed"} <= actions


@pytest.mark.parametrize("value", ["urgent", "INTERACTIVE", 1, None, ["batch"]])
def test_an_unknown_class_is_a_400_naming_the_field(owner_client, value):
    created = owner_client.post(
        "/api/v1/teams/vision/tokens/", {"name": "x", "priority_class": value}, format="json"
    )
    assert created.status_code == 400 and "priority_class" in created.json()["fields"], created.content
    team = owner_client.patch("/api/v1/teams/vision/", {"default_priority_class": value}, format="json")
    assert team.status_code == 400 and "default_priority_class" in team.json()["fields"], team.content
    assert not ApiToken.objects.filter(name="x").exists()


def test_only_the_class_of_a_token_changes(owner_client, make_token):
    token, _ = make_token(name="ci")
    answer = owner_client.patch(
        f"/api/v1/teams/vision/tokens/{token.pk}/",
        {"priority_class": "batch", "read_only": True},
        format="json",
    )
    assert answer.status_code == 400 and "read_only" in answer.json()["fields"]
    token.refresh_from_db()
    assert token.priority_class == "" and not token.read_only


def test_maintainers_and_other_teams_cannot_change_classes(maintainer_client, outsider, make_token):
    token, _ = make_token(name="ci")
    assert (
        maintainer_client.patch(
            f"/api/v1/teams/vision/tokens/{token.pk}/", {"priority_class": "batch"}, format="json"
        ).status_code
        == 403
    )
    assert (
        maintainer_client.patch(
            "/api/v1/teams/vision/", {"default_priority_class": "batch"}, format="json"
        ).status_code
        == 403
    )
    from tests.conftest import client_for

    stranger = client_for(outsider)
    assert (
        stranger.patch(
            f"/api/v1/teams/vision/tokens/{token.pk}/", {"priority_class": "batch"}, format="json"
        ).status_code
        == 404
    )
    token.refresh_from_db()
    assert token.priority_class == ""


def test_the_team_page_sets_both_classes(client, owner, team, make_token):
    token, _ = make_token(name="ci")
    client.force_login(owner)
    page = client.get("/teams/vision/settings/").content.decode()
    assert 'name="priority_class"' in page and "team default (interactive)" in page
    client.post(
        "/teams/vision/settings/",
        {"op": "set_token_priority_class", "token": token.pk, "priority_class": "batch"},
    )
    client.post("/teams/vision/settings/", {"op": "set_default_priority_class", "priority_class": "batch"})
    token.refresh_from_db()
    team.refresh_from_db()
    assert token.effective_priority_class == "batch" and team.default_priority_class == "batch"
    client.post("/teams/vision/settings/", {"op": "set_default_priority_class", "priority_class": "urgent"})
    team.refresh_from_db()
    assert team.default_priority_class == "batch"
    created = client.post(
        "/teams/vision/settings/", {"op": "create_token", "name": "bulk", "priority_class": "interactive"}
    )
    assert created.status_code == 302
    assert ApiToken.objects.get(name="bulk").priority_class == "interactive"
    services.revoke_token(actor=owner, token=token)
