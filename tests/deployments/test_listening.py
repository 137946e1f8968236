"""A host is lost after the grace *while the platform listened*: a platform that was deaf (restarted, its
database down: every host's heartbeats failed together) gives every host a fresh grace from when it hears them
again, and moves nothing while it hears none (``lost.listening_since``); a host silent while the others
were heard is lost as before. Heartbeats go through ``fleet.services.record_heartbeat`` as the agent API's do."""

from __future__ import annotations

from datetime import timedelta
from unittest import mock

import pytest
from django.utils import timezone

from apps.deployments import lost
from apps.fleet import services as fleet
from apps.fleet.models import Host
from tests.deployments.test_reserved_memory import deploy, pool, report, sized  # noqa: F401 - the fixture

GRACE = 60


def freeze_time(moment):
    """The platform's clock at ``moment`` (heartbeats and the scheduler read ``timezone.now``)."""
    return mock.patch("django.utils.timezone.now", return_value=moment)


@pytest.fixture(autouse=True)
def _grace(settings):
    settings.SCHEDULER_HOST_GRACE_S = GRACE


def beat_all(*names: str) -> None:
    for host in Host.objects.filter(name__in=names or ["h0", "h1", "h2"]):
        fleet.record_heartbeat(host, facts=host.facts, read_local=False)


def lost_hosts() -> set[str]:
    found = lost.lost_placements()
    from apps.deployments.models import DeploymentInstance

    pks = [pk for items in found.values() for pk, _ in items]
    return set(DeploymentInstance.objects.filter(pk__in=pks).values_list("instance__host__name", flat=True))


@pytest.fixture
def spread(owner, model, pool):  # noqa: F811 - pool is the fixture imported above
    deployment = deploy(owner, sized(model), replicas=3, pool=pool)
    report(deployment)
    start = timezone.now()
    with freeze_time(start):
        beat_all()
    return start


def test_a_host_silent_while_the_others_are_heard_is_lost_after_the_grace(spread):
    start = spread
    for second in range(0, GRACE + 10, 10):
        with freeze_time(start + timedelta(seconds=second)):
            beat_all("h0", "h1")
    with freeze_time(start + timedelta(seconds=GRACE + 5)):
        assert lost_hosts() == {"h2"}


def test_a_platform_deaf_past_the_grace_takes_no_host_for_lost_when_it_hears_again(spread):
    start = spread
    back = start + timedelta(seconds=GRACE + 30)  # the platform was down for 90 s
    with freeze_time(back):
        assert lost_hosts() == set()  # it hears nobody: nothing is moved
        beat_all("h0")  # the first host back
        assert lost_hosts() == set()  # the others get a grace from now
    # h0 and h1 heartbeat every 10 s from then on; h2 died during the outage: lost one grace after the
    # platform hears again, not before.
    for second in range(5, GRACE + 10, 10):
        with freeze_time(back + timedelta(seconds=second)):
            beat_all("h0", "h1")
            assert lost_hosts() == (set() if second < GRACE else {"h2"}), second
