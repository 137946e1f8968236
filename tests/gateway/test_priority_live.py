"""Priority classes through the real gateway into a real tritonserver: a version whose config defines two
priority levels, where level 2 requests time out in Triton's queue (REJECT after 1 ms) while the batcher waits
200 ms for a fuller batch. A batch-class token's request is level 2 there, so it is rejected; an interactive
token's is level 1 and served - the difference is Triton's scheduler reading the `priority` parameter the
gateway wrote. The per-model figures count requests by class."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import text_format
from tritonclient.utils import InferenceServerException

from apps.gateway.metrics import scrape_gateway
from apps.gateway.models import GatewayMetrics
from apps.registry.models import RegisteredModel
from apps.teams import services as team_services
from backend_ge.config import parse_config
from tests.conftest import wait_for
from tests.gateway.test_client_errors_live import post
from tests.support.models import INFER_BODY
from tests.support.servers import deploy, ready_instance, requires_haproxy

pytestmark = [pytest.mark.triton, requires_haproxy, pytest.mark.django_db(transaction=True)]

SCALER = "vision__scaler"


def with_priority_levels(version) -> None:
    """Two levels; level 2 (the lowest) is rejected after 1 ms in the queue, which a lone request spends
    waiting for the batcher's 200 ms delay; requests naming no level are level 1."""
    cfg = parse_config(version.config_text)
    batching = cfg.dynamic_batching
    del batching.preferred_batch_size[:]
    batching.preferred_batch_size.append(8)
    batching.max_queue_delay_microseconds = 200_000
    batching.priority_levels = 2
    batching.default_priority_level = 1
    policy = batching.priority_queue_policy[2]
    policy.timeout_action = policy.REJECT
    policy.default_timeout_microseconds = 1000
    text = text_format.MessageToString(cfg)
    (version.servable_dir() / "config.pbtxt").write_text(text)
    version.config_text = text
    version.save(update_fields=["config_text"])


@pytest.fixture
def prioritised(start_agent, team, owner, owner_client, make_scaler_version):
    _, instance = ready_instance(start_agent, "priority-a")
    scaler = RegisteredModel.objects.create(team=team, name="Scaler", slug="scaler", created_by=owner)
    with_priority_levels(make_scaler_version(scaler, 2.0))
    return deploy(owner_client, "vision", "scaler", 1, [instance])


def test_the_callers_class_is_tritons_priority_level(
    prioritised, start_gateway, gateway_env, settings, owner, team
):
    settings.GATEWAY_METRICS_URL = f"http://{gateway_env['GATEWAY_STATS_BIND']}/metrics"
    gateway = start_gateway()
    _, interactive = team_services.create_token(actor=owner, team=team, name="app")
    _, batch = team_services.create_token(actor=owner, team=team, name="nightly", priority_class="batch")
    path = f"/v2/models/{SCALER}/infer"
    wait_for(lambda: post(gateway.url, path, INFER_BODY, {}, interactive)[0] == 200, 30, "the scaler routed")
    scrape_gateway()  # the baseline
    GatewayMetrics.objects.all().delete()

    status, _, text = post(gateway.url, path, INFER_BODY, {}, interactive)
    assert status == 200 and json.loads(text)["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]
    # The caller's own parameters stay; its own "priority" does not override its class.
    sneaky = json.dumps(
        {**json.loads(INFER_BODY), "parameters": {"priority": 1, "binary_data_output": False}}
    )
    for body in (INFER_BODY, sneaky.encode()):
        status, _, text = post(gateway.url, path, body, {}, batch)
        assert status != 200, text
        assert "timeout" in text.lower(), text

    # A binary request (tritonclient) through the gateway: the level goes into its JSON header.
    client = httpclient.InferenceServerClient(gateway.url.removeprefix("http://"))
    data = np.arange(8, dtype=np.float32).reshape(2, 4)
    tensor = httpclient.InferInput("input", [2, 4], "FP32")
    tensor.set_data_from_numpy(data, binary_data=True)
    answer = client.infer(SCALER, [tensor], headers={"authorization": f"Bearer {interactive}"})
    assert answer.as_numpy("output").tolist() == (data * 2).tolist()
    with pytest.raises(Exception, match="(?i)timeout"):
        client.infer(SCALER, [tensor], headers={"authorization": f"Bearer {batch}"})
    client.close()

    # gRPC: the gateway appends the level to the message, after any "priority" the caller sent.
    grpc = grpcclient.InferenceServerClient(gateway.grpc_url)
    item = grpcclient.InferInput("input", [2, 4], "FP32")
    item.set_data_from_numpy(data)
    answer = grpc.infer(SCALER, [item], headers={"authorization": f"Bearer {interactive}"}, client_timeout=30)
    assert answer.as_numpy("output").tolist() == (data * 2).tolist()
    for own, version in ((0, ""), (1, ""), (1, "1")):  # tritonclient sends priority=1 as the parameter
        with pytest.raises(InferenceServerException, match="(?i)timeout"):
            grpc.infer(SCALER, [item], model_version=version, priority=own,
                       headers={"authorization": f"Bearer {batch}"}, client_timeout=30)  # fmt: skip
    grpc.close()

    scrape_gateway()
    rows = GatewayMetrics.objects.filter(deployment=prioritised)
    assert sum(r.requests_interactive for r in rows) == 3
    assert sum(r.requests_batch for r in rows) == 6
