"""Real tritonserver under a real host agent: the requests a version served since the last scrape are counted
when a switch or an undeploy unloads it, exactly once, with no scrape between the last request and the unload."""

from __future__ import annotations

import pytest

from apps.deployments import services
from apps.deployments.models import DeploymentState
from apps.monitoring.models import ModelMetrics, ScrapeState
from apps.monitoring.scraper import scrape_instance
from apps.registry.models import ModelVersion, SourceFormat, VersionState
from backend_ge.convert import prepare_onnx
from tests.conftest import wait_for
from tests.fleet.test_agent import deployment_settled, instance_of
from tests.monitoring.builders import reshaping_onnx
from tests.monitoring.test_live_scrape import send, totals

pytestmark = [pytest.mark.triton, pytest.mark.django_db(transaction=True)]


def next_version(model, owner, tmp_path) -> ModelVersion:
    number = model.versions.count() + 1
    version = ModelVersion.objects.create(
        model=model,
        number=number,
        state=VersionState.CONVERTING,
        source_format=SourceFormat.ONNX,
        created_by=owner,
    )
    source = tmp_path / f"reshaper-{number}.onnx"
    source.write_bytes(reshaping_onnx())
    prepared = prepare_onnx(
        source, version.servable_dir() / "1", name=model.triton_model_name(), max_batch_size=8
    )
    version.signature = prepared.signature.to_dict()
    version.config_text = (version.servable_dir() / "config.pbtxt").read_text()
    version.state = VersionState.READY
    version.toolchain = "onnx"
    version.save()
    return version


def test_counts_at_a_switch_and_an_undeploy_add_up_to_what_clients_sent(
    start_agent, make_reshaper_version, owner, tmp_path
):
    agent = start_agent("mon-fc")
    instance = instance_of(agent)
    v1 = make_reshaper_version()
    v2 = next_version(v1.model, owner, tmp_path)
    name = v1.model.triton_model_name()
    deployment = deployment_settled(
        services.deploy_version(actor=owner, model=v1.model, version=v1, instances=[instance])
    )
    assert deployment.state == DeploymentState.SERVING, deployment.last_error
    assert scrape_instance(instance) == 0  # the baseline, after the first deploy's smoke inference

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
