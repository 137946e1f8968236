"""Notifications: Alertmanager's webhook JSON delivered to a real local receiver (retried after a 500, logged),
email into Django's test outbox, and the SSRF guard on webhook URLs at save and at delivery."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core import mail
from django.core.exceptions import ValidationError

from apps.alerts import services, webhooks
from apps.alerts.delivery import send as send_delivery
from apps.alerts.models import AlertKind, DeliveryState, NotificationDelivery
from apps.alerts.tasks import deliver_notification
from apps.deployments.models import PlacementState

pytestmark = pytest.mark.django_db


@pytest.fixture
def failing_placement(serving, make_rule):
    """A rule that fires at the next evaluation: its deployment's placement failed."""
    serving["placement"].state = PlacementState.FAILED
    serving["placement"].last_error = "model load timed out"
    serving["placement"].save()
    return make_rule(AlertKind.PLACEMENT_FAILED, name="Placement failed")


def test_webhook_gets_alertmanager_json_and_is_retried_after_a_500(
    team, owner, receiver, failing_placement, serving, clock, django_capture_on_commit_callbacks
):
    channel = services.create_channel(actor=owner, team=team, name="pager", kind="webhook", url=receiver.url)
    receiver.statuses = [500]

    with django_capture_on_commit_callbacks() as callbacks:
        services.evaluate_rules(now=clock)
    delivery = NotificationDelivery.objects.get()
    assert len(callbacks) == 1 and delivery.state == DeliveryState.PENDING
    deliver_notification.apply(args=[delivery.pk])  # eager, retries included

    delivery.refresh_from_db()
    assert delivery.state == DeliveryState.SENT and delivery.attempts == 2 and delivery.response_status == 200
    assert len(receiver.bodies) == 2 and receiver.bodies[0] == receiver.bodies[1]
    body = receiver.bodies[-1]
    assert body["version"] == "4" and body["status"] == "firing" and body["receiver"] == "pager"
    assert body["groupKey"] == '{}:{alertname="Placement failed", team="vision"}'
    assert body["groupLabels"] == {"alertname": "Placement failed", "team": "vision"}
    (alert,) = body["alerts"]
    assert alert["status"] == "firing" and alert["endsAt"] == "0001-01-01T00:00:00Z"
    assert alert["labels"]["alertname"] == "Placement failed" and alert["labels"]["host"] == "local"
    assert alert["labels"]["deployment"] == str(serving["deployment"].pk)
    assert "model load timed out" in alert["annotations"]["summary"]
    assert alert["startsAt"].startswith(clock.strftime("%Y-%m-%dT%H:%M")) and alert["startsAt"].endswith("Z")
    assert alert["generatorURL"].endswith("/teams/vision/alerts/")
    assert receiver.headers[-1]["Content-Type"] == "application/json"
    assert channel.deliveries.get() == delivery

    # Resolved: another delivery with status "resolved" and an end time.
    serving["placement"].state = PlacementState.READY
    serving["placement"].save()
    services.evaluate_rules(now=clock + timedelta(minutes=1))
    resolved = NotificationDelivery.objects.exclude(pk=delivery.pk).get()
    deliver_notification.apply(args=[resolved.pk])
    assert receiver.bodies[-1]["status"] == "resolved"
    assert receiver.bodies[-1]["alerts"][0]["endsAt"].startswith(
        (clock + timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M")
    )


def test_a_delivery_that_keeps_failing_ends_failed_with_the_last_error(
    team, owner, receiver, failing_placement, clock, settings
):
    services.create_channel(actor=owner, team=team, name="pager", kind="webhook", url=receiver.url)
    receiver.statuses = [503] * 50
    services.evaluate_rules(now=clock)
    delivery = NotificationDelivery.objects.get()
    deliver_notification.apply(args=[delivery.pk])
    delivery.refresh_from_db()
    assert delivery.state == DeliveryState.FAILED
    assert (
        delivery.attempts == deliver_notification.max_retries + 1 == settings.ALERT_DELIVERY_MAX_RETRIES + 1
    )
    assert "gave up after retries" in delivery.last_error and "HTTP 503" in delivery.last_error


def test_a_4xx_answer_is_final_and_logged(team, owner, receiver, failing_placement, clock):
    services.create_channel(actor=owner, team=team, name="pager", kind="webhook", url=receiver.url)
    receiver.statuses = [404]
    services.evaluate_rules(now=clock)
    delivery = NotificationDelivery.objects.get()
    deliver_notification.apply(args=[delivery.pk])
    delivery.refresh_from_db()
    assert (delivery.state, delivery.attempts, delivery.response_status) == (DeliveryState.FAILED, 1, 404)
    assert "receiver says 404" in delivery.last_error


def test_email_channel_lands_in_the_outbox(team, owner, failing_placement, clock):
    services.create_channel(
        actor=owner, team=team, name="oncall", kind="email", emails="oncall@example.com, lead@example.com"
    )
    services.evaluate_rules(now=clock)
    delivery = NotificationDelivery.objects.get()
    deliver_notification.apply(args=[delivery.pk])
    delivery.refresh_from_db()
    assert delivery.state == DeliveryState.SENT
    (message,) = mail.outbox
    assert message.subject == "[FIRING:1] Placement failed (vision)"
    assert message.to == ["oncall@example.com", "lead@example.com"]
    assert "model load timed out" in message.body and "/teams/vision/alerts/" in message.body


@pytest.mark.parametrize(
    "url, message",
    [
        ("ftp://example.com/hook", "Only http:// and https://"),
        ("file:///etc/passwd", "Only http:// and https://"),
        ("http://user:secret@example.com/hook", "Credentials in the URL"),
        ("http://127.0.0.1:9093/hook", "loopback, private"),
        ("http://10.1.2.3/hook", "loopback, private"),
        ("http://169.254.169.254/latest/meta-data/", "loopback, private"),
        ("http://[::1]/hook", "loopback, private"),
        ("http://[::ffff:192.168.0.1]/hook", "loopback, private"),
        ("http://100.64.0.1/hook", "loopback, private"),
        ("http://0.0.0.0/hook", "loopback, private"),
        ("http://localhost/hook", "loopback, private"),
        ("http://example.com:99999/hook", "port"),
        ("http://exa mple.com/hook", "spaces or control"),
    ],
)
def test_webhook_urls_to_private_places_or_with_credentials_are_refused(team, owner, settings, url, message):
    settings.ALERT_WEBHOOK_ALLOW_PRIVATE = False
    with pytest.raises(ValidationError) as error:
        services.create_channel(actor=owner, team=team, name="bad", kind="webhook", url=url)
    assert message in " ".join(error.value.messages)


def test_the_guard_runs_again_at_delivery(team, owner, receiver, failing_placement, clock, settings):
    """A URL accepted while private destinations were allowed is refused once they are not, without a
    connection being made."""
    services.create_channel(actor=owner, team=team, name="pager", kind="webhook", url=receiver.url)
    services.evaluate_rules(now=clock)
    settings.ALERT_WEBHOOK_ALLOW_PRIVATE = False
    delivery = NotificationDelivery.objects.get()
    deliver_notification.apply(args=[delivery.pk])
    delivery.refresh_from_db()
    assert delivery.state == DeliveryState.FAILED and delivery.attempts == 1
    assert "loopback, private" in delivery.last_error and receiver.bodies == []


def test_every_resolved_address_is_checked(monkeypatch, settings):
    settings.ALERT_WEBHOOK_ALLOW_PRIVATE = False
    answers = [(2, 1, 6, "", ("93.184.215.14", 443)), (2, 1, 6, "", ("10.0.0.5", 443))]
    monkeypatch.setattr(webhooks.socket, "getaddrinfo", lambda *args, **kwargs: answers)
    with pytest.raises(webhooks.WebhookRefused, match="10.0.0.5"):
        webhooks.check_webhook_url("https://rebinding.example/hook")
    answers.pop()
    assert webhooks.check_webhook_url("https://public.example/hook").addresses == ("93.184.215.14",)


def test_a_delivery_already_attempted_by_another_copy_is_not_sent_again(
    team, owner, receiver, failing_placement, clock
):
    services.create_channel(actor=owner, team=team, name="pager", kind="webhook", url=receiver.url)
    services.evaluate_rules(now=clock)
    stale = NotificationDelivery.objects.get()  # what a redelivered task copy read before the first attempt
    deliver_notification.apply(args=[stale.pk])
    send_delivery(stale)  # the attempt that copy would make
    assert len(receiver.bodies) == 1
    stale.refresh_from_db()
    assert (stale.state, stale.attempts) == (DeliveryState.SENT, 1)
