"""What the drills read and drive: the beat's tick, the replicas that count, duplicates, deploys."""

from __future__ import annotations

from collections import Counter

from apps.deployments import healing
from apps.deployments.models import Deployment, DeploymentInstance, PlacementState
from apps.registry.models import RegisteredModel
from tests.support.servers import request_pool_deployment, wait_serving


class Beat:
    """The scheduler's beat, ticked by the test; counts what it did (a reserved figure it had to repair is a
    writer that forgot it: 0 expected)."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()

    def tick(self) -> None:
        self.counts.update(healing.tick())

    def until(self, predicate):
        def run():
            self.tick()
            return predicate()

        return run


def counted_on(deployment_id: int) -> dict[str, str]:
    """host name -> placement state, for the replicas that count (not retired, not unloaded)."""
    rows = DeploymentInstance.objects.filter(deployment_id=deployment_id, retiring_reason="").exclude(
        state=PlacementState.UNLOADED
    )
    return {p.instance.host.name: p.state for p in rows.select_related("instance__host")}


def duplicate_placements() -> int:
    """Replicas counted twice: a deployment with more counted replicas than it asks for, or two live rows of
    one deployment on one instance."""
    extra = 0
    for deployment in Deployment.objects.all():
        live = DeploymentInstance.objects.filter(deployment=deployment).exclude(state=PlacementState.UNLOADED)
        counted = live.filter(retiring_reason="").count()
        per_instance = Counter(live.values_list("instance_id", flat=True))
        extra += max(0, counted - deployment.replicas) + sum(n - 1 for n in per_instance.values() if n > 1)
    return extra


def deploy_models(client, owner, team, make_scaler_version, replicas: dict[str, int]) -> dict[str, int]:
    """A scaler model per slug, deployed to pool ``cpu`` with that many replicas, SERVING: {slug: id}."""
    ids = {}
    for slug, count in replicas.items():
        model = RegisteredModel.objects.create(team=team, name=slug, slug=slug, created_by=owner)
        make_scaler_version(model, 2.0)
        ids[slug] = request_pool_deployment(client, team.slug, slug, count)
    for pk in ids.values():
        wait_serving(pk)
    return ids


def triton_loaded(agent, instance) -> set[str]:
    """The models this instance's tritonserver has READY, asked over the bridge (its repository index)."""
    import requests

    answer = requests.post(f"http://{agent.url}/v2/repository/index", json={"ready": True},
                           headers=instance.key_headers(), timeout=10)  # fmt: skip
    answer.raise_for_status()
    return {entry["name"] for entry in answer.json() if entry.get("state") == "READY"}


def reports_lost(hosts: dict) -> int:
    """Placements whose row disagrees with the Triton that holds them: READY rows whose model is not loaded
    there, and models loaded there whose row is not READY (a report the platform never got)."""
    lost = 0
    for agent, instance in hosts.values():
        loaded = triton_loaded(agent, instance)
        rows = DeploymentInstance.objects.filter(instance=instance).exclude(state=PlacementState.UNLOADED)
        for placement in rows.select_related("deployment__model__team"):
            name = placement.deployment.model.triton_model_name()
            lost += (placement.state == PlacementState.READY) != (name in loaded)
    return lost
