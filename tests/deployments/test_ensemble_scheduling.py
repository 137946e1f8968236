"""An ensemble deployed by replicas: each replica goes where every step version it calls is placed, or
where the steps it lacks fit with it (their memory summed), and those steps' deployments get a replica there;
a lost host or a drain moves an ensemble replica and its steps' replicas together; a step's replica under an
ensemble replica is never released from under it. And a rolled-back step switch through the ensemble
unloads the companion step version. Rows only (no agent): reports are made as the agents would."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.deployments import healing, reports, reserved, rollouts, scheduler, services
from apps.deployments.agent_api import desired_state_of
from apps.deployments.models import Deployment, DeploymentState, PlacementState
from apps.fleet import pools
from apps.fleet.models import Host, Pool
from apps.registry import ensembles
from apps.registry import services as registry
from apps.registry.models import ModelVersion
from tests.deployments.helpers import finish
from tests.registry.ensemble_builders import ensemble_model, ready_step, seed_spec, seed_steps
from tests.support.models import add_instance, make_version

pytestmark = pytest.mark.django_db

STEP_MB = {"preprocess": 100, "resnet50": 300, "postprocess": 100}
ENSEMBLE_MB = 50


@pytest.fixture
def pool(db):
    # binpack: the steps deployed one by one land on one instance, as a team deploying a pipeline wants.
    return Pool.objects.create(name="cpu", memory_budget_mb=1000, placement_policy="binpack")


def pool_instance(pool, name: str, port: int):
    host = Host.objects.create(name=name, address="127.0.0.1", last_heartbeat_at=timezone.now(), pool=pool)
    return add_instance(host, "cpu-0", port)


def sized(version: ModelVersion, mb: int) -> ModelVersion:
    ModelVersion.objects.filter(pk=version.pk).update(footprint_mb=mb)
    version.refresh_from_db()
    return version


@pytest.fixture
def pipeline(owner, team, artifact_root):
    steps = {slug: sized(v, STEP_MB[slug]) for slug, v in seed_steps(owner, team).items()}
    version = ensembles.compose_ensemble(actor=owner, model=ensemble_model(owner, team), spec=seed_spec())
    return steps, sized(version, ENSEMBLE_MB)


def services_model(owner, team, slug):
    return registry.create_model(actor=owner, team=team, name=slug, slug=slug)


def ready_step_like(model) -> ModelVersion:
    return make_version(model, 1)


def deploy(owner, version, **intent) -> Deployment:
    deployment = services.deploy_version(actor=owner, model=version.model, version=version, **intent)
    return Deployment.objects.get(pk=deployment.pk)


def ready_everywhere(*deployments) -> None:
    """Every counted placement loaded as its agent would report it."""
    for deployment in deployments:
        deployment = Deployment.objects.get(pk=deployment.pk)
        version = deployment.target_version or deployment.active_version
        for placement in scheduler.counted(deployment).exclude(state=PlacementState.READY):
            finish(deployment, placement.instance, state=PlacementState.READY, served_version=version)


def where(deployment) -> list[str]:
    return sorted(p.instance.host.name for p in scheduler.counted(Deployment.objects.get(pk=deployment.pk)))


def test_an_ensemble_without_its_steps_deployed_is_a_400_naming_the_steps(owner, pipeline, pool):
    _, version = pipeline
    pool_instance(pool, "h1", 18100)
    with pytest.raises(services.ValidationError) as refused:
        deploy(owner, version, replicas=1, pool=pool)
    text = " ".join(refused.value.messages)
    assert "step[0] (preprocess v1) is not deployed" in text and "step[2] (postprocess v1)" in text


def test_a_step_switching_by_itself_cannot_take_another_version_beside_it_400(owner, pipeline, pool):
    steps, version = pipeline
    pool_instance(pool, "h1", 18100)
    step_deployments = {s: deploy(owner, v, replicas=1, pool=pool) for s, v in steps.items()}
    ready_everywhere(*step_deployments.values())
    resnet_v2 = sized(ready_step(steps["resnet50"].model), 300)
    v2 = ensembles.update_step(actor=owner, version=version, step="resnet50", step_version=resnet_v2.number)
    resnet = step_deployments["resnet50"]
    resnet_v3 = ready_step(steps["resnet50"].model)
    Deployment.objects.filter(pk=resnet.pk).update(state=DeploymentState.SWITCHING, target_version=resnet_v3)
    with pytest.raises(services.ValidationError) as refused:
        deploy(owner, v2, replicas=1, pool=pool)
    text = " ".join(refused.value.messages)
    assert "step[1] (resnet50 v2): its deployment serves another version and is SWITCHING" in text
    assert not Deployment.objects.filter(model=version.model).exists()


def test_an_ensemble_replica_goes_where_its_steps_are_placed(owner, pipeline, pool):
    steps, version = pipeline
    pool_instance(pool, "h1", 18100)
    pool_instance(pool, "h2", 18200)  # emptier, but without the steps
    for slug in ("preprocess", "resnet50", "postprocess"):
        ready_everywhere(deploy(owner, steps[slug], replicas=1, pool=pool, spread="none"))
    step_hosts = {where(Deployment.objects.get(model__slug=s))[0] for s in steps}
    assert len(step_hosts) == 1, step_hosts
    ensemble = deploy(owner, version, replicas=1, pool=pool)
    assert where(ensemble) == sorted(step_hosts)
    placed = ensemble.events.get(kind="placed")
    assert placed.details["need_mb"] == ENSEMBLE_MB and "needs 0.0 GiB" in placed.message
    # No step got a replica more.
    assert all(Deployment.objects.get(model__slug=s).replicas == 1 for s in steps)


def test_an_ensemble_replica_places_the_steps_it_lacks_with_it_and_checks_their_sum(owner, pipeline, pool):
    steps, version = pipeline
    a = pool_instance(pool, "h1", 18100)
    b = pool_instance(pool, "h2", 18200)
    step_deployments = {
        slug: deploy(owner, v, instances=[a]) if slug == "resnet50" else None for slug, v in steps.items()
    }
    # resnet50 pinned on h1; the two others scheduled, on h1 as well (it fits them), then the ensemble asks
    # for 2 replicas: one on h1 with the steps, the second on h2 only if every step may get a replica there.
    for slug in ("preprocess", "postprocess"):
        step_deployments[slug] = deploy(owner, steps[slug], instances=[a])
    for d in step_deployments.values():
        ready_everywhere(d)
    ensemble = deploy(owner, version, replicas=2, pool=pool)
    assert where(ensemble) == ["h1"]
    assert "1 of 2 replica(s) pending" in ensemble.pending_reason
    assert "serves its steps or may get a replica of each step it lacks" in ensemble.pending_reason

    # Scheduled steps instead: the second replica takes a replica of each step to h2 (their sum checked).
    services.undeploy(actor=owner, deployment=ensemble)
    Deployment.objects.filter(pk=ensemble.pk).update(state=DeploymentState.UNDEPLOYED)
    for slug, d in step_deployments.items():
        services.undeploy(actor=owner, deployment=d)
        Deployment.objects.filter(pk=d.pk).update(state=DeploymentState.UNDEPLOYED)
        d.placements.update(state=PlacementState.UNLOADED)
        reserved.repair_reserved()  # the rows above changed behind the writers' back, as the beat finds them
        step_deployments[slug] = deploy(owner, steps[slug], replicas=1, pool=pool, spread="none")
        ready_everywhere(step_deployments[slug])
    ensemble.placements.update(state=PlacementState.UNLOADED)
    assert {where(d)[0] for d in step_deployments.values()} == {"h1"}
    ensemble = deploy(owner, version, replicas=2, pool=pool)
    assert where(ensemble) == ["h1", "h2"] and not ensemble.pending_reason
    second = ensemble.events.filter(kind="placed", instance=b).get()
    assert second.details["need_mb"] == ENSEMBLE_MB + sum(STEP_MB.values())
    for slug, d in step_deployments.items():
        d = Deployment.objects.get(pk=d.pk)
        assert where(d) == ["h1", "h2"] and d.replicas == 2, slug
        event = d.events.filter(kind="placed", instance=b).get()
        assert "with a replica of ensemble classify" in event.message and "replicas 1 -> 2" in event.message
        assert event.details["ensemble"] == ensemble.pk and event.details["need_mb"] == STEP_MB[slug]
    # The host's desired state names the ensemble and its steps on h2.
    names = {p["model_name"] for p in desired_state_of(b.host)["placements"]}
    assert names == {"vision__classify", "vision__preprocess", "vision__resnet50", "vision__postprocess"}


def test_no_instance_with_room_for_the_ensemble_and_its_steps_leaves_it_pending_with_the_figures(
    owner, team, pipeline, pool
):
    steps, version = pipeline
    pool_instance(pool, "h1", 18100)
    pool_instance(pool, "h2", 18200)
    Pool.objects.filter(pk=pool.pk).update(memory_budget_mb=600)  # h1 holds the steps (500 MB)
    pool.refresh_from_db()
    for v in steps.values():
        ready_everywhere(deploy(owner, v, replicas=1, pool=pool, spread="none"))
    other = services_model(owner, team, "other")
    deploy(owner, sized(ready_step_like(other), 200), replicas=1, pool=pool, spread="none")  # h2: 400 free
    ensemble = deploy(owner, version, replicas=2, pool=pool)
    assert where(ensemble) == ["h1"]
    assert "no instance in cpu has room for it with the steps it lacks there" in ensemble.pending_reason
    # h2: 50 (the ensemble) + 100 + 300 + 100 (its steps) needed, 400 free.
    assert "h2/cpu-0: needs 0.5 GiB, 0.4 GiB free" in ensemble.pending_reason


def test_a_lost_host_moves_the_ensemble_replica_and_its_steps_together(owner, pipeline, pool):
    steps, version = pipeline
    for i in range(3):
        pool_instance(pool, f"h{i + 1}", 18100 + 100 * i)
    step_deployments = [deploy(owner, steps[s], replicas=1, pool=pool, spread="none") for s in steps]
    ready_everywhere(*step_deployments)
    ensemble = deploy(owner, version, replicas=1, pool=pool)
    ready_everywhere(ensemble)
    lost_host = where(ensemble)[0]
    Host.objects.filter(name=lost_host).update(last_heartbeat_at=timezone.now() - timedelta(seconds=120))
    healing.tick()
    new_host = where(ensemble)
    assert new_host != [lost_host]
    for d in step_deployments:
        d = Deployment.objects.get(pk=d.pk)
        assert where(d) == new_host and d.replicas == 1  # the lost replica refilled, none added
        assert d.events.filter(kind="replica_lost", message__contains="moves with ensemble classify").exists()
    # The new replicas serve: the lost ones are released - the ensemble's first, then its steps'.
    ready_everywhere(ensemble, *step_deployments)
    healing.tick()
    old = ensemble.placements.get(instance__host__name=lost_host)
    assert old.unload
    step_old = [d.placements.get(instance__host__name=lost_host) for d in step_deployments]
    assert not any(p.unload for p in step_old)  # the ensemble replica there still calls them
    old.state = PlacementState.UNLOADED
    old.save()
    healing.tick()
    assert all(d.placements.get(instance__host__name=lost_host).unload for d in step_deployments)


def test_a_drain_moves_the_ensemble_with_its_steps_one_group_at_a_time(owner, pipeline, pool):
    steps, version = pipeline
    first = pool_instance(pool, "h1", 18100)
    pool_instance(pool, "h2", 18200)
    step_deployments = [deploy(owner, steps[s], replicas=1, pool=pool, spread="none") for s in steps]
    ready_everywhere(*step_deployments)
    ensemble = deploy(owner, version, replicas=1, pool=pool)
    ready_everywhere(ensemble)
    assert where(ensemble) == [first.host.name]
    pools.set_cordon(actor=owner, host=first.host, cordoned=True, drain=True)
    healing.tick()
    # The first placement on h1 is a step's, but it is the ensemble's replica that moves, taking the steps.
    assert where(ensemble) == ["h2"]
    assert all(where(d) == ["h2"] for d in step_deployments)
    retired = ensemble.placements.get(instance=first)
    assert "is draining" in retired.retiring_reason


def test_a_step_replica_under_an_ensemble_replica_is_not_scaled_away(owner, pipeline, pool):
    steps, version = pipeline
    pool_instance(pool, "h1", 18100)
    pool_instance(pool, "h2", 18200)
    step_deployments = [deploy(owner, steps[s], replicas=1, pool=pool, spread="none") for s in steps]
    ready_everywhere(*step_deployments)
    ensemble = deploy(owner, version, replicas=2, pool=pool)
    resnet = Deployment.objects.get(model__slug="resnet50")
    assert resnet.replicas == 2
    with_lock = Deployment.objects.get(pk=resnet.pk)
    assert scheduler.remove_replicas(with_lock, 1, "scale down") == []
    assert where(resnet) == where(ensemble) == ["h1", "h2"]


def test_a_rolled_back_step_switch_unloads_the_companion_and_leaves_the_old_serving(
    owner, pipeline, shared_host, django_capture_on_commit_callbacks
):
    steps, version = pipeline
    a = add_instance(shared_host, "cpu-0", 18100)
    step_deployments = {s: deploy(owner, v, instances=[a]) for s, v in steps.items()}
    ready_everywhere(*step_deployments.values())
    ensemble = deploy(owner, version, instances=[a])
    ready_everywhere(ensemble)
    resnet = step_deployments["resnet50"]
    resnet_v1 = steps["resnet50"]
    resnet_v2 = sized(ready_step(resnet_v1.model), 300)
    v2 = ensembles.update_step(actor=owner, version=version, step="resnet50", step_version=resnet_v2.number)
    rollout = rollouts.start_rollout(
        actor=owner, deployment=Deployment.objects.get(pk=ensemble.pk), canary=v2
    )

    def step_entry():
        state = desired_state_of(shared_host)
        return next(p for p in state["placements"] if p["deployment"] == resnet.pk)

    # The rollout: resnet50 v2 loaded beside v1 (a companion), the ensemble's canary v2 beside its v1.
    assert step_entry()["canary_target"] == resnet_v2.pk
    step_placement = resnet.placements.get()
    assert reports.placement_loaded(step_placement.pk, step_placement.generation, resnet_v1, canary=resnet_v2)
    placement = ensemble.placements.get()
    placement.refresh_from_db()
    assert reports.placement_canary_loaded(placement.pk, placement.generation, version, v2)

    # Rolled back: while the ensemble's canary is still loaded (it gets no traffic), its step stays ...
    rollouts.abort(actor=owner, rollout=rollout)
    assert services.follow_ensemble_steps() == 0
    assert step_entry()["canary_target"] == resnet_v2.pk
    # ... the ensemble's agent is told to serve v1 alone, and once it reports so, the companion unloads.
    rollouts.unload_canary(rollout.pk)
    assert services.follow_ensemble_steps() == 0
    placement.refresh_from_db()
    with django_capture_on_commit_callbacks(execute=True):  # the report's follow-up runs once committed
        assert reports.placement_loaded(placement.pk, placement.generation, version)  # v1 alone
    step_placement.refresh_from_db()
    assert step_placement.generation > step_placement.applied_generation  # a new decision for the step
    assert step_entry()["canary_target"] is None and step_entry()["target"] == resnet_v1.pk
    assert resnet.events.filter(kind="companion_unloaded").exists()
    assert reports.placement_loaded(step_placement.pk, step_placement.generation, resnet_v1)
    resnet.refresh_from_db()
    step_placement.refresh_from_db()
    assert resnet.state == DeploymentState.SERVING and resnet.active_version == resnet_v1
    assert step_placement.served_version == resnet_v1 and step_placement.canary_version is None
    assert Deployment.objects.get(pk=ensemble.pk).active_version == version
