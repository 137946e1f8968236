"""Stress: SERVING in the database means Triton serves that model and that version - no missing, no extra.

One real host agent with one CPU instance and a reconcile interval of 300 ms. 32 models are deployed in a
burst while models that are already SERVING are switched to another version and others undeployed, and in
every later round undeployed models are deployed again while more switches and undeploys run. Five rounds
in a row, so a race that shows one time in two cannot hide.

What is compared, and when:

* At the end of every round, once nothing is in flight (no deployment DEPLOYING / SWITCHING / UNDEPLOYING,
  every placement's decision applied) and after three more reconcile intervals, strictly: the set of
  (Triton model name, version) of SERVING deployments equals the set Triton reports ready. A reconcile
  that undoes a load, or a stale task that loads or unloads after a newer decision, shows up here.
* During the run, between operations (a snapshot of the database, then Triton, then the database again):
  a deployment SERVING with its placement READY and its decision applied in both snapshots, unchanged, must
  be ready in Triton at that version; and a model version Triton reports ready must belong to a deployment
  that is live (not UNDEPLOYED) and has that version as its active, target or served version in one of the
  snapshots. Mid-transition states (a version loading, the old and the new version both loaded during a
  switch) are allowed exactly as far as the database says a transition is in flight.
"""

from __future__ import annotations

import random
import time

import pytest
import requests

from apps.deployments import services
from apps.deployments.models import Deployment, DeploymentInstance, DeploymentState, PlacementState
from apps.fleet.models import InstanceState, TritonInstance
from apps.registry.models import RegisteredModel
from tests.conftest import wait_for

pytestmark = [pytest.mark.triton, pytest.mark.django_db(transaction=True)]

MODELS = 32
ROUNDS = 5
CHURN = 2  # switches, undeploys and redeploys per round (a switch costs three loads)
RECONCILE_MS = 300
IN_FLIGHT = (DeploymentState.DEPLOYING, DeploymentState.SWITCHING, DeploymentState.UNDEPLOYING)


def snapshot() -> dict[str, dict]:
    """The latest deployment of every model: its state, versions and its (single) placement."""
    rows: dict[str, dict] = {}
    deployments = Deployment.objects.select_related(
        "model__team", "active_version", "target_version"
    ).order_by("created_at", "id")
    placements = {p.deployment_id: p for p in DeploymentInstance.objects.select_related("served_version")}
    for d in deployments:
        p = placements.get(d.pk)
        rows[d.triton_model_name()] = {
            "id": d.pk,
            "state": d.state,
            "active": d.active_version.number if d.active_version else None,
            "target": d.target_version.number if d.target_version else None,
            "served": p.served_version.number if p and p.served_version else None,
            "placement": p.state if p else None,
            "generation": p.generation if p else None,
            "applied": bool(p and p.applied_generation == p.generation),
        }
    return rows


def triton_ready(url: str, names: list[str]) -> set[tuple[str, int]]:
    """(name, version) pairs Triton answers ready for, over every name the test uses and its candidate."""
    ready = set()
    with requests.Session() as session:
        for name in names:
            for version in (1, 2):
                reply = session.get(f"http://{url}/v2/models/{name}/versions/{version}/ready", timeout=5)
                if reply.status_code == 200:
                    ready.add((name, version))
    return ready


def settled_serving(row: dict) -> bool:
    return (
        row["state"] == DeploymentState.SERVING
        and row["placement"] == PlacementState.READY
        and row["applied"]
        and row["served"] == row["active"]
    )


def check_sample(url: str, names: list[str]) -> None:
    before = snapshot()
    ready = triton_ready(url, names + [n + "__candidate" for n in names])
    after = snapshot()
    for name in names:
        a, b = before.get(name), after.get(name)
        if a and b and a == b and settled_serving(a):
            assert (name, a["active"]) in ready, f"{name} is SERVING v{a['active']} but not ready: {a}"
    for name, version in ready:
        if name.endswith("__candidate"):
            base = name.removesuffix("__candidate")
            rows = [r for r in (before.get(base), after.get(base)) if r]
            assert any(r["state"] == DeploymentState.SWITCHING or not r["applied"] for r in rows), (
                f"candidate {name} v{version} is loaded while no switch is in flight: {rows}"
            )
            continue
        rows = [r for r in (before.get(name), after.get(name)) if r]
        assert any(
            r["state"] != DeploymentState.UNDEPLOYED and version in (r["active"], r["target"], r["served"])
            for r in rows
        ) or any(not r["applied"] for r in rows), f"{name} v{version} is ready but not deployed: {rows}"


def quiescent(names: list[str]) -> dict[str, dict]:
    def done():
        rows = snapshot()
        busy = [n for n, r in rows.items() if r["state"] in IN_FLIGHT or not r["applied"]]
        return rows if not busy else None

    return wait_for(done, 120, "every deployment to settle", interval=0.2)


def check_strict(url: str, names: list[str]) -> None:
    rows = snapshot()
    serving = {(n, r["active"]) for n, r in rows.items() if r["state"] == DeploymentState.SERVING}
    ready = triton_ready(url, names + [n + "__candidate" for n in names])
    assert serving == ready, f"missing in Triton: {serving - ready}; extra in Triton: {ready - serving}"
    for row in rows.values():
        if row["state"] == DeploymentState.SERVING:
            assert row["placement"] == PlacementState.READY and row["served"] == row["active"], row
        else:
            assert row["placement"] != PlacementState.READY, row


def test_serving_deployments_equal_triton_ready_models_under_concurrent_deploys_switches_undeploys(
    start_agent, make_ready_version, owner, team
):
    team.quota_deployed_models = MODELS + 5
    team.save()
    agent = start_agent("stress", FLEET_RECONCILE_INTERVAL_MS=RECONCILE_MS)
    instance = wait_for(
        lambda: TritonInstance.objects.filter(host__name="stress", state=InstanceState.READY).first(),
        120,
        f"the agent's instance\n{agent.output()}",
    )
    models = []
    for i in range(MODELS):
        v1 = make_ready_version(slug=f"m{i:02d}", scale=1.0 + i)
        make_ready_version(model=v1.model, scale=-1.0 - i)
        models.append(v1.model)
    names = [m.triton_model_name() for m in models]
    rng = random.Random(16)
    undeployed: list[RegisteredModel] = list(models)  # round 1 deploys them all
    started = time.monotonic()
    for _ in range(ROUNDS):
        deploys = list(undeployed)
        switches = undeploys = CHURN
        undeployed = []
        while deploys or switches or undeploys:
            # Deploys come in bursts; switches and undeploys hit models that are SERVING right now.
            for model in deploys[: rng.randint(1, 4)]:
                version = model.versions.get(number=1)
                services.deploy_version(actor=owner, model=model, version=version, instances=[instance])
                deploys.remove(model)
            serving = list(
                Deployment.objects.filter(state=DeploymentState.SERVING, model__in=models).select_related(
                    "model", "active_version"
                )
            )
            rng.shuffle(serving)
            if serving and switches and rng.random() < 0.5:
                deployment = serving.pop()
                other = 2 if deployment.active_version.number == 1 else 1
                services.switch_version(
                    actor=owner, deployment=deployment, version=deployment.model.versions.get(number=other)
                )
                switches -= 1
            if serving and undeploys and rng.random() < 0.5:
                deployment = serving.pop()
                services.undeploy(actor=owner, deployment=deployment)
                undeployed.append(deployment.model)
                undeploys -= 1
            check_sample(agent.url, names)
            time.sleep(rng.uniform(0.05, 0.4))
        # Keep sampling while the agent works through the queue, then compare strictly.
        while (
            not all(r["state"] not in IN_FLIGHT and r["applied"] for r in snapshot().values())
            and time.monotonic() - started < 170
        ):
            check_sample(agent.url, names)
            time.sleep(0.2)
        quiescent(names)
        check_strict(agent.url, names)
        time.sleep(3 * RECONCILE_MS / 1000)  # reconcile must not undo anything afterwards
        check_strict(agent.url, names)
        assert Deployment.objects.filter(state=DeploymentState.FAILED).count() == 0, [
            d.last_error for d in Deployment.objects.filter(state=DeploymentState.FAILED)
        ]
        assert Deployment.objects.filter(state=DeploymentState.SERVING).count() >= MODELS - CHURN
