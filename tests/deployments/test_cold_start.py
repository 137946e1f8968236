"""A cold start's breakdown: the marks of the gateway, the platform and the agent put together hop by hop, and
stored beside the cold-start figure when the gateway records the release."""

from __future__ import annotations

import pytest

from apps.deployments import autoscaling, cold_start
from apps.deployments.models import Deployment
from tests.deployments.test_autoscaling import scheduled  # noqa: F401 - the fixture

MARKS = {
    "held_at": 1_000_000,
    "signal_at": 1_000_005,
    "placed_at": 1_000_030,
    "arrived_at": 1_000_400,
    "reported_at": 1_000_420,
    "timings": {"queued_ms": 3, "files_ms": 7, "load_ms": 300, "smoke_ms": 20, "total_ms": 340},
}


def test_the_breakdown_puts_the_hops_end_to_end_on_each_sides_own_clock():
    hops = cold_start.breakdown(MARKS, held_ms=520, routed_at_ms=1_000_480)
    assert hops == {
        "signal_ms": 5,
        "placed_ms": 25,
        "received_ms": 30,  # the report arrived 340 ms after the agent had the decision
        "queued_ms": 3,
        "files_ms": 7,
        "load_ms": 300,
        "smoke_ms": 20,
        "reported_ms": 30,  # 10 ms of the agent's outside its steps, 20 ms recording the report
        "routed_ms": 60,
        "released_ms": 40,
        "held_ms": 520,
    }
    # End to end: the hops make the held time.
    assert sum(v for k, v in hops.items() if k != "held_ms") == hops["held_ms"]


def test_a_hop_whose_ends_are_unknown_is_left_out():
    # An agent that sends no timings, a gateway that did not see the routing: what is known is kept.
    hops = cold_start.breakdown({"held_at": 5_000_000, "signal_at": 5_000_200}, held_ms=900)
    assert hops == {"signal_ms": 200, "held_ms": 900}
    assert cold_start.held_at_ms(1_700_000_000) == 1_700_000_000_000  # an older Lua action's epoch seconds


@pytest.mark.django_db
def test_a_wake_up_is_timed_from_the_held_request_to_its_release_and_stored_on_the_deployment(
    owner,
    scheduled,  # noqa: F811 - the fixture
):
    deployment = scheduled
    autoscaling.configure(actor=owner, deployment=deployment, values={"min_replicas": 0, "max_replicas": 1})
    autoscaling.sleep(actor=owner, deployment=Deployment.objects.get(pk=deployment.pk))
    assert autoscaling.wake(deployment.pk, now=1_000.0, held_at_ms=999_990)
    marks = Deployment.objects.get(pk=deployment.pk).scaling_memory["cold"]
    assert marks["held_at"] == 999_990 and marks["signal_at"] == 1_000_000
    autoscaling.note_loaded(
        deployment.pk, {"load_ms": 200, "total_ms": 260}, arrived_at=1_000.5, now=1_000.52
    )
    autoscaling.record_cold_start(deployment.pk, 700, routed_at_ms=1_000_600)
    deployment.refresh_from_db()
    assert deployment.last_cold_start_ms == 700
    assert deployment.last_cold_start["load_ms"] == 200
    assert deployment.last_cold_start["routed_ms"] == 80
    assert deployment.last_cold_start["released_ms"] == 90  # released at 999_990 + 700
    assert "cold" not in deployment.scaling_memory  # the next wake-up starts afresh
    event = deployment.events.get(kind="cold_start")
    assert event.details["hops"] == deployment.last_cold_start
