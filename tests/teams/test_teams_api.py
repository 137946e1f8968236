import pytest

from apps.audit.models import AuditEvent
from apps.teams.models import Membership, Role, TeamInvitation
from tests.factories import MembershipFactory, UserFactory

pytestmark = pytest.mark.django_db


def test_me_lists_own_teams_with_roles(maintainer_client, team, other_team):
    response = maintainer_client.get("/api/v1/me/")
    assert response.status_code == 200
    assert response.json()["username"] == "max"
    assert [(t["slug"], t["role"]) for t in response.json()["teams"]] == [("vision", "maintainer")]
    assert response.json()["token"] is None


def test_unauthenticated_request_gets_401_json(client):
    response = client.get("/api/v1/me/")
    assert response.status_code == 401
    assert response.json()["error"] == "not_authenticated"
    assert "credentials" in response.json()["message"].lower()


def test_team_list_shows_only_member_teams(outsider_client, team, other_team, owner):
    response = outsider_client.get("/api/v1/teams/")
    assert response.status_code == 200
    assert [t["slug"] for t in response.json()["results"]] == ["speech"]


def test_outsider_gets_404_for_team_detail(outsider_client, team, owner):
    response = outsider_client.get("/api/v1/teams/vision/")
    assert response.status_code == 404
    assert response.json()["error"] == "not_found"


def test_create_team_makes_creator_owner_and_records_event(viewer_client, viewer):
    response = viewer_client.post("/api/v1/teams/", {"name": "Speech Lab"}, format="json")
    assert response.status_code == 201, response.json()
    assert response.json()["slug"] == "speech-lab"
    assert response.json()["role"] == "owner"
    assert Membership.objects.get(team__slug="speech-lab", user=viewer).role == Role.OWNER
    event = AuditEvent.objects.get(action="team.created")
    assert event.actor == viewer and event.team.slug == "speech-lab"


def test_duplicate_team_slug_is_400_with_field_message(owner_client, team):
    response = owner_client.post("/api/v1/teams/", {"name": "Other", "slug": "vision"}, format="json")
    assert response.status_code == 400
    body = response.json()
    assert body["error"] == "invalid"
    assert "already exists" in body["fields"]["slug"][0]
    assert body["message"].startswith("slug:")


def test_invalid_team_slug_is_400(owner_client):
    response = owner_client.post("/api/v1/teams/", {"name": "X", "slug": "Bad Slug!"}, format="json")
    assert response.status_code == 400
    assert "lowercase" in response.json()["fields"]["slug"][0]


def test_malformed_json_is_400_with_message(owner_client, team):
    response = owner_client.generic(
        "POST", "/api/v1/teams/vision/members/", '{"user": "x", role', content_type="application/json"
    )
    assert response.status_code == 400
    assert response.json()["error"] == "parse_error"
    assert "JSON" in response.json()["message"]


def test_owner_renames_team_viewer_cannot(owner_client, viewer_client, team):
    assert viewer_client.patch("/api/v1/teams/vision/", {"name": "V2"}, format="json").status_code == 403
    response = owner_client.patch("/api/v1/teams/vision/", {"name": "Vision Models"}, format="json")
    assert response.status_code == 200
    assert response.json()["name"] == "Vision Models"
    assert AuditEvent.objects.filter(action="team.renamed", details__to="Vision Models").exists()


# --- members ------------------------------------------------------------------------------------


def test_members_list_visible_to_viewer(viewer_client, owner, maintainer):
    response = viewer_client.get("/api/v1/teams/vision/members/")
    assert response.status_code == 200
    assert sorted(m["username"] for m in response.json()["results"]) == ["max", "olivia", "vera"]


def test_owner_invites_member_by_email_instead_of_adding(owner_client, team):
    UserFactory(username="nina", email="nina@example.com")
    response = owner_client.post(
        "/api/v1/teams/vision/members/", {"user": " NINA@example.com", "role": "maintainer"}, format="json"
    )
    assert response.status_code == 202, response.json()
    assert response.json() == {
        "message": "Invitation recorded: if an account with the username or email 'nina@example.com' exists, "
        "its user can accept joining Vision as maintainer within 14 days."
    }
    assert not Membership.objects.filter(team=team, user__username="nina").exists()
    invitation = TeamInvitation.objects.get(team=team)
    assert (invitation.invitee, invitation.role) == ("nina@example.com", "maintainer")
    assert AuditEvent.objects.filter(action="member.invited", details__invitee="nina@example.com").exists()


@pytest.mark.parametrize("client_fixture", ["maintainer_client", "viewer_client"])
def test_only_owner_manages_members(request, client_fixture, owner, maintainer, viewer):
    client = request.getfixturevalue(client_fixture)
    UserFactory(username="nina")
    membership = Membership.objects.get(user=viewer)
    assert (
        client.post(
            "/api/v1/teams/vision/members/", {"user": "nina", "role": "viewer"}, format="json"
        ).status_code
        == 403
    )
    response = client.patch(
        f"/api/v1/teams/vision/members/{membership.pk}/", {"role": "owner"}, format="json"
    )
    assert response.status_code == 403
    assert "owner" in response.json()["message"]
    assert client.delete(f"/api/v1/teams/vision/members/{membership.pk}/").status_code == 403
    assert Membership.objects.get(pk=membership.pk).role == Role.VIEWER


def test_invalid_role_is_400_with_field_message(owner_client, team):
    UserFactory(username="nina")
    response = owner_client.post(
        "/api/v1/teams/vision/members/", {"user": "nina", "role": "admin"}, format="json"
    )
    assert response.status_code == 400
    assert "viewer, maintainer, owner" in response.json()["fields"]["role"][0]
    assert not Membership.objects.filter(user__username="nina").exists()


def test_an_owner_gets_one_answer_whether_the_account_exists_or_not(owner_client, team):
    UserFactory(username="nina", email="nina@example.com")
    answers = {}
    for identifier in ("nina", "ghost", "nina@example.com", "ghost@example.com"):
        response = owner_client.post(
            "/api/v1/teams/vision/members/", {"user": identifier, "role": "viewer"}, format="json"
        )
        body = response.json()
        answers[identifier] = (
            response.status_code,
            body["message"].replace(identifier, "<who>"),
            tuple(body),
        )
    assert len(set(answers.values())) == 1, answers
    assert answers["ghost"] == (
        202,
        "Invitation recorded: if an account with the username or email '<who>' exists, its user can accept "
        "joining Vision as viewer within 14 days.",
        ("message",),
    )
    assert not Membership.objects.filter(team=team, user__username__in=["nina", "ghost"]).exists()


def test_platform_staff_learn_that_an_account_is_unknown(client, team):
    ops = UserFactory(username="ops", is_staff=True)
    Membership.objects.create(team=team, user=ops, role=Role.OWNER)
    client.force_login(ops)
    response = client.post(
        "/api/v1/teams/vision/members/", {"user": "ghost", "role": "viewer"}, content_type="application/json"
    )
    assert response.status_code == 400 and "ghost" in response.json()["fields"]["user"][0]
    UserFactory(username="nina")
    added = client.post(
        "/api/v1/teams/vision/members/", {"user": "nina", "role": "viewer"}, content_type="application/json"
    )
    assert added.status_code == 201 and added.json()["username"] == "nina"


def test_staff_adding_a_duplicate_member_is_400(client, team, viewer):
    ops = UserFactory(username="ops", is_staff=True)
    Membership.objects.create(team=team, user=ops, role=Role.OWNER)
    client.force_login(ops)
    response = client.post(
        "/api/v1/teams/vision/members/", {"user": "vera", "role": "viewer"}, content_type="application/json"
    )
    assert response.status_code == 400 and "already a member" in response.json()["fields"]["user"][0]


def test_an_owner_inviting_a_member_gets_the_usual_answer_and_changes_nothing(owner_client, team, viewer):
    response = owner_client.post(
        "/api/v1/teams/vision/members/", {"user": "vera", "role": "owner"}, format="json"
    )
    assert response.status_code == 202
    assert Membership.objects.get(team=team, user=viewer).role == Role.VIEWER


def test_removing_or_demoting_the_last_owner_is_400(owner_client, owner, team):
    membership = Membership.objects.get(user=owner, team=team)
    response = owner_client.delete(f"/api/v1/teams/vision/members/{membership.pk}/")
    assert response.status_code == 400
    assert "at least one owner" in response.json()["message"]
    response = owner_client.patch(
        f"/api/v1/teams/vision/members/{membership.pk}/", {"role": "viewer"}, format="json"
    )
    assert response.status_code == 400
    assert Membership.objects.get(pk=membership.pk).role == Role.OWNER


def test_an_owner_can_leave_when_another_owner_remains(owner_client, owner, team, maintainer):
    other = Membership.objects.get(user=maintainer)
    assert (
        owner_client.patch(
            f"/api/v1/teams/vision/members/{other.pk}/", {"role": "owner"}, format="json"
        ).status_code
        == 200
    )
    mine = Membership.objects.get(user=owner, team=team)
    assert owner_client.delete(f"/api/v1/teams/vision/members/{mine.pk}/").status_code == 204
    assert not Membership.objects.filter(pk=mine.pk).exists()
    assert AuditEvent.objects.filter(action="member.removed", details__user="olivia").exists()


def test_member_from_another_team_is_404_through_this_team(owner_client, outsider, other_team):
    foreign = Membership.objects.get(user=outsider, team=other_team)
    assert owner_client.get(f"/api/v1/teams/vision/members/{foreign.pk}/").status_code == 404
    assert owner_client.delete(f"/api/v1/teams/vision/members/{foreign.pk}/").status_code == 404
    assert Membership.objects.filter(pk=foreign.pk).exists()


def test_member_list_filters_by_role(owner_client, maintainer, viewer):
    response = owner_client.get("/api/v1/teams/vision/members/?role=maintainer")
    assert [m["username"] for m in response.json()["results"]] == ["max"]


def test_same_user_in_two_teams_sees_both(owner, other_team, client):
    MembershipFactory(team=other_team, user=owner, role=Role.VIEWER)
    from tests.conftest import client_for

    response = client_for(owner).get("/api/v1/teams/?ordering=slug")
    assert [(t["slug"], t["role"]) for t in response.json()["results"]] == [
        ("speech", "viewer"),
        ("vision", "owner"),
    ]
