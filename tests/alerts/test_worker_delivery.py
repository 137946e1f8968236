"""A real Celery worker delivers a webhook notification: the first answer is a 500, the task retries with
backoff through the broker, the second attempt lands, and the delivery log says so."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from apps.alerts import services
from apps.alerts.models import AlertKind, DeliveryState, NotificationDelivery
from apps.alerts.tasks import deliver_notification
from apps.deployments.models import PlacementState
from tests.conftest import subprocess_database_url, wait_for

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.servers, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def worker_queue():
    # A queue of its own, so no other worker on the same broker takes the test's task.
    queue = f"test-alerts-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "DATABASE_URL": subprocess_database_url(),
        "DEBUG": "1",
        "ALERT_DELIVERY_RETRY_BACKOFF": "1",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "serving_platform", "worker", "--pool", "solo", "-Q", queue,
         "--hostname", f"{queue}@localhost", "--loglevel", "WARNING", "--without-heartbeat", "--without-gossip",
         "--without-mingle"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    yield queue
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()


def test_a_worker_retries_a_webhook_after_a_500_and_logs_the_delivery(
    team,
    owner,
    serving,
    make_rule,
    receiver,
    worker_queue,
    clock,
):
    services.create_channel(actor=owner, team=team, name="pager", kind="webhook", url=receiver.url)
    make_rule(AlertKind.PLACEMENT_FAILED, name="Placement failed")
    serving["placement"].state = PlacementState.FAILED
    serving["placement"].save()
    services.evaluate_rules(now=clock)
    delivery = NotificationDelivery.objects.get()
    receiver.statuses = [500]

    deliver_notification.apply_async(args=[delivery.pk], queue=worker_queue)

    def sent():
        delivery.refresh_from_db()
        return delivery.state == DeliveryState.SENT

    wait_for(sent, timeout=90, message="the delivery to be SENT")
    assert delivery.attempts == 2 and delivery.response_status == 200
    assert (
        len(receiver.bodies) == 2
        and receiver.bodies[-1]["alerts"][0]["labels"]["alertname"] == "Placement failed"
    )
