"""tgp against a real host agent, tritonserver and the HAProxy gateway: a deploy waited for until SERVING, and
an inference through the gateway URL the platform reports."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from apps.fleet.models import InstanceState, TritonInstance
from tests.conftest import wait_for
from tests.support.models import expected_output

pytestmark = [pytest.mark.triton, pytest.mark.servers]


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed")
def test_deploy_waits_until_serving_and_infer_goes_through_the_gateway(
    tgp, signed_in, start_agent, start_gateway, make_ready_version, settings, tmp_path
):
    agent = start_agent("host-a")
    instance = wait_for(
        lambda: TritonInstance.objects.filter(host__name="host-a", state=InstanceState.READY).first(),
        120,
        f"the agent's instance to be READY\n{agent.output()}",
    )
    make_ready_version()
    gateway = start_gateway()
    settings.GATEWAY_PUBLIC_URL = f"http://{gateway.url}"

    deployed = tgp("deploy", "classifier", "--version", "1", "--instance", str(instance.pk), "--wait",
                   "--timeout", "120", "-o", "json")  # fmt: skip
    assert deployed.code == 0, f"{deployed.err}\n{agent.output()}"
    assert deployed.json()["state"] == "SERVING"
    assert deployed.json()["endpoints"]["infer_url"].startswith(f"http://{gateway.url}/")
    wait_for(lambda: gateway.get("/v2/models/vision__classifier/ready", signed_in)[0] == 200, 10, "the route")

    image = np.full((1, 3, 224, 224), 0.25, dtype=np.float32)
    body = tmp_path / "body.json"
    body.write_text(json.dumps({"inputs": [
        {"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32", "data": image.flatten().tolist()}
    ]}))  # fmt: skip
    answer = tgp("infer", "classifier", "--json", str(body), "-o", "json")
    assert answer.code == 0, answer.err
    (output,) = answer.json()["outputs"]
    assert output["shape"] == [1, 1000]
    np.testing.assert_allclose(
        np.array(output["data"]).reshape(1, 1000), expected_output(1.0, image), rtol=1e-4
    )
