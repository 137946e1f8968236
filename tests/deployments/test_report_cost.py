"""What one agent report costs the platform: a deploy to many hosts sends two reports per placement, each
waiting for the deployment's row lock, so a report's work must not grow with the deployment's placements, and
the reports that neither settle nor write an event (started, waiting) take no lock at all - while a stale one
is still refused."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from apps.deployments import reports, services
from apps.deployments.models import DeploymentInstance, DeploymentState, PlacementState
from tests.support.models import add_instance

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def no_tasks(monkeypatch, team):
    monkeypatch.setattr(services, "_enqueue", lambda placements: None)
    team.quota_instances = 100
    team.save(update_fields=["quota_instances"])


def deploy_on(owner, version, host, count: int):
    instances = [add_instance(host, f"cpu-{i}", port=18100 + 10 * i) for i in range(count)]
    deployment = services.deploy_version(
        actor=owner, model=version.model, version=version, instances=instances
    )
    return deployment, list(deployment.placements.order_by("pk"))


def loaded_queries(placement, version) -> list[str]:
    with CaptureQueriesContext(connection) as queries:
        assert reports.placement_loaded(placement.pk, placement.generation, version)
    return [q["sql"] for q in queries.captured_queries]


def test_a_loaded_report_costs_the_same_queries_for_3_and_30_placements(owner, model, version, shared_host):
    from apps.fleet.models import Host

    _, small = deploy_on(owner, version, shared_host, 3)
    other = Host.objects.create(name="big", address="127.0.0.2")
    model2 = model.__class__.objects.create(team=model.team, name="Other", slug="other", created_by=owner)
    v2 = version.__class__.objects.create(
        model=model2, number=1, state=version.state, signature=version.signature, config_text=""
    )
    big_deployment, big = deploy_on(owner, v2, other, 30)
    # Not the last placement: the deployment stays DEPLOYING and nothing is read per placement.
    assert len(loaded_queries(small[0], version)) == len(loaded_queries(big[0], v2))
    for placement in big[1:-1]:
        reports.placement_loaded(placement.pk, placement.generation, v2)
    big_deployment.refresh_from_db()
    assert big_deployment.state == DeploymentState.DEPLOYING
    # The last one: SERVING, with the event naming the version.
    loaded_queries(big[-1], v2)
    big_deployment.refresh_from_db()
    assert big_deployment.state == DeploymentState.SERVING and big_deployment.active_version == v2
    assert big_deployment.events.filter(kind="deployed", version=v2).count() == 1
    assert big_deployment.events.filter(kind="serving").count() == 30


def test_started_and_waiting_take_no_lock_and_a_stale_one_is_refused(owner, model, version, shared_host):
    deployment, (placement,) = deploy_on(owner, version, shared_host, 1)
    with CaptureQueriesContext(connection) as queries:
        assert reports.placement_started(placement.pk, 1)
        assert reports.placement_waiting(placement.pk, 1, "instance not running")
    assert not any("FOR UPDATE" in q["sql"] for q in queries.captured_queries)
    assert DeploymentInstance.objects.get(pk=placement.pk).state == PlacementState.LOADING
    services.undeploy(actor=owner, deployment=deployment)  # a new decision: generation 2
    assert not reports.placement_started(placement.pk, 1)
    assert not reports.placement_waiting(placement.pk, 1, "late")
    fresh = DeploymentInstance.objects.get(pk=placement.pk)
    assert fresh.generation == 2 and fresh.last_error == "instance not running"
    assert reports.placement_started(placement.pk, 2)


def test_a_report_through_the_agent_api_reads_only_its_own_instances_placements(
    owner, version, shared_host, monkeypatch
):
    """The answer to a report carries the placement as it is now; building it must not read every placement
    of the model on the host (a host serving one model on 30 instances sent 30 rows back per report)."""
    import json

    from apps.deployments import agent_api
    from apps.fleet.models import CREDENTIAL_SCHEME, hash_host_secret, new_host_secret
    from tests.fleet.helpers import agent_client

    credential = new_host_secret(CREDENTIAL_SCHEME)
    shared_host.credential_hash = hash_host_secret(credential)
    shared_host.save(update_fields=["credential_hash"])
    deployment, placements = deploy_on(owner, version, shared_host, 30)
    read = []
    live_placements = agent_api._live_placements
    monkeypatch.setattr(
        agent_api, "_live_placements", lambda *a, **kw: read.append(live_placements(*a, **kw)) or read[-1]
    )
    agent = agent_client(credential)
    for result in ("started", "loaded"):
        body = {"generation": placements[7].generation, "result": result, "version": version.pk}
        answer = agent.post(
            f"/agent/v1/placements/{placements[7].pk}/report",
            json.dumps(body),
            content_type="application/json",
        )
        assert answer.status_code == 200, answer.content
        assert answer.json()["accepted"] is True
        assert answer.json()["placement"]["id"] == placements[7].pk
    assert answer.json()["placement"]["state"] == PlacementState.READY
    assert [len(rows) for rows in read] == [1, 1]


def test_a_desired_state_costs_the_same_queries_for_3_and_12_placements(team, owner, shared_host):
    """A host's agent fetches its whole desired state after every change there: its queries must not grow
    with the placements or their versions (a deferred column read per row would be one query each)."""
    from apps.deployments.agent_api import desired_state_of
    from apps.fleet.models import Host
    from hostagent.protocol import check_desired_state
    from tests.support.models import serving_rows

    def queries_for(host, count: int) -> tuple[int, dict]:
        instance = add_instance(host, "cpu-0", port=18300 + host.pk * 10)
        for i in range(count):
            serving_rows(team, owner, f"m{host.pk}-{i}", instance)
        host.refresh_from_db()
        with CaptureQueriesContext(connection) as queries:
            state = desired_state_of(host)
        return len(queries.captured_queries), check_desired_state(state)

    small, small_state = queries_for(shared_host, 3)
    big, big_state = queries_for(Host.objects.create(name="big", address="127.0.0.2"), 12)
    assert small == big
    assert len(small_state["placements"]) == 3 and len(big_state["versions"]) == 12
    entry = big_state["placements"][0]
    version = big_state["versions"][str(entry["active"])]
    assert entry["label"] == "big/cpu-0" and entry["model_name"] == version["model_name"]
    assert version["label"] == f"{version['model_name'].split('__')[1]} v1" and version["steps"] == []
