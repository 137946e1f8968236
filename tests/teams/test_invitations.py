"""Owners invite members; the invited user accepts. Nothing an owner sees tells whether an account exists."""

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.audit.models import AuditEvent
from apps.teams import services
from apps.teams.models import Membership, Role, TeamInvitation
from tests.conftest import bearer_client, client_for
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

MEMBERS = "/api/v1/teams/vision/members/"
INVITATIONS = "/api/v1/teams/vision/invitations/"
MINE = "/api/v1/me/invitations/"


def _owner_view(owner_client) -> tuple:
    members = owner_client.get(MEMBERS).json()["results"]
    invitations = owner_client.get(INVITATIONS).json()["results"]
    return (
        sorted(m["username"] for m in members),
        [{k: v for k, v in i.items() if k not in ("id", "created_at", "expires_at")} for i in invitations],
    )


@pytest.mark.parametrize("identifier", ["nina", "nina@example.com"])
def test_an_owner_sees_the_same_for_an_existing_and_a_missing_account(owner_client, team, identifier):
    existing, missing = identifier, identifier.replace("nina", "ghost")
    UserFactory(username="nina", email="nina@example.com")
    seen = {}
    for who in (existing, missing):
        response = owner_client.post(MEMBERS, {"user": who, "role": "maintainer"}, format="json")
        answer = (response.status_code, response.json()["message"].replace(who, "<who>"))
        members, invitations = _owner_view(owner_client)
        invitations = [{**i, "invitee": i["invitee"].replace(who, "<who>")} for i in invitations]
        seen[who] = (answer, members, invitations)
        TeamInvitation.objects.all().delete()  # each starts from the same state
    assert seen[existing] == seen[missing], seen
    assert seen[existing][0][0] == 202
    assert seen[existing][1] == ["olivia"]
    assert seen[existing][2] == [{"invitee": "<who>", "role": "maintainer", "invited_by": "olivia"}]
    details = list(AuditEvent.objects.filter(action="member.invited").values_list("details", flat=True))
    assert details == [
        {"invitee": missing, "role": "maintainer"},
        {"invitee": existing, "role": "maintainer"},
    ]


def test_inviting_twice_keeps_one_pending_invitation(owner_client, team):
    for _ in range(2):
        response = owner_client.post(MEMBERS, {"user": "Ghost@Example.com ", "role": "viewer"}, format="json")
        assert response.status_code == 202
    assert list(TeamInvitation.objects.values_list("invitee", flat=True)) == ["ghost@example.com"]
    assert AuditEvent.objects.filter(action="member.invited").count() == 1


def test_the_invited_user_accepts_and_becomes_a_member_with_the_role(owner_client, team):
    nina = UserFactory(username="nina", email="nina@example.com")
    owner_client.post(MEMBERS, {"user": "NINA@example.com", "role": "maintainer"}, format="json")
    nina_client = client_for(nina)
    mine = nina_client.get(MINE).json()["results"]
    assert [(i["team"]["slug"], i["role"], i["invited_by"]) for i in mine] == [
        ("vision", "maintainer", "olivia")
    ]
    response = nina_client.post(f"{MINE}{mine[0]['id']}/accept/")
    assert response.status_code == 200, response.json()
    assert response.json()["username"] == "nina" and response.json()["role"] == "maintainer"
    assert Membership.objects.get(team=team, user=nina).role == Role.MAINTAINER
    joined = AuditEvent.objects.get(action="member.joined")
    assert joined.actor == nina and joined.team == team and joined.details["role"] == "maintainer"
    assert nina_client.get(MINE).json()["results"] == []
    assert owner_client.get(INVITATIONS).json()["results"] == []
    again = nina_client.post(f"{MINE}{mine[0]['id']}/accept/")
    assert again.status_code == 400 and "accepted" in again.json()["message"]


def test_the_invited_user_declines(owner, team):
    nina = UserFactory(username="nina")
    invitation = services.invite_member(actor=owner, team=team, user_identifier="nina", role="viewer")
    response = client_for(nina).post(f"{MINE}{invitation.pk}/decline/")
    assert response.status_code == 200
    assert not Membership.objects.filter(user=nina).exists()
    assert AuditEvent.objects.filter(action="invitation.declined", details__user="nina").exists()


def test_an_expired_invitation_cannot_be_accepted(owner, team):
    nina = UserFactory(username="nina")
    invitation = services.invite_member(actor=owner, team=team, user_identifier="nina", role="viewer")
    assert invitation.expires_at > timezone.now() + timedelta(days=13)
    TeamInvitation.objects.filter(pk=invitation.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    client = client_for(nina)
    assert client.get(MINE).json()["results"] == []
    response = client.post(f"{MINE}{invitation.pk}/accept/")
    assert response.status_code == 400 and "expired" in response.json()["message"]
    assert not Membership.objects.filter(user=nina).exists()


def test_the_owner_revokes_an_invitation_and_it_cannot_be_accepted(owner_client, owner, team):
    nina = UserFactory(username="nina")
    invitation = services.invite_member(actor=owner, team=team, user_identifier="nina", role="owner")
    assert owner_client.delete(f"{INVITATIONS}{invitation.pk}/").status_code == 204
    assert owner_client.get(INVITATIONS).json()["results"] == []
    event = AuditEvent.objects.get(action="invitation.revoked")
    assert event.actor == owner and event.details == {"invitee": "nina", "role": "owner"}
    response = client_for(nina).post(f"{MINE}{invitation.pk}/accept/")
    assert response.status_code == 400 and "revoked" in response.json()["message"]
    assert not Membership.objects.filter(user=nina).exists()


def test_another_user_cannot_see_or_answer_someone_elses_invitation(owner, team, outsider):
    UserFactory(username="nina")
    invitation = services.invite_member(actor=owner, team=team, user_identifier="nina", role="owner")
    client = client_for(outsider)
    assert client.get(MINE).json()["results"] == []
    assert client.get(f"{MINE}{invitation.pk}/").status_code == 404
    assert client.post(f"{MINE}{invitation.pk}/accept/").status_code == 404
    assert client.post(f"{MINE}{invitation.pk}/decline/").status_code == 404
    assert not Membership.objects.filter(team=team, user=outsider).exists()
    invitation.refresh_from_db()
    assert invitation.status == "pending"


def test_an_api_token_cannot_answer_invitations(make_token, owner, other_team, outsider):
    invitation = services.invite_member(
        actor=outsider, team=other_team, user_identifier="olivia", role="owner"
    )
    _, plaintext = make_token()
    client = bearer_client(plaintext)
    assert client.get(MINE).status_code == 403
    assert client.post(f"{MINE}{invitation.pk}/accept/").status_code == 403
    assert not Membership.objects.filter(team=other_team, user=owner).exists()


@pytest.mark.parametrize("client_fixture,expected", [("maintainer_client", 403), ("viewer_client", 403)])
def test_only_owners_see_and_revoke_invitations(request, client_fixture, expected, owner, team):
    invitation = services.invite_member(actor=owner, team=team, user_identifier="ghost", role="viewer")
    client = request.getfixturevalue(client_fixture)
    assert client.get(INVITATIONS).status_code == expected
    assert client.delete(f"{INVITATIONS}{invitation.pk}/").status_code == expected
    invitation.refresh_from_db()
    assert invitation.revoked_at is None


def test_outsiders_get_404_for_a_teams_invitations(outsider_client, owner, team):
    invitation = services.invite_member(actor=owner, team=team, user_identifier="ghost", role="viewer")
    assert outsider_client.get(INVITATIONS).status_code == 404
    assert outsider_client.delete(f"{INVITATIONS}{invitation.pk}/").status_code == 404
    # Nor through their own team's URL.
    assert outsider_client.delete(f"/api/v1/teams/speech/invitations/{invitation.pk}/").status_code == 404
    invitation.refresh_from_db()
    assert invitation.revoked_at is None


def test_platform_staff_still_add_members_directly(client, team):
    ops = UserFactory(username="ops", is_staff=True)
    Membership.objects.create(team=team, user=ops, role=Role.OWNER)
    UserFactory(username="nina")
    client.force_login(ops)
    response = client.post(MEMBERS, {"user": "nina", "role": "maintainer"}, content_type="application/json")
    assert response.status_code == 201 and response.json()["role"] == "maintainer"
    assert Membership.objects.get(team=team, user__username="nina").role == Role.MAINTAINER
    assert AuditEvent.objects.filter(action="member.added", details__user="nina").exists()
    assert not TeamInvitation.objects.exists()


def test_the_dashboard_lists_invitations_and_declining_removes_them(owner, team):
    from django.test import Client

    nina = UserFactory(username="nina", email="nina@example.com")
    invitation = services.invite_member(
        actor=owner, team=team, user_identifier="nina@example.com", role="viewer"
    )
    web = Client()
    web.force_login(nina)
    html = web.get("/").content.decode()
    assert f'data-invitation="{invitation.pk}"' in html and "Vision" in html
    response = web.post(f"/invitations/{invitation.pk}/decline/", follow=True)
    assert "Invitation to Vision declined." in response.content.decode()
    assert f'data-invitation="{invitation.pk}"' not in response.content.decode()
    other = Client()
    other.force_login(UserFactory(username="mallory"))
    assert other.post(f"/invitations/{invitation.pk}/accept/").status_code == 404
