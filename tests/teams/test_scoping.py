"""The tenancy matrix: every list and detail endpoint, for every persona."""

import pytest

from apps.audit.models import AuditEvent
from apps.teams import services
from apps.teams.models import Membership

pytestmark = pytest.mark.django_db


@pytest.fixture
def objects(owner, maintainer, viewer, make_token):
    token, _ = make_token()
    return {
        "member": Membership.objects.get(user=viewer).pk,
        "token": token.pk,
        "event": AuditEvent.objects.filter(team__slug="vision").first().pk,
        "invitation": services.invite_member(
            actor=owner, team=token.team, user_identifier="ghost", role="viewer"
        ).pk,
    }


LIST_ENDPOINTS = [
    "/api/v1/teams/vision/",
    "/api/v1/teams/vision/members/",
    "/api/v1/teams/vision/tokens/",
    "/api/v1/teams/vision/audit-events/",
    "/api/v1/teams/vision/invitations/",
]
DETAIL_ENDPOINTS = [
    "/api/v1/teams/vision/members/{member}/",
    "/api/v1/teams/vision/tokens/{token}/",
    "/api/v1/teams/vision/audit-events/{event}/",
    "/api/v1/teams/vision/invitations/{invitation}/",
]


@pytest.mark.parametrize("url", LIST_ENDPOINTS + DETAIL_ENDPOINTS)
def test_outsider_gets_404_on_every_team_endpoint(outsider_client, objects, url):
    response = outsider_client.get(url.format(**objects))
    assert response.status_code == 404, url


def test_outsider_team_list_is_empty_of_foreign_teams(outsider_client, objects):
    slugs = [t["slug"] for t in outsider_client.get("/api/v1/teams/").json()["results"]]
    assert "vision" not in slugs


@pytest.mark.parametrize(
    "url,viewer_status",
    [
        ("/api/v1/teams/vision/members/", 200),
        ("/api/v1/teams/vision/members/{member}/", 200),
        ("/api/v1/teams/vision/audit-events/", 200),
        ("/api/v1/teams/vision/audit-events/{event}/", 200),
        ("/api/v1/teams/vision/tokens/", 403),
        ("/api/v1/teams/vision/tokens/{token}/", 403),
        ("/api/v1/teams/vision/invitations/", 403),
        ("/api/v1/teams/vision/invitations/{invitation}/", 403),
    ],
)
def test_viewer_reads_team_data_but_not_tokens(viewer_client, objects, url, viewer_status):
    assert viewer_client.get(url.format(**objects)).status_code == viewer_status


@pytest.mark.parametrize(
    "method,url,body",
    [
        ("post", "/api/v1/teams/vision/members/", {"user": "oscar", "role": "viewer"}),
        ("patch", "/api/v1/teams/vision/members/{member}/", {"role": "owner"}),
        ("delete", "/api/v1/teams/vision/members/{member}/", None),
        ("post", "/api/v1/teams/vision/tokens/", {"name": "x"}),
        ("delete", "/api/v1/teams/vision/tokens/{token}/", None),
        ("delete", "/api/v1/teams/vision/invitations/{invitation}/", None),
        ("patch", "/api/v1/teams/vision/", {"name": "x"}),
    ],
)
def test_viewer_cannot_write(viewer_client, outsider_client, objects, method, url, body):
    before = AuditEvent.objects.count()
    response = getattr(viewer_client, method)(url.format(**objects), body, format="json")
    assert response.status_code == 403
    response = getattr(outsider_client, method)(url.format(**objects), body, format="json")
    assert response.status_code == 404
    assert AuditEvent.objects.count() == before


def test_audit_events_are_not_writable(owner_client, objects):
    assert owner_client.post("/api/v1/teams/vision/audit-events/", {}, format="json").status_code == 405
    assert owner_client.delete(f"/api/v1/teams/vision/audit-events/{objects['event']}/").status_code == 405
