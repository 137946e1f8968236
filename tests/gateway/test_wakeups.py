"""The wake-ups the gateway's Lua action signals (``apps.gateway.autoscaling.poll_wakeups``), on the rows: the
wake-ups read together are placed and reach each host as one change of its desired state."""

from __future__ import annotations

import time

import pytest
from django.utils import timezone

from apps.deployments import autoscaling, reports, services
from apps.deployments.models import Deployment, PlacementState
from apps.fleet.models import Host, Pool
from apps.gateway.autoscaling import poll_wakeups
from apps.gateway.state import options
from apps.registry.models import RegisteredModel
from tests.support.models import add_instance, make_version

pytestmark = pytest.mark.django_db

POLICY = {"min_replicas": 0, "max_replicas": 1, "scale_down_window_s": 0, "idle_period_s": 60}


class FakeAdmin:
    """HAProxy's runtime API as ``poll_wakeups`` uses it: ``show map`` and ``del map`` of two maps."""

    def __init__(self, maps: dict[str, dict[str, int]]) -> None:
        self.maps = maps

    def ask(self, command: str) -> str:
        verb, _, path, *key = command.split(" ")
        name = path.rsplit("/", 1)[-1].removesuffix(".map")
        if verb == "show":
            return "".join(f"0x{i:x} {k} {v}\n" for i, (k, v) in enumerate(self.maps.get(name, {}).items()))
        self.maps.get(name, {}).pop(key[0], None)
        return ""


@pytest.fixture
def asleep(owner, team):
    """Three scale-to-zero deployments asleep on one host with room for all."""
    pool = Pool.objects.create(name="cpu", memory_budget_mb=1000)
    host = Host.objects.create(name="h0", address="127.0.0.1", last_heartbeat_at=timezone.now(), pool=pool)
    add_instance(host, "cpu-0", 18200)
    deployments = []
    for slug in ("a", "b", "c"):
        model = RegisteredModel.objects.create(team=team, name=slug, slug=slug, created_by=owner)
        version = make_version(model)
        d = services.deploy_version(actor=owner, model=model, version=version, replicas=1, pool=pool)
        placement = d.placements.get()
        assert reports.placement_loaded(placement.pk, placement.generation, version)
        autoscaling.configure(actor=owner, deployment=d, values=POLICY)
        autoscaling.sleep(actor=owner, deployment=Deployment.objects.get(pk=d.pk))
        placement.refresh_from_db()
        assert reports.placement_unloaded(placement.pk, placement.generation, "unloaded")
        deployments.append(Deployment.objects.get(pk=d.pk))
    return host, deployments


def test_wake_ups_read_together_are_placed_and_reach_their_host_as_one_change(asleep):
    host, deployments = asleep
    before = Host.objects.get(pk=host.pk).desired_generation
    held_at = int(timezone.now().timestamp() * 1000) - 50
    admin = FakeAdmin({"wakeups": {f"d{d.pk}": held_at for d in deployments}})

    held = set()
    assert poll_wakeups(admin, options(), held=held.update) == 3

    assert admin.maps["wakeups"] == {}  # read once: removed
    assert held == {d.pk for d in deployments}  # the gateway syncs each alone once its replica loaded
    for d in deployments:
        d.refresh_from_db()
        assert d.replicas == 1 and d.asleep_since is None
        assert d.placements.get().state == PlacementState.PENDING
        assert d.scaling_memory["cold"]["held_at"] == held_at
    assert Host.objects.get(pk=host.pk).desired_generation == before + 1
    # The same signals again (a second held request of each): nothing changes, the host is not told again.
    admin.maps["wakeups"] = {f"d{d.pk}": held_at for d in deployments}
    assert poll_wakeups(admin, options()) == 0
    assert Host.objects.get(pk=host.pk).desired_generation == before + 1


def failing_wake(monkeypatch, deployment) -> None:
    """``autoscaling.wake`` fails for ``deployment`` (its database went away), works for the others."""
    real_wake = autoscaling.wake

    def wake(deployment_id, **kwargs):
        if deployment_id == deployment.pk:
            raise RuntimeError("the database went away")
        return real_wake(deployment_id, **kwargs)

    monkeypatch.setattr(autoscaling, "wake", wake)


def test_a_wake_up_that_fails_still_lets_the_others_reach_their_host(asleep, monkeypatch):
    host, deployments = asleep
    before = Host.objects.get(pk=host.pk).desired_generation
    failing_wake(monkeypatch, deployments[1])
    admin = FakeAdmin({"wakeups": {f"d{d.pk}": 1 for d in deployments}})
    with pytest.raises(RuntimeError):
        poll_wakeups(admin, options())
    assert Deployment.objects.get(pk=deployments[0].pk).replicas == 1
    assert Host.objects.get(pk=host.pk).desired_generation == before + 1


@pytest.mark.django_db(transaction=True)
def test_wake_ups_read_together_are_placed_side_by_side_on_the_pool(asleep):
    from concurrent.futures import ThreadPoolExecutor

    host, deployments = asleep
    before = Host.objects.get(pk=host.pk).desired_generation
    admin = FakeAdmin({"wakeups": {f"d{d.pk}": 1 for d in deployments}})
    with ThreadPoolExecutor(4) as pool:
        assert poll_wakeups(admin, options(), pool=pool) == 3
    for d in deployments:
        assert Deployment.objects.get(pk=d.pk).placements.get().state == PlacementState.PENDING
    assert Host.objects.get(pk=host.pk).desired_generation == before + 1


@pytest.mark.django_db(transaction=True)
def test_side_by_side_a_failed_wake_up_is_raised_after_the_others_reached_their_host(asleep, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    host, deployments = asleep
    before = Host.objects.get(pk=host.pk).desired_generation
    failing_wake(monkeypatch, deployments[0])
    admin = FakeAdmin({"wakeups": {f"d{d.pk}": 1 for d in deployments}})
    with ThreadPoolExecutor(4) as pool, pytest.raises(RuntimeError):
        poll_wakeups(admin, options(), pool=pool)
    assert [Deployment.objects.get(pk=d.pk).replicas for d in deployments] == [0, 1, 1]
    assert Host.objects.get(pk=host.pk).desired_generation == before + 1


@pytest.mark.django_db(transaction=True)
def test_the_wake_thread_reads_the_next_wake_ups_while_the_earlier_are_placed(asleep, monkeypatch):
    """With ``in_flight`` nothing is waited for: a wake-up read while an earlier one still waits (for its
    pool's lock, say) is handed over at once, one already in flight is not handed over twice, and each
    batch's host is told once its last wake-up ended."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from apps.gateway.autoscaling import InFlight

    host, (first, second, _) = asleep
    before = Host.objects.get(pk=host.pk).desired_generation
    release, real_wake, started = threading.Event(), autoscaling.wake, []

    def slow_wake(deployment_id, **kwargs):
        started.append(deployment_id)
        if deployment_id == first.pk:
            assert release.wait(30)
        return real_wake(deployment_id, **kwargs)

    monkeypatch.setattr(autoscaling, "wake", slow_wake)
    in_flight = InFlight()
    with ThreadPoolExecutor(4) as pool:
        admin = FakeAdmin({"wakeups": {f"d{first.pk}": 1}})
        assert poll_wakeups(admin, options(), pool=pool, in_flight=in_flight) == 1
        assert len(in_flight) == 1  # returned while the wake-up waits
        admin.maps["wakeups"] = {f"d{first.pk}": 1, f"d{second.pk}": 2}  # signalled again, and a new one
        assert poll_wakeups(admin, options(), pool=pool, in_flight=in_flight) == 1
        deadline = time.monotonic() + 30
        while Deployment.objects.get(pk=second.pk).replicas != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert Deployment.objects.get(pk=second.pk).replicas == 1  # placed behind no earlier wake-up
        assert Deployment.objects.get(pk=first.pk).replicas == 0
        assert Host.objects.get(pk=host.pk).desired_generation == before + 1  # the second's batch told it
        release.set()
    assert started.count(first.pk) == 1 and len(in_flight) == 0
    assert Deployment.objects.get(pk=first.pk).replicas == 1
    assert Host.objects.get(pk=host.pk).desired_generation == before + 2


@pytest.mark.django_db(transaction=True)
def test_the_wake_thread_hands_finished_cold_starts_to_its_pool_too(asleep):
    from concurrent.futures import ThreadPoolExecutor

    from apps.gateway.autoscaling import InFlight

    _, (first, *_) = asleep
    admin = FakeAdmin({"coldstart": {f"d{first.pk}": 1234}})
    in_flight = InFlight()
    with ThreadPoolExecutor(2) as pool:
        assert poll_wakeups(admin, options(), {first.pk: 5.0}, pool=pool, in_flight=in_flight) == 0
    assert admin.maps["coldstart"] == {} and len(in_flight) == 0
    first.refresh_from_db()
    assert first.last_cold_start_ms == 1234
    assert first.events.filter(kind="cold_start", details__held_ms=1234).count() == 1
