"""The token table says what a token may do now: who created it, its access narrowed by the creator's role
(a viewer's token is read-only), and a removed member's token as inactive (authentication refuses it)."""

from __future__ import annotations

import pytest

from apps.teams import services
from apps.teams.models import Membership, Role
from tests.conftest import bearer_client
from tests.factories import MembershipFactory, UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def web(client, owner):
    client.force_login(owner)
    return client


@pytest.fixture
def second_owner(team):
    return MembershipFactory(team=team, user=UserFactory(username="sam"), role=Role.OWNER).user


def row(html: str, prefix: str) -> str:
    start = html.index(f'data-token="{prefix}"')
    return html[start : html.index("</tr>", start)]


def test_token_row_names_its_creator_and_read_write_access(web, make_token):
    token, _ = make_token(name="deploy bot")
    html = row(web.get("/teams/vision/settings/").content.decode(), token.display_prefix)
    assert "by olivia" in html and ">read-write, manage<" in html and ">active<" in html


def test_read_only_flag_is_labelled_read_only(web, make_token):
    token, _ = make_token(name="dash", read_only=True)
    assert ">read-only<" in row(web.get("/teams/vision/settings/").content.decode(), token.display_prefix)


def test_token_of_a_creator_demoted_to_viewer_is_labelled_read_only_and_is(web, owner, team, second_owner):
    token, secret = services.create_token(actor=second_owner, team=team, name="sam's script")
    membership = Membership.objects.get(team=team, user=second_owner)
    services.change_member_role(actor=owner, membership=membership, role=Role.VIEWER)
    html = row(web.get("/teams/vision/settings/").content.decode(), token.display_prefix)
    assert ">read-only<" in html and "read-write" not in html and "by sam" in html
    api = bearer_client(secret)
    assert api.get("/api/v1/teams/vision/models/").status_code == 200
    assert api.post("/api/v1/teams/vision/models/", {"name": "x"}, format="json").status_code == 403


def test_removed_members_token_is_inactive_and_refused(web, owner, team, second_owner, owner_client):
    token, secret = services.create_token(actor=second_owner, team=team, name="sam's script")
    services.remove_member(actor=owner, membership=Membership.objects.get(team=team, user=second_owner))
    html = row(web.get("/teams/vision/settings/").content.decode(), token.display_prefix)
    assert ">inactive<" in html and ">none<" in html and ">active<" not in html
    assert bearer_client(secret).get("/api/v1/teams/vision/models/").status_code == 401
    listed = {t["prefix"]: t for t in owner_client.get("/api/v1/teams/vision/tokens/").json()["results"]}
    assert listed[token.display_prefix]["status"] == "inactive"
    assert listed[token.display_prefix]["access"] == "none"
