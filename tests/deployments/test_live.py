"""Against a real host agent and tritonserver: the generated curl command and tritonclient script run as a
user would run them, and the playground answers with outputs, top-5 and latency."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from apps.deployments.models import Deployment, DeploymentState
from apps.fleet.models import InstanceState, TritonInstance
from tests.conftest import wait_for
from tests.support.models import expected_output

pytestmark = [pytest.mark.triton, pytest.mark.django_db(transaction=True)]


def serving_deployment(client, start_agent, make_ready_version) -> tuple[Deployment, object]:
    """One agent with one CPU instance, and the seed-3 classifier deployed on it through the API."""
    agent = start_agent("host-a")
    instance = wait_for(
        lambda: TritonInstance.objects.filter(host__name="host-a", state=InstanceState.READY).first(),
        120,
        f"the agent's instance to be READY\n{agent.output()}",
    )
    make_ready_version()
    response = client.post(
        "/api/v1/teams/vision/deployments/",
        {"model": "classifier", "version": 1, "instances": [instance.pk]},
        format="json",
    )
    assert response.status_code == 201, response.json()
    deployment = wait_for(
        lambda: Deployment.objects.filter(pk=response.json()["id"], state=DeploymentState.SERVING).first(),
        120,
        f"the deployment to be SERVING\n{agent.output()}",
    )
    return deployment, agent


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed")
def test_generated_curl_and_tritonclient_snippets_work(
    owner_client, start_agent, make_ready_version, tmp_path, start_gateway, make_token, settings
):
    deployment, agent = serving_deployment(owner_client, start_agent, make_ready_version)
    gateway = start_gateway()
    settings.GATEWAY_PUBLIC_URL = f"http://{gateway.url}"
    _, token = make_token(name="snippets")
    wait_for(lambda: gateway.get("/v2/models/vision__classifier/ready", token)[0] == 200, 10, "the route")
    snippets = owner_client.get(f"/api/v1/teams/vision/deployments/{deployment.pk}/snippets/").json()
    assert snippets["endpoint"] == f"http://{gateway.url}"
    env = {**os.environ, "TGP_TOKEN": token}

    script = subprocess.run(
        [sys.executable, "-c", snippets["tritonclient"]], capture_output=True, text=True, timeout=60, env=env
    )
    assert script.returncode == 0, script.stderr
    assert "Server ready: True" in script.stdout and "Model ready: True" in script.stdout
    assert "output: (1, 1000)" in script.stdout

    # The input has 150,528 values, so the command writes body.json first; run it as written.
    curl = subprocess.run(
        ["bash", "-c", snippets["curl"] + " --silent --show-error --fail"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert curl.returncode == 0, curl.stderr
    answer = json.loads(curl.stdout)
    assert answer["model_name"] == "vision__classifier" and answer["model_version"] == "1"
    output = answer["outputs"][0]
    assert output["name"] == "output" and output["shape"] == [1, 1000]
    expected = expected_output(1.0, np.full((1, 3, 224, 224), 0.5, dtype=np.float32))
    np.testing.assert_allclose(np.array(output["data"]).reshape(1, 1000), expected, rtol=1e-4)


def test_playground_random_json_and_npy_inputs_with_top5_and_latency(
    owner_client, viewer_client, start_agent, make_ready_version
):
    deployment, agent = serving_deployment(owner_client, start_agent, make_ready_version)
    url = f"/api/v1/teams/vision/deployments/{deployment.pk}/playground/"

    # Random data; viewers may run it.
    random = viewer_client.post(url, {}, format="json")
    assert random.status_code == 200, random.json()
    body = random.json()
    assert body["instance"] == "host-a/cpu-0" and body["version"] == 1 and body["latency_ms"] > 0
    assert body["inputs"] == [
        {"name": "input", "mode": "random", "shape": [1, 3, 224, 224], "datatype": "FP32"}
    ]
    (output,) = body["outputs"]
    assert output["shape"] == [1, 1000] and len(output["data"]) == 1000
    scores = np.array(output["data"])
    assert [t["index"] for t in output["top5"]] == np.argsort(scores)[::-1][:5].tolist()

    # JSON values without the batch dimension: the result is exactly the model's.
    image = np.random.default_rng(7).random((3, 224, 224), dtype=np.float32)
    image[2] *= 3  # make the classes depend on the input
    exact = owner_client.post(
        url, {"inputs": {"input": {"mode": "json", "data": image.tolist()}}}, format="json"
    ).json()
    expected = expected_output(1.0, image[np.newaxis])[0]
    np.testing.assert_allclose(exact["outputs"][0]["data"], expected, rtol=1e-4)
    assert [t["index"] for t in exact["outputs"][0]["top5"]] == np.argsort(expected)[::-1][:5].tolist()
    assert exact["outputs"][0]["top5"][0]["score"] == pytest.approx(float(expected.max()), rel=1e-4)

    # A .npy upload in a multipart request.
    buffer = io.BytesIO()
    np.save(buffer, image[np.newaxis])
    buffer.seek(0)
    buffer.name = "image.npy"
    uploaded = owner_client.post(url, {"input": buffer}, format="multipart").json()
    assert uploaded["inputs"][0]["mode"] == "file"
    np.testing.assert_allclose(uploaded["outputs"][0]["data"], expected, rtol=1e-4)
