from datetime import timedelta

import pytest
from django.utils import timezone

from apps.audit.models import AuditEvent
from apps.audit.services import prune_audit_events, record
from apps.teams import services

pytestmark = pytest.mark.django_db


@pytest.fixture
def history(owner, team, viewer):
    token, _ = services.create_token(actor=owner, team=team, name="ci")
    services.revoke_token(actor=owner, token=token)
    services.rename_team(actor=owner, team=team, name="Vision 2")
    return token


def test_every_state_change_records_an_event(history, owner_client):
    actions = [e["action"] for e in owner_client.get("/api/v1/teams/vision/audit-events/").json()["results"]]
    assert actions == ["team.renamed", "token.revoked", "token.created"]


def test_audit_list_filters_by_action_prefix_actor_and_time(history, owner_client, team):
    results = owner_client.get("/api/v1/teams/vision/audit-events/?action_prefix=token.").json()["results"]
    assert [e["action"] for e in results] == ["token.revoked", "token.created"]
    assert results[0]["target_type"] == "teams.apitoken" and results[0]["target_id"] == str(history.pk)
    assert owner_client.get("/api/v1/teams/vision/audit-events/?actor=vera").json()["count"] == 0
    assert owner_client.get("/api/v1/teams/vision/audit-events/?actor=olivia").json()["count"] == 3
    AuditEvent.objects.filter(action="token.created").update(created_at=timezone.now() - timedelta(days=3))
    since = (timezone.now() - timedelta(days=1)).isoformat().replace("+00:00", "Z")
    results = owner_client.get("/api/v1/teams/vision/audit-events/", {"since": since}).json()["results"]
    assert [e["action"] for e in results] == ["team.renamed", "token.revoked"]


def test_audit_list_rejects_a_bad_date_with_field_message(history, owner_client):
    response = owner_client.get("/api/v1/teams/vision/audit-events/?since=yesterday")
    assert response.status_code == 400
    assert "since" in response.json()["fields"]


def test_viewer_reads_audit_outsider_does_not(history, viewer_client, outsider_client):
    assert viewer_client.get("/api/v1/teams/vision/audit-events/").json()["count"] == 3
    assert outsider_client.get("/api/v1/teams/vision/audit-events/").status_code == 404


def test_outsider_sees_only_own_team_events(history, outsider_client, outsider, other_team):
    record(actor=outsider, team=other_team, action="custom.thing")
    results = outsider_client.get("/api/v1/teams/speech/audit-events/").json()["results"]
    assert [e["action"] for e in results] == ["custom.thing"]


def test_event_keeps_actor_label_after_user_is_deleted(history, owner):
    owner.delete()
    event = AuditEvent.objects.get(action="team.renamed")
    assert event.actor is None and event.actor_label == "olivia"


def test_prune_deletes_only_events_older_than_retention(history):
    AuditEvent.objects.filter(action="token.created").update(created_at=timezone.now() - timedelta(days=400))
    assert prune_audit_events(365) == 1
    assert set(AuditEvent.objects.values_list("action", flat=True)) == {"token.revoked", "team.renamed"}


def test_failed_service_call_writes_no_event(owner, team):
    before = AuditEvent.objects.count()
    with pytest.raises(Exception, match="at least one owner"):
        from apps.teams.models import Membership

        services.remove_member(actor=owner, membership=Membership.objects.get(user=owner))
    assert AuditEvent.objects.count() == before
