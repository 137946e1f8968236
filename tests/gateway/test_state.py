"""What the gateway is told to route, read from the database (no HAProxy needed)."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from apps.deployments.models import Deployment, PlacementState, Rollout
from apps.fleet import services as fleet_services
from apps.gateway.state import Tracked, backend_name, desired_state, with_deployments
from tests.support.models import add_instance, make_version, serving_rows

pytestmark = pytest.mark.django_db


def test_a_revoked_hosts_instances_leave_rotation_while_the_others_stay(
    team,
    owner,
    admin_user,
    shared_host,
):
    trusted = add_instance(shared_host, "cpu-0", port=18100)
    edge, _ = fleet_services.create_host(actor=admin_user, name="edge-1", address="127.0.0.2")
    revoked = add_instance(edge, "cpu-0", port=18200)
    deployment = serving_rows(team, owner, "a", trusted)
    deployment.placements.create(instance=revoked, served_version=deployment.active_version, state="READY")
    name = backend_name(deployment.pk)
    before = desired_state().weights
    assert before[(name, trusted.api_key)] == 100 and before[(name, revoked.api_key)] == 100

    fleet_services.revoke_host(actor=admin_user, host=edge)
    after = desired_state().weights
    assert after[(name, trusted.api_key)] == 100
    assert after[(name, revoked.api_key)] == 0


def test_a_replica_told_to_unload_leaves_rotation_before_its_agent_unloads_it(
    team,
    owner,
    shared_host,  # noqa: F811 - the imported fixture
):
    staying = add_instance(shared_host, "cpu-0", port=18100)
    leaving = add_instance(shared_host, "cpu-1", port=18200)
    deployment = serving_rows(team, owner, "a", staying)
    retired = deployment.placements.create(
        instance=leaving, served_version=deployment.active_version, state="READY", retiring_reason="drain"
    )
    name = backend_name(deployment.pk)
    assert desired_state().weights[(name, leaving.api_key)] == 100  # still serves until its replacement does
    retired.unload = True
    retired.save(update_fields=["unload"])
    weights = desired_state().weights
    assert weights[(name, leaving.api_key)] == 0 and weights[(name, staying.api_key)] == 100


def test_the_queries_of_a_sync_do_not_grow_with_the_deployments(team, owner, shared_host):
    """The gateway reads its whole state every sync (hundreds of deployments): a query per deployment made a
    sync of 300 deployments take 200 ms. Unloaded placements are not read at all."""
    instance = add_instance(shared_host, "cpu-0", port=18100)
    other = add_instance(shared_host, "cpu-1", port=18200)
    first = serving_rows(team, owner, "a", instance)
    with CaptureQueriesContext(connection) as one:
        desired_state()
    for slug in ("b", "c", "d", "e"):
        d = serving_rows(team, owner, slug, instance)
        d.placements.create(instance=other, state="UNLOADED", unload=True)
    with CaptureQueriesContext(connection) as five:
        state = desired_state()
    assert len(five.captured_queries) == len(one.captured_queries)
    assert len(state.backends) == 5 and state.backends[backend_name(first.pk)]
    # Only the READY placement on ``instance`` is a server; the unloaded ones on ``other`` are not.
    assert all(len(servers) == 1 for servers in state.backends.values())


def test_a_sync_reads_no_field_row_by_row(team, owner, shared_host):
    """A sync reads only the columns it needs (``DEPLOYMENT_FIELDS`` ...): every path through it - a rollout
    with its canary placements, scale to zero with a failed wake-up, priority levels - makes the same
    queries for one deployment of each kind as for three, none per row."""
    instance = add_instance(shared_host, "cpu-0", port=18100)
    other = add_instance(shared_host, "cpu-1", port=18200)

    def add_each_kind(n: int) -> None:
        rolled = serving_rows(team, owner, f"rolled{n}", instance)
        canary = make_version(rolled.model, 2)
        canary.config_text = 'name: "x"\ndynamic_batching { priority_levels: 2 }\n'
        canary.save(update_fields=["config_text"])
        rolled.placements.update(canary_version=canary)
        Rollout.objects.create(deployment=rolled, stable_version=rolled.active_version, canary_version=canary,
                               current_weight=10)  # fmt: skip
        asleep = serving_rows(team, owner, f"asleep{n}", instance)
        Deployment.objects.filter(pk=asleep.pk).update(min_replicas=0, replicas=1, pinned=False)
        asleep.placements.update(state=PlacementState.FAILED, last_error="load failed", served_version=None)
        rolled.placements.create(instance=other, state="READY", served_version=rolled.active_version,
                                 retiring_reason="drain", unload=True, routed=True)  # fmt: skip

    add_each_kind(0)
    with CaptureQueriesContext(connection) as one:
        desired_state()
    add_each_kind(1)
    add_each_kind(2)
    with CaptureQueriesContext(connection) as three:
        state = desired_state()
    assert len(three.captured_queries) == len(one.captured_queries)
    assert len(state.backends) == 9  # 3 x (stable, canary, asleep)
    assert sum(1 for key in state.priority_levels if key.endswith("/2")) == 3
    assert len(state.wake_failures) == 3


def test_the_models_index_lists_each_teams_callable_models_ready_or_asleep(
    team, owner, other_team, shared_host
):
    instance = add_instance(shared_host, "cpu-0")
    serving_rows(team, owner, "ready", instance)
    asleep = serving_rows(team, owner, "asleep", instance)
    asleep.placements.update(state=PlacementState.UNLOADED, served_version=None)
    Deployment.objects.filter(pk=asleep.pk).update(pinned=False, min_replicas=0, max_replicas=1, replicas=0)
    loading = serving_rows(
        team, owner, "loading", instance
    )  # pinned, its replica not serving yet: no call works
    loading.placements.update(state=PlacementState.LOADING, served_version=None)
    state = desired_state()
    assert {team: sorted(models) for team, models in state.index.items()} == {
        "vision": ["vision__asleep/1/ASLEEP", "vision__ready/1/READY"]
    }
    assert state.index_entries() == {
        "vision": "2",
        "vision.0": "vision__asleep/1/ASLEEP",
        "vision.1": "vision__ready/1/READY",
    }
    assert other_team.slug not in state.index


def test_a_sync_of_some_deployments_gives_them_what_a_full_sync_gives_and_leaves_the_others(
    team, owner, other_team, outsider, shared_host
):
    """A request held for a waking deployment: the gateway syncs that deployment alone when its replica
    loaded (``with_deployments``). For the deployments named, the result is the full sync's - routes,
    servers and weights, checks, the sleepy and wake-failure maps, priority levels, each team's index - and
    nothing of the others changes, even where the database did."""
    instance = add_instance(shared_host, "cpu-0", port=18100)
    other = add_instance(shared_host, "cpu-1", port=18200)
    plain = serving_rows(team, owner, "plain", instance)
    waking = serving_rows(team, owner, "waking", instance)
    Deployment.objects.filter(pk=waking.pk).update(min_replicas=0, replicas=1, pinned=False)
    waking.placements.update(state=PlacementState.LOADING, served_version=None)
    failing = serving_rows(team, owner, "failing", instance)
    Deployment.objects.filter(pk=failing.pk).update(min_replicas=0, replicas=1, pinned=False)
    failing.placements.update(state=PlacementState.LOADING, served_version=None)
    rolled = serving_rows(other_team, outsider, "rolled", instance)
    canary = make_version(rolled.model, 2)
    canary.config_text = 'name: "x"\ndynamic_batching { priority_levels: 2 }\n'
    canary.save(update_fields=["config_text"])
    Rollout.objects.create(deployment=rolled, stable_version=rolled.active_version, canary_version=canary,
                           current_weight=10)  # fmt: skip
    applied = desired_state()
    assert applied.index == {"vision": ["vision__failing/1/ASLEEP", "vision__plain/1/READY",
                                        "vision__waking/1/ASLEEP"], "speech": ["speech__rolled/1/READY"]}  # fmt: skip

    # The waking replica loaded; the failing one failed; the rollout's canary loaded on a second replica.
    waking.placements.update(state=PlacementState.READY, served_version=waking.active_version)
    failing.placements.update(state=PlacementState.FAILED, last_error="load failed: no memory")
    rolled.placements.create(instance=other, state="READY", served_version=rolled.active_version,
                             canary_version=canary)  # fmt: skip
    # ... and a change of a deployment not named: the plain one's replica is told to unload.
    plain.placements.update(unload=True, routed=True)
    named = {waking.pk, failing.pk, rolled.pk}
    tracked = Tracked()
    merged = with_deployments(applied, desired_state(tracked, only=named), named)
    full = desired_state()

    assert merged != full  # the plain deployment's change waits for the full sync ...
    assert merged.weights[(backend_name(plain.pk), instance.api_key)] == 100
    assert full.weights[(backend_name(plain.pk), instance.api_key)] == 0
    assert set(tracked.to_confirm) == set()  # ... and its drain too: it is not read here
    assert with_deployments(merged, desired_state(only={plain.pk}), {plain.pk}) == full  # named too: the same
    assert merged.weights[(backend_name(waking.pk), instance.api_key)] == 100
    assert merged.wake_failures[backend_name(failing.pk)].startswith("load%20failed")
    assert merged.backends[f"d{rolled.pk}c"] and merged.priority_levels == {"speech__rolled/2": "2"}
    assert merged.index == {"vision": ["vision__failing/1/ASLEEP", "vision__plain/1/READY",
                                       "vision__waking/1/READY"], "speech": ["speech__rolled/1,2/READY"]}  # fmt: skip
    assert sorted(tracked.to_mark) == sorted(
        p.pk for p in (*waking.placements.all(), *rolled.placements.all()) if not p.routed
    )

    # Undeployed meanwhile: its route, servers and map entries go, as in a full sync.
    Deployment.objects.filter(pk__in=(rolled.pk, waking.pk)).update(state="UNDEPLOYING")
    gone = with_deployments(full, desired_state(only={rolled.pk, waking.pk}), {rolled.pk, waking.pk})
    assert gone == desired_state()
    assert "speech" not in gone.index and not any(k.startswith(f"d{rolled.pk}") for k in gone.backends)
    assert (
        backend_name(waking.pk) not in gone.sleepy.values()
        and backend_name(failing.pk) in gone.sleepy.values()
    )
