"""Real tritonserver under a real host agent: the requests a version served since the last scrape are counted
when a switch or an undeploy unloads it, exactly once, with no scrape between the last request and the unload."""

from __future__ import annotations

import pytest

from apps.deployments import rollouts, services
from apps.deployments.models import DeploymentState, PlacementState
from apps.monitoring.models import ModelMetrics, ScrapeState
from apps.monitoring.scraper import scrape_instance
from tests.conftest import wait_for
from tests.monitoring.builders import infer_body, reshaper_version
from tests.monitoring.live import post, send, totals
from tests.support.servers import deployment_settled, instance_of

pytestmark = [pytest.mark.triton, pytest.mark.django_db(transaction=True)]


def test_counts_at_a_switch_and_an_undeploy_add_up_to_what_clients_sent(
    start_agent, make_reshaper_version, owner, tmp_path
):
    agent = start_agent("mon-fc")
    instance = instance_of(agent)
    v1 = make_reshaper_version()
    v2 = reshaper_version(v1.model, owner, tmp_path)
    name = v1.model.triton_model_name()
    deployment = deployment_settled(
        services.deploy_version(actor=owner, model=v1.model, version=v1, instances=[instance])
    )
    assert deployment.state == DeploymentState.SERVING, deployment.last_error
    # The agent started this server, so its first reading counts from zero: the deploy's smoke inference too,
    # which is not part of the counts below.
    scrape_instance(instance)
    ModelMetrics.objects.all().delete()

    send(instance, name, ok=37, failing=4)  # N = 41 requests to v1, and no scrape before the switch
    deployment = deployment_settled(services.switch_version(actor=owner, deployment=deployment, version=v2))
    assert deployment.active_version == v2, deployment.last_error
    first = totals(v1)
    assert (first["success"], first["failure"]) == (37, 4)  # counted at the switch, before any scrape

    send(instance, name, ok=23, failing=2)  # M = 25 requests to v2, and no scrape before the undeploy
    services.undeploy(actor=owner, deployment=deployment)
    wait_for(
        lambda: type(deployment).objects.get(pk=deployment.pk).state == DeploymentState.UNDEPLOYED,
        120,
        f"the undeploy\n{agent.output()}",
    )
    second = totals(v2)
    assert (second["success"], second["failure"]) == (23, 2)

    # The regular scrapes afterwards count nothing twice.
    scrape_instance(instance)
    scrape_instance(instance)
    assert (totals(v1)["success"], totals(v1)["failure"]) == (37, 4)
    assert (totals(v2)["success"], totals(v2)["failure"]) == (23, 2)
    assert ModelMetrics.objects.filter(model=v1.model, success__lt=0).count() == 0
    state = ScrapeState.objects.get(instance=instance)
    assert {key.rsplit("|", 1)[1] for key in state.finals} == {"1", "2"}


def send_to(instance, name: str, version: int, count: int) -> None:
    """``count`` successful requests that name ``version`` (as a client pinning a version does)."""
    url = f"{instance.endpoint_url()}/v2/models/{name}/versions/{version}/infer"
    assert [post(url, infer_body(1)) for _ in range(count)] == [200] * count


def canary_loaded(deployment, canary) -> bool:
    return deployment.placements.filter(canary_version=canary, state=PlacementState.READY).exists()


def test_counts_at_a_rollout_abort_and_a_promote_add_up_to_what_clients_sent(
    start_agent, make_reshaper_version, owner, tmp_path, settings
):
    settings.ROLLOUT_UNLOAD_DELAY_S = 0
    agent = start_agent("mon-ro")
    instance = instance_of(agent)
    v1 = make_reshaper_version()
    v2, v3 = reshaper_version(v1.model, owner, tmp_path), reshaper_version(v1.model, owner, tmp_path)
    name = v1.model.triton_model_name()
    deployment = deployment_settled(
        services.deploy_version(actor=owner, model=v1.model, version=v1, instances=[instance])
    )
    # The agent started this server, so its first reading counts from zero: the deploy's smoke inference too,
    # which is not part of the counts below.
    scrape_instance(instance)
    ModelMetrics.objects.all().delete()

    # A rollout of v2 (loaded beside v1 at weight 0), aborted: the canary's requests are counted as it goes.
    send_to(instance, name, 1, 9)
    first = rollouts.start_rollout(actor=owner, deployment=deployment, canary=v2)
    wait_for(lambda: canary_loaded(deployment, v2), 120, f"v2 beside v1\n{agent.output()}")
    send_to(instance, name, 2, 6)
    send_to(instance, name, 1, 4)
    rollouts.abort(actor=owner, rollout=first)

    def canary_unloaded() -> bool:
        rollouts.check_rollouts()  # the beat's tick: it unloads an ended rollout's canary
        return not deployment.placements.filter(canary_version__isnull=False).exists()

    wait_for(canary_unloaded, 120, f"v2 unloaded\n{agent.output()}", interval=0.5)
    assert (totals(v2)["success"], totals(v2)["failure"]) == (6, 0)

    # A rollout of v3, promoted: v1 is unloaded, and everything it answered since the baseline is counted.
    first = rollouts.start_rollout(actor=owner, deployment=deployment, canary=v3)
    wait_for(lambda: canary_loaded(deployment, v3), 120, f"v3 beside v1\n{agent.output()}")
    send_to(instance, name, 3, 5)
    send_to(instance, name, 1, 2)
    rollouts.promote_now(actor=owner, rollout=first)
    deployment = deployment_settled(deployment)
    assert deployment.active_version == v3, deployment.last_error
    assert totals(v1)["success"] == 9 + 4 + 2

    # v3 still serves: the next scrape counts it, and nothing twice.
    scrape_instance(instance)
    assert [totals(v)["success"] for v in (v1, v2, v3)] == [15, 6, 5]
