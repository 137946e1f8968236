import pytest
from django.urls import reverse

from apps.audit.models import AuditEvent
from apps.teams import services
from apps.teams.models import ApiToken, Membership, TeamInvitation

pytestmark = pytest.mark.django_db


@pytest.fixture
def owner_web(client, owner):
    client.force_login(owner)
    return client


@pytest.fixture
def viewer_web(client, viewer, owner):
    client.force_login(viewer)
    return client


def test_login_required_redirects_to_login(client):
    response = client.get("/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")


def test_login_page_and_login(client, owner):
    assert client.get("/login/").status_code == 200
    response = client.post("/login/", {"username": "olivia", "password": "correct horse battery staple"})
    assert response.status_code == 302
    assert client.get("/").context["team"].slug == "vision"


def test_dashboard_shows_real_counts(owner_web, owner, team, maintainer, viewer):
    services.create_token(actor=owner, team=team, name="ci")
    response = owner_web.get("/")
    assert response.status_code == 200
    html = response.content.decode()
    assert 'data-stat="members">3<' in html
    assert 'data-stat="tokens">1<' in html
    assert "token.created" in html


def test_dashboard_empty_state_without_team(client, db):
    from tests.factories import UserFactory

    client.force_login(UserFactory(username="lonely"))
    html = client.get("/").content.decode()
    assert "not a member of any team" in html and "Create a team" in html


def test_switch_team_keeps_the_page_and_refuses_foreign_teams(owner_web, owner, other_team, team):
    Membership.objects.create(team=other_team, user=owner, role="viewer")
    response = owner_web.post(
        reverse("switch-team"), {"team": "speech", "next": "/teams/vision/audit/", "previous": "vision"}
    )
    assert response["Location"] == "/teams/speech/audit/"
    assert owner_web.get("/").context["team"].slug == "speech"
    assert owner_web.post(reverse("switch-team"), {"team": "nope"}).status_code == 404


def test_outsider_gets_404_on_team_pages(client, outsider, team, owner):
    client.force_login(outsider)
    assert client.get("/teams/vision/settings/").status_code == 404
    assert client.get("/teams/vision/audit/").status_code == 404
    assert client.post("/teams/vision/settings/", {"op": "create_token", "name": "x"}).status_code == 404


def test_create_team_page_shows_field_error_for_duplicate_slug(owner_web, team):
    response = owner_web.post("/teams/new/", {"name": "Again", "slug": "vision"})
    assert response.status_code == 200
    assert "already exists" in response.content.decode()
    response = owner_web.post("/teams/new/", {"name": "Audio", "slug": ""})
    assert response.status_code == 302 and response["Location"] == "/teams/audio/settings/"


def test_token_secret_is_shown_once(owner_web, team):
    response = owner_web.post("/teams/vision/settings/", {"op": "create_token", "name": "CI pipeline"})
    assert response.status_code == 302
    first = owner_web.get("/teams/vision/settings/").content.decode()
    token = ApiToken.objects.get(name="CI pipeline")
    assert 'id="new-token-secret"' in first
    secret_start = first.index('id="new-token-secret">') + len('id="new-token-secret">')
    secret = first[secret_start : first.index("</code>", secret_start)]
    assert secret.startswith(token.display_prefix + "_")
    second = owner_web.get("/teams/vision/settings/").content.decode()
    assert 'id="new-token-secret"' not in second and secret not in second


def test_token_form_errors_are_shown_next_to_the_field(owner_web, team):
    response = owner_web.post(
        "/teams/vision/settings/", {"op": "create_token", "name": "", "expires_in_days": "0"}
    )
    assert response.status_code == 400
    html = response.content.decode()
    assert 'data-field="name"' in html and 'data-field="expires_in_days"' in html
    assert not ApiToken.objects.exists()


def test_revoke_token_with_htmx_returns_the_row(owner_web, owner, team):
    token, _ = services.create_token(actor=owner, team=team, name="ci")
    response = owner_web.post(
        "/teams/vision/settings/", {"op": "revoke_token", "token": token.pk}, HTTP_HX_REQUEST="true"
    )
    assert response.status_code == 200
    assert f'id="token-{token.pk}"' in response.content.decode() and "revoked" in response.content.decode()
    token.refresh_from_db()
    assert token.revoked_at is not None


def test_viewer_sees_members_but_cannot_manage(viewer_web, team):
    html = viewer_web.get("/teams/vision/settings/").content.decode()
    assert "olivia" in html and 'id="tokens"' not in html
    assert viewer_web.post("/teams/vision/settings/", {"op": "create_token", "name": "x"}).status_code == 403
    assert (
        viewer_web.post(
            "/teams/vision/settings/", {"op": "add_member", "user": "vera", "role": "owner"}
        ).status_code
        == 403
    )
    assert not ApiToken.objects.exists()


def test_removing_last_owner_in_ui_shows_error_and_keeps_owner(owner_web, owner, team):
    membership = Membership.objects.get(user=owner)
    response = owner_web.post(
        "/teams/vision/settings/", {"op": "remove_member", "membership": membership.pk}, follow=True
    )
    assert "at least one owner" in response.content.decode()
    assert Membership.objects.filter(pk=membership.pk).exists()


def test_invited_member_accepts_on_the_dashboard_then_owner_changes_role(owner_web, team):
    from django.test import Client

    from tests.factories import UserFactory

    nina = UserFactory(username="nina")
    owner_web.post("/teams/vision/settings/", {"op": "add_member", "user": "nina", "role": "viewer"})
    assert not Membership.objects.filter(user=nina).exists()
    nina_web = Client()
    nina_web.force_login(nina)
    dashboard = nina_web.get("/").content.decode()
    invitation = TeamInvitation.objects.get(invitee="nina")
    assert f'data-invitation="{invitation.pk}"' in dashboard and "Accept" in dashboard
    response = nina_web.post(f"/invitations/{invitation.pk}/accept/", follow=True)
    assert "You joined Vision as viewer." in response.content.decode()
    membership = Membership.objects.get(user=nina, team=team)
    owner_web.post(
        "/teams/vision/settings/", {"op": "change_role", "membership": membership.pk, "role": "maintainer"}
    )
    membership.refresh_from_db()
    assert membership.role == "maintainer"


def test_adding_a_member_shows_one_message_whether_the_account_exists_or_not(owner_web, team):
    from tests.factories import UserFactory

    UserFactory(username="nina")
    shown = []
    for identifier in ("nina", "ghost"):
        response = owner_web.post(
            "/teams/vision/settings/", {"op": "add_member", "user": identifier, "role": "viewer"}, follow=True
        )
        html = response.content.decode()
        assert response.status_code == 200 and "No user with" not in html
        shown.append(html.count(f"if an account with the username or email &#x27;{identifier}&#x27; exists"))
        assert f'<tr data-invitation="{identifier}">' in html
    assert shown == [1, 1]
    assert not Membership.objects.filter(team=team, user__username="nina").exists()


def test_owner_revokes_an_invitation_on_the_settings_page(owner_web, owner, team):
    invitation = services.invite_member(actor=owner, team=team, user_identifier="ghost", role="viewer")
    response = owner_web.post(
        "/teams/vision/settings/", {"op": "revoke_invitation", "invitation": invitation.pk}, follow=True
    )
    assert "Invitation of ghost revoked." in response.content.decode()
    assert 'data-invitation="ghost"' not in response.content.decode()
    invitation.refresh_from_db()
    assert invitation.revoked_at is not None


def test_unknown_operation_is_400(owner_web, team):
    assert owner_web.post("/teams/vision/settings/", {"op": "explode"}).status_code == 400


def test_audit_page_lists_and_filters(owner_web, owner, team):
    services.create_token(actor=owner, team=team, name="ci")
    services.rename_team(actor=owner, team=team, name="Vision 2")
    html = owner_web.get("/teams/vision/audit/").content.decode()
    assert "token.created" in html and "team.renamed" in html
    partial = owner_web.get("/teams/vision/audit/?action=token.", HTTP_HX_REQUEST="true").content.decode()
    assert "token.created" in partial and "team.renamed" not in partial and "<html" not in partial
    assert AuditEvent.objects.filter(team=team).count() == 2


def test_static_assets_come_from_npm_packages(owner_web, team):
    html = owner_web.get("/").content.decode()
    assert "/static/vendor/htmx/htmx.min.js" in html and "/static/vendor/pico/pico.min.css" in html
