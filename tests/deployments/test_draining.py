"""Drain, then unload (``apps.deployments.draining``), on the rows: a replica the gateway routes to is handed to
its agent for unloading only once the gateway confirms it drained (or the drain timeout passed); one no
gateway routes to is handed over at once, as before; the gateway's mark and an unload decision never both win.
An undeploy drains the same way: the gateway drops the route at once but confirms the replicas it routed to.
The whole path with a real agent and gateway: ``tests/gateway/test_drain_live.py`` and
``tests/gateway/test_undeploy_drain_live.py``."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.deployments import agent_api, autoscaling, draining, healing, reports, reserved, scheduler, services
from apps.deployments.models import Deployment, DeploymentState, PlacementState
from apps.fleet.models import Host, Pool
from apps.gateway.state import Tracked, desired_state
from apps.registry.models import RegisteredModel
from tests.support.models import add_instance, make_version

POLICY = {"min_replicas": 0, "max_replicas": 1, "scale_down_window_s": 0, "idle_period_s": 60}


@pytest.fixture
def serving(owner, team):
    """A scale-to-zero deployment with one replica READY (as its agent would have reported)."""
    pool = Pool.objects.create(name="cpu", memory_budget_mb=1000)
    host = Host.objects.create(name="h0", address="127.0.0.1", last_heartbeat_at=timezone.now(), pool=pool)
    add_instance(host, "cpu-0", 18200)
    model = RegisteredModel.objects.create(team=team, name="M", slug="m", created_by=owner)
    version = make_version(model)
    deployment = services.deploy_version(actor=owner, model=model, version=version, replicas=1, pool=pool)
    placement = deployment.placements.get()
    assert reports.placement_loaded(placement.pk, placement.generation, version)
    autoscaling.configure(actor=owner, deployment=deployment, values=POLICY)
    return Deployment.objects.get(pk=deployment.pk)


def agent_entry(placement) -> dict:
    placement.refresh_from_db()
    return agent_api.placement_entry(placement, None, False)


def test_a_routed_replica_is_unloaded_only_once_the_gateway_confirms_it_drained(owner, serving):
    placement = serving.placements.get()
    tracked = Tracked()
    desired_state(tracked)
    assert list(tracked.to_mark) == [placement.pk]  # about to enter the rotation: marked first
    assert draining.placements_routed({placement.pk}) == {placement.pk}

    autoscaling.sleep(actor=owner, deployment=serving)
    entry = agent_entry(placement)
    # Out of the gateway's rotation at once, but its agent still serves it: requests sent before the gateway
    # applied that finish.
    assert placement.unload and placement.draining_since is not None
    assert entry["undeploy"] is False and entry["generation"] == placement.applied_generation
    tracked = Tracked()
    state = desired_state(tracked)
    assert {w for (backend, _), w in state.weights.items() if backend == f"d{serving.pk}"} == {0}
    assert set(tracked.to_confirm) == {placement.pk}

    assert draining.placements_drained({placement.pk}, "no request in flight at the gateway") == 1
    entry = agent_entry(placement)
    assert entry["undeploy"] is True and entry["generation"] > placement.applied_generation
    assert not placement.routed and placement.draining_since is None
    assert serving.events.filter(kind="drained", message__contains="no request in flight").exists()
    assert draining.placements_drained({placement.pk}, "again") == 0  # once


def test_a_replica_no_gateway_routes_to_is_unloaded_at_once(owner, serving):
    placement = serving.placements.get()
    autoscaling.sleep(actor=owner, deployment=serving)
    entry = agent_entry(placement)
    assert entry["undeploy"] is True and entry["generation"] > placement.applied_generation
    assert placement.draining_since is None


def test_an_unload_decided_before_the_gateway_marks_it_keeps_it_out_of_rotation(owner, serving):
    placement = serving.placements.get()
    tracked = Tracked()
    desired_state(tracked)  # the gateway read it in rotation...
    autoscaling.sleep(actor=owner, deployment=serving)  # ...then the platform told it to unload
    assert draining.placements_routed(set(tracked.to_mark)) == set()  # the gateway leaves it out
    assert agent_entry(placement)["undeploy"] is True


def test_a_replica_woken_while_draining_is_not_unloaded(owner, serving):
    placement = serving.placements.get()
    draining.placements_routed({placement.pk})
    autoscaling.sleep(actor=owner, deployment=serving)
    assert autoscaling.wake(serving.pk) is True  # the same instance: its row is reused, still loaded
    placement.refresh_from_db()
    assert not placement.unload and placement.routed and placement.draining_since is None
    assert draining.placements_drained({placement.pk}, "late confirmation") == 0
    assert agent_entry(placement)["undeploy"] is False


def test_without_a_confirmation_the_beat_hands_it_over_after_the_drain_timeout(owner, serving, settings):
    settings.GATEWAY_DRAIN_TIMEOUT_S = 30
    placement = serving.placements.get()
    draining.placements_routed({placement.pk})
    autoscaling.sleep(actor=owner, deployment=serving)
    assert draining.release_undrained() == 0  # within the timeout: the gateway may still confirm
    assert healing.tick()["undrained"] == 0
    later = timezone.now() + timedelta(seconds=31)
    assert draining.release_undrained(now=later) == 1
    assert agent_entry(placement)["undeploy"] is True
    assert serving.events.filter(
        kind="drained", message__contains="no gateway confirmed it within 30 s"
    ).exists()


def test_scaled_down_and_replaced_replicas_drain_too(owner, serving):
    placement = serving.placements.get()
    draining.placements_routed({placement.pk})
    with_lock = Deployment.objects.get(pk=serving.pk)
    removed = scheduler.remove_replicas(with_lock, 0, "scaled down")
    assert [p.pk for p in removed] == [placement.pk]
    assert agent_entry(placement)["undeploy"] is False
    assert placement.state == PlacementState.READY  # still serving while it drains


def undeploy(owner, deployment) -> Deployment:
    services.undeploy(actor=owner, deployment=deployment)
    return Deployment.objects.get(pk=deployment.pk)


def unloaded_by_its_agent(placement) -> Deployment:
    """What the agent reports once it applied the undeploy it was handed."""
    placement.refresh_from_db()
    assert reports.placement_unloaded(placement.pk, placement.generation, "unloaded")
    return Deployment.objects.get(pk=placement.deployment_id)


def test_undeploying_a_routed_replica_drops_the_route_but_unloads_it_only_once_drained(owner, serving):
    placement = serving.placements.get()
    draining.placements_routed({placement.pk})
    held = placement.instance.reserved_mb
    assert held > 0

    deployment = undeploy(owner, serving)
    assert deployment.state == DeploymentState.UNDEPLOYING
    entry = agent_entry(placement)
    # Its agent still serves it (the requests the gateway sent it finish); no new request reaches it.
    assert entry["undeploy"] is False and entry["generation"] == placement.applied_generation
    assert placement.unload and placement.routed and placement.draining_since is not None
    assert placement.state == PlacementState.READY
    tracked = Tracked()
    state = desired_state(tracked)
    assert deployment.triton_model_name() not in state.routes  # the gateway's 404 for new requests
    assert not any(backend.startswith(f"d{deployment.pk}") for backend in state.backends)
    key = placement.instance.api_key
    assert tracked.to_confirm == {placement.pk: [(f"d{deployment.pk}", key), (f"d{deployment.pk}c", key)]}
    assert not tracked.to_mark
    placement.instance.refresh_from_db()
    assert placement.instance.reserved_mb == held and reserved.reserved_drift() == {}  # loaded: still held

    assert draining.placements_drained({placement.pk}, "no request in flight at the gateway") == 1
    entry = agent_entry(placement)
    assert entry["undeploy"] is True and entry["generation"] > placement.applied_generation
    tracked = Tracked()
    desired_state(tracked)
    assert not tracked.to_confirm
    assert Deployment.objects.get(pk=deployment.pk).state == DeploymentState.UNDEPLOYING

    deployment = unloaded_by_its_agent(placement)
    assert deployment.state == DeploymentState.UNDEPLOYED
    assert list(deployment.events.values_list("kind", flat=True).order_by("pk"))[-4:] == [
        "undeploy_requested",
        "drained",
        "unloaded",
        "undeployed",
    ]
    placement.instance.refresh_from_db()
    assert placement.instance.reserved_mb == 0 and reserved.reserved_drift() == {}


def test_undeploying_a_replica_no_gateway_routed_unloads_it_at_once(owner, serving):
    placement = serving.placements.get()
    deployment = undeploy(owner, serving)
    entry = agent_entry(placement)
    assert entry["undeploy"] is True and entry["generation"] > placement.applied_generation
    assert placement.draining_since is None
    tracked = Tracked()
    desired_state(tracked)
    assert not tracked.to_confirm and not tracked.to_mark
    assert unloaded_by_its_agent(placement).state == DeploymentState.UNDEPLOYED
    assert not deployment.events.filter(kind="drained").exists()
    assert reserved.reserved_drift() == {}


def test_an_undeploy_decided_before_the_gateway_marks_the_replica_keeps_it_out(owner, serving):
    placement = serving.placements.get()
    tracked = Tracked()
    desired_state(tracked)  # the gateway read it in rotation...
    undeploy(owner, serving)  # ...then the user undeployed
    assert draining.placements_routed(set(tracked.to_mark)) == set()
    assert agent_entry(placement)["undeploy"] is True


def test_an_undeploy_no_gateway_confirms_is_handed_over_after_the_drain_timeout(owner, serving, settings):
    settings.GATEWAY_DRAIN_TIMEOUT_S = 30
    placement = serving.placements.get()
    draining.placements_routed({placement.pk})
    undeploy(owner, serving)
    assert healing.tick()["undrained"] == 0  # within the timeout: the gateway may still confirm
    assert agent_entry(placement)["undeploy"] is False
    assert draining.release_undrained(now=timezone.now() + timedelta(seconds=31)) == 1
    assert agent_entry(placement)["undeploy"] is True
    assert serving.events.filter(
        kind="drained", message__contains="no gateway confirmed it within 30 s"
    ).exists()
    assert unloaded_by_its_agent(placement).state == DeploymentState.UNDEPLOYED
    assert reserved.reserved_drift() == {}


def test_an_asleep_replica_still_marked_routed_is_not_waited_for(owner, serving):
    placement = serving.placements.get()
    draining.placements_routed({placement.pk})
    # Unloaded while the mark stayed (e.g. its agent reported it gone): nothing is in flight on it.
    serving.placements.update(state=PlacementState.UNLOADED, served_version=None)
    reserved.refresh_reserved([placement.instance_id])
    undeploy(owner, serving)
    entry = agent_entry(placement)
    assert entry["undeploy"] is True and entry["generation"] > placement.applied_generation
    assert not placement.routed and placement.draining_since is None
    assert unloaded_by_its_agent(placement).state == DeploymentState.UNDEPLOYED


def test_a_replica_its_agent_reported_unloaded_leaves_its_hosts_desired_state(owner, serving):
    """A dense host keeps a placement row for every model that ever slept there: once its agent confirmed
    the unload, the row (and its version) is no longer in the host's desired state; woken, it is again."""
    placement = serving.placements.get()
    host = placement.instance.host
    version = serving.active_version_id

    def entries() -> tuple[set[int], set[str]]:
        state = agent_api.desired_state_of(Host.objects.get(pk=host.pk))
        return {e["id"] for e in state["placements"]}, set(state["versions"])

    autoscaling.sleep(actor=owner, deployment=serving)
    placement.refresh_from_db()
    assert entries() == ({placement.pk}, {str(version)})  # to unload: its agent must see it
    assert reports.placement_unloaded(placement.pk, placement.generation, "unloaded")
    assert entries() == (set(), set())

    assert autoscaling.wake(serving.pk)
    assert entries() == ({placement.pk}, {str(version)})
