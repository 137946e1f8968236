"""The seed's ensemble through the platform, against a real host agent, tritonserver and HAProxy: its three
steps converted and deployed, the ensemble directory uploaded and deployed on the same instance, called
through the gateway with a raw uint8 image - the moment the API says SERVING - answering top-5 equal to calling
the three steps in turn."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from apps.registry.models import VersionState
from apps.teams import services as teams
from tests.deployments.ensemble_live import BUILDERS, converted_step, infer
from tests.registry.ensemble_builders import ensemble_model, seed_ensemble_dir, tar_of
from tests.registry.uploads import upload
from tests.support.servers import deploy, poll_api_until_serving, ready_instance

pytestmark = [
    pytest.mark.triton,
    pytest.mark.servers,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed"),
]


def test_seed_ensemble_uploaded_deployed_and_called_through_the_gateway(
    owner, team, other_team, outsider, owner_client, start_agent, start_gateway, make_token, tmp_path
):
    agent, instance = ready_instance(start_agent, "host-a")
    for slug in BUILDERS:
        converted_step(owner, team, slug, tmp_path)
        deploy(owner_client, "vision", slug, 1, [instance])
    ensemble_model(owner, team)
    uploaded = upload(owner_client, "ensemble.tar.gz", tar_of(seed_ensemble_dir(tmp_path)), model="classify")
    assert uploaded.status_code == 200, uploaded.json()
    assert uploaded.json()["state"] == VersionState.READY
    _, token = make_token(name="ensemble")
    _, foreign = teams.create_token(actor=outsider, team=other_team, name="foreign")
    gateway = start_gateway()

    # SERVING means callable: the ensemble called the moment the API says SERVING answers the first time.
    response = owner_client.post(
        "/api/v1/teams/vision/deployments/",
        {"model": "classify", "version": 1, "instances": [instance.pk]},
        format="json",
    )
    assert response.status_code == 201, response.json()
    poll_api_until_serving(owner_client, "vision", response.json()["id"], 1)
    image = np.random.default_rng(26).integers(0, 256, (1, 224, 224, 3), dtype=np.uint8)
    answer = infer(gateway, "vision__classify", token, "raw_image", image, "UINT8")
    assert answer["predictions"].shape == (1, 5) and answer["scores"].shape == (1, 5)

    # The same image through the three steps in turn, each called through the gateway.
    pre = infer(gateway, "vision__preprocess", token, "input", image, "UINT8")["output"]
    logits = infer(gateway, "vision__resnet50", token, "input", pre.astype(np.float32), "FP32")["output"]
    top = infer(gateway, "vision__postprocess", token, "input", logits.astype(np.float32), "FP32")
    np.testing.assert_array_equal(answer["predictions"], top["output"])
    np.testing.assert_allclose(answer["scores"], top["scores"], rtol=1e-4, atol=1e-6)

    # Another team's token does not reach the ensemble.
    status, _ = gateway.request("POST", "/v2/models/vision__classify/infer", foreign, b"{}")
    assert status == 404, gateway.output()
