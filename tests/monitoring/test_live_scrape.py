"""Real tritonservers under a real host agent: exact request counts in the rollups, also across a restart."""

from __future__ import annotations

import os
import signal

import pytest
from django.db.models import Sum

from apps.deployments import services
from apps.fleet import services as fleet_services
from apps.fleet.models import InstanceState, TritonInstance
from apps.monitoring.models import InstanceMetrics, ModelMetrics, ScrapeState
from apps.monitoring.scraper import scrape_instance
from tests.conftest import wait_for
from tests.monitoring.builders import infer_body
from tests.monitoring.live import post, send, totals
from tests.support.servers import deployment_settled, instance_of

pytestmark = [pytest.mark.triton, pytest.mark.django_db(transaction=True)]


def ready_instance(pk: int, old_pid: int | None = None) -> TritonInstance:
    def ready():
        row = TritonInstance.objects.select_related("host").get(pk=pk)
        return row if row.state == InstanceState.READY and row.pid and row.pid != old_pid else None

    return wait_for(ready, 120, "the instance to be READY")


def test_rollups_count_exactly_the_requests_sent_also_across_a_restart(
    start_agent, make_reshaper_version, owner
):
    agent = start_agent("mon-a", FLEET_RESTART_BASE_DELAY_MS=200)
    instance = instance_of(agent)
    # Latency summaries on: staff set the flag and restart the instance, the agent starts it with them.
    TritonInstance.objects.filter(pk=instance.pk).update(latency_summaries=True)
    fleet_services.request_instance_state(actor=None, instance=instance, action="restart")
    instance = ready_instance(instance.pk, instance.pid)
    version = make_reshaper_version()
    name = version.model.triton_model_name()
    deployment = deployment_settled(
        services.deploy_version(actor=owner, model=version.model, version=version, instances=[instance])
    )
    assert deployment.state == "SERVING", deployment.last_error

    # The agent started this server, so its first reading counts from zero: the deploy's smoke inference too,
    # which is not part of the counts below.
    scrape_instance(instance)
    ModelMetrics.objects.all().delete()
    send(instance, name, ok=7, failing=3)
    assert scrape_instance(instance) == 1
    first = totals(version)
    assert (first["success"], first["failure"]) == (7, 3)
    assert first["inferences"] == 10  # Triton ran all ten; three failed in the backend
    rows = ModelMetrics.objects.filter(version=version)
    assert {r.team_id for r in rows} == {version.model.team_id}
    reasons: dict = {}
    for row in rows:
        for reason, count in row.failure_reasons.items():
            reasons[reason] = reasons.get(reason, 0) + count
    assert reasons == {"BACKEND": 3}
    assert all(r.p99_us and r.p50_us <= r.p99_us for r in rows)  # summaries were on
    assert all(r.request_us > 0 and r.executions >= 1 for r in rows)

    # Nothing new: a scrape adds nothing.
    scrape_instance(instance)
    assert totals(version) == first

    # Kill the server outright; the agent restarts it with the model, its counters start at zero.
    old_pid = instance.pid
    os.kill(old_pid, signal.SIGKILL)
    instance = ready_instance(instance.pk, old_pid)
    wait_for(
        lambda: post(f"{instance.endpoint_url()}/v2/models/{name}/infer", infer_body(1)) == 200,
        60,
        "the model to be back",
        interval=0.5,
    )
    send(instance, name, ok=3, failing=2)  # plus the one probe above that succeeded
    scrape_instance(instance)
    after = totals(version)
    assert (after["success"], after["failure"]) == (7 + 4, 3 + 2)
    assert ModelMetrics.objects.filter(version=version, success__lt=0).count() == 0
    state = ScrapeState.objects.get(instance=instance)
    assert state.server_id == str(instance.pid) and state.consecutive_failures == 0
    assert InstanceMetrics.objects.filter(instance=instance).aggregate(n=Sum("scrapes"))["n"] == 4

    # An unreachable instance is a counted failure, not an exception.
    agent.stop()
    instance.refresh_from_db()
    assert scrape_instance(instance) == 0
    state.refresh_from_db()
    assert state.consecutive_failures == 1 and state.total_failures == 1 and state.last_error
    assert totals(version) == after
