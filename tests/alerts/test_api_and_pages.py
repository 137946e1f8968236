"""The alerts API and page: members read, maintainers change (audited), other teams get 404; the badge."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.alerts.models import Alert, AlertKind, AlertRule, AlertState, NotificationChannel, Silence
from apps.audit.models import AuditEvent

pytestmark = pytest.mark.django_db

RULES = "/api/v1/teams/vision/alerts/rules/"


@pytest.fixture
def rule(team):
    return AlertRule.objects.create(team=team, name="Errors", kind=AlertKind.ERROR_RATE, threshold=5)


def test_maintainer_creates_edits_and_deletes_a_rule_with_audit_events(maintainer_client, serving):
    created = maintainer_client.post(
        RULES,
        {"name": "Classifier errors", "kind": "error_rate", "threshold": 2.5, "window_minutes": 10,
         "for_seconds": 60, "deployment": serving["deployment"].pk},
        format="json",
    )  # fmt: skip
    assert created.status_code == 201, created.json()
    body = created.json()
    assert body["condition"] == "Error rate above threshold 2.5 % over 10 min, for 60 s"
    assert body["deployment"] == serving["deployment"].pk
    changed = maintainer_client.patch(
        f"{RULES}{body['id']}/", {"threshold": 7, "enabled": False}, format="json"
    )
    assert changed.status_code == 200 and changed.json()["threshold"] == 7 and not changed.json()["enabled"]
    assert maintainer_client.delete(f"{RULES}{body['id']}/").status_code == 204
    actions = list(
        AuditEvent.objects.filter(action__startswith="alert_rule.").values_list("action", flat=True)
    )
    assert sorted(actions) == ["alert_rule.created", "alert_rule.deleted", "alert_rule.updated"]


@pytest.mark.parametrize(
    "payload, field",
    [
        ({"name": "x", "kind": "error_rate", "threshold": 250}, "threshold"),
        ({"name": "x", "kind": "p99_latency", "threshold": 1e12}, "threshold"),
        ({"name": "x", "kind": "no_traffic", "window_minutes": 0}, "window_minutes"),
        ({"name": "x", "kind": "host_offline", "for_seconds": 10**9}, "for_seconds"),
        ({"name": "x", "kind": "shell"}, "kind"),
    ],
)
def test_rule_fields_are_bounded(maintainer_client, payload, field):
    response = maintainer_client.post(RULES, payload, format="json")
    assert response.status_code == 400 and field in response.json()["fields"], response.json()


def test_a_rule_cannot_name_another_teams_deployment(maintainer_client, other_team, outsider):
    from apps.deployments.models import Deployment
    from apps.registry.models import RegisteredModel

    model = RegisteredModel.objects.create(team=other_team, name="Theirs", slug="theirs")
    theirs = Deployment.objects.create(team=other_team, model=model, state="SERVING")
    response = maintainer_client.post(
        RULES, {"name": "x", "kind": "error_rate", "threshold": 1, "deployment": theirs.pk}, format="json"
    )
    assert response.status_code == 404 and not AlertRule.objects.exists()


def test_viewer_reads_but_cannot_change(viewer_client, rule):
    assert viewer_client.get(RULES).json()["results"][0]["name"] == "Errors"
    assert viewer_client.get("/api/v1/teams/vision/alerts/events/").status_code == 200
    assert viewer_client.patch(f"{RULES}{rule.pk}/", {"threshold": 1}, format="json").status_code == 403
    response = viewer_client.post(
        "/api/v1/teams/vision/alerts/channels/",
        {"name": "x", "kind": "email", "emails": ["a@b.co"]},
        format="json",
    )
    assert response.status_code == 403 and not NotificationChannel.objects.exists()


@pytest.mark.parametrize("path", ["rules/", "channels/", "silences/", "events/", "deliveries/"])
def test_outsider_gets_404_for_every_alerts_endpoint(outsider_client, rule, path):
    assert outsider_client.get(f"/api/v1/teams/vision/alerts/{path}").status_code == 404
    assert outsider_client.get(f"{RULES}{rule.pk}/").status_code == 404


def test_channel_and_silence_through_the_api(maintainer_client, rule, settings):
    settings.ALERT_WEBHOOK_ALLOW_PRIVATE = False
    refused = maintainer_client.post(
        "/api/v1/teams/vision/alerts/channels/",
        {"name": "meta", "kind": "webhook", "url": "http://169.254.169.254/"},
        format="json",
    )
    assert refused.status_code == 400 and "url" in refused.json()["fields"]
    ends = (timezone.now() + timedelta(hours=2)).isoformat()
    silence = maintainer_client.post(
        "/api/v1/teams/vision/alerts/silences/",
        {"rule": rule.pk, "ends_at": ends, "comment": "maint"},
        format="json",
    )
    assert silence.status_code == 201 and silence.json()["active"] is True
    assert (
        maintainer_client.delete(f"/api/v1/teams/vision/alerts/silences/{silence.json()['id']}/").status_code
        == 204
    )
    assert not Silence.objects.get().is_active()
    assert AuditEvent.objects.filter(action="alert_silence.expired").exists()


def test_alerts_page_for_members_and_404_for_outsiders(client, viewer, maintainer, outsider, rule):
    Alert.objects.create(
        team=rule.team, rule=rule, subject="deployment:1", state=AlertState.FIRING, summary="Classifier: 12% failed",
        active_since=timezone.now(), fired_at=timezone.now(), last_evaluated_at=timezone.now(),
    )  # fmt: skip
    client.force_login(viewer)
    page = client.get("/teams/vision/alerts/")
    text = page.content.decode()
    assert page.status_code == 200 and "Classifier: 12% failed" in text and 'id="firing-alert-count"' in text
    assert 'id="create-rule"' not in text  # viewers read only
    denied = client.post("/teams/vision/alerts/", {"op": "delete_rule", "rule": rule.pk})
    assert denied.status_code == 403 and AlertRule.objects.filter(pk=rule.pk).exists()

    client.force_login(maintainer)
    response = client.post("/teams/vision/alerts/", {"op": "update_rule", "rule": rule.pk, "name": "Errors",
                                                     "threshold": "9", "window_minutes": "5", "for_seconds": "0",
                                                     "severity": "critical", "enabled": "on"})  # fmt: skip
    assert response.status_code == 302
    rule.refresh_from_db()
    assert rule.threshold == 9 and rule.severity == "critical"

    client.force_login(outsider)
    assert client.get("/teams/vision/alerts/").status_code == 404
    assert client.post("/teams/vision/alerts/", {"op": "delete_rule", "rule": rule.pk}).status_code == 404


def test_viewers_see_webhook_urls_without_their_secret_path(
    viewer_client, maintainer_client, team, maintainer
):
    from apps.alerts import services

    services.create_channel(
        actor=maintainer,
        team=team,
        name="hook",
        kind="webhook",
        url="http://127.0.0.1:9/hooks/s3cr3t?key=k3y",
    )
    seen_by_viewer = viewer_client.get("/api/v1/teams/vision/alerts/channels/").json()["results"][0]["url"]
    assert seen_by_viewer == "http://127.0.0.1:9/…"
    seen_by_maintainer = maintainer_client.get("/api/v1/teams/vision/alerts/channels/").json()["results"][0]
    assert seen_by_maintainer["url"] == "http://127.0.0.1:9/hooks/s3cr3t?key=k3y"
