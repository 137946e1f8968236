"""Agents on other machines: the artifact endpoints, and an agent whose ARTIFACT_ROOT lacks the version's
files downloading them from the platform (sha256-verified) - or failing readably with a wrong key."""

from __future__ import annotations

import hashlib

import pytest

from apps.deployments import services
from apps.deployments.models import Deployment, DeploymentState, PlacementState
from apps.fleet.models import InstanceState, TritonInstance
from tests.conftest import wait_for
from tests.fleet.test_agent import seed_example_3

KEY = "agent-secret-for-tests"


@pytest.fixture
def agent_key(settings):
    settings.AGENT_KEY = KEY
    return KEY


@pytest.mark.django_db
def test_artifact_endpoints_need_the_key_and_stay_inside_the_version(client, agent_key, make_ready_version):
    version = make_ready_version()
    base = f"/api/v1/agent/versions/{version.pk}"
    refused = client.get(f"{base}/manifest", HTTP_X_AGENT_KEY="wrong")
    assert refused.status_code == 403
    assert refused.json()["message"] == (
        "Wrong or missing X-Agent-Key: the agent's AGENT_KEY must equal the platform's."
    )
    assert client.get(f"{base}/manifest").status_code == 403
    manifest = client.get(f"{base}/manifest", HTTP_X_AGENT_KEY=KEY).json()
    paths = {entry["path"]: entry["sha256"] for entry in manifest["files"]}
    assert set(paths) == {"config.pbtxt", "1/model.onnx"}
    body = b"".join(client.get(f"{base}/files/1/model.onnx", HTTP_X_AGENT_KEY=KEY).streaming_content)
    assert hashlib.sha256(body).hexdigest() == paths["1/model.onnx"]
    assert client.get(f"{base}/files/../../source/x", HTTP_X_AGENT_KEY=KEY).status_code == 404


@pytest.mark.django_db
def test_without_a_platform_key_the_agent_endpoints_do_not_exist(client, settings, make_ready_version):
    settings.AGENT_KEY = ""
    version = make_ready_version()
    assert client.get(f"/api/v1/agent/versions/{version.pk}/manifest", HTTP_X_AGENT_KEY="").status_code == 404


def remote_agent(start_agent, live_server, tmp_path, key: str):
    empty = tmp_path / "remote-artifacts"
    empty.mkdir()
    agent = start_agent("remote", ARTIFACT_ROOT=empty, PLATFORM_URL=live_server.url, AGENT_KEY=key)
    instance = wait_for(
        lambda: TritonInstance.objects.filter(host__name="remote", state=InstanceState.READY).first(),
        120,
        f"the remote instance to be READY\n{agent.output()}",
    )
    return agent, instance, empty


def settled(deployment: Deployment, timeout: float = 120) -> Deployment:
    return wait_for(
        lambda: Deployment.objects.filter(
            pk=deployment.pk, state__in=[DeploymentState.SERVING, DeploymentState.FAILED]
        ).first(),
        timeout,
        "the deployment to settle",
    )


@pytest.mark.triton
@pytest.mark.django_db(transaction=True)
def test_a_remote_agent_downloads_the_version_and_serves_it(
    start_agent, make_ready_version, owner, live_server, agent_key, tmp_path, artifact_root
):
    version = make_ready_version()
    agent, instance, empty = remote_agent(start_agent, live_server, tmp_path, KEY)
    deployment = settled(
        services.deploy_version(actor=owner, model=version.model, version=version, instances=[instance])
    )
    assert deployment.state == DeploymentState.SERVING, f"{deployment.last_error}\n{agent.output()}"
    assert list(empty.iterdir()) == []  # nothing came from the (absent) shared artifact store
    cached = artifact_root.parent / "fleet" / "cache" / str(version.pk)
    original = version.servable_dir() / "1" / "model.onnx"
    assert (cached / "1" / "model.onnx").read_bytes() == original.read_bytes()
    seed_example_3(agent.url, version.model.triton_model_name())


@pytest.mark.triton
@pytest.mark.django_db(transaction=True)
def test_a_wrong_agent_key_fails_the_placement_with_a_readable_error(
    start_agent, make_ready_version, owner, live_server, agent_key, tmp_path
):
    version = make_ready_version()
    agent, instance, _ = remote_agent(start_agent, live_server, tmp_path, "not-the-key")
    deployment = settled(
        services.deploy_version(actor=owner, model=version.model, version=version, instances=[instance])
    )
    assert deployment.state == DeploymentState.FAILED
    placement = deployment.placements.get()
    assert placement.state == PlacementState.FAILED
    assert placement.last_error == (
        f"{version}: the platform at {live_server.url} refused the manifest request (HTTP 403): "
        "Wrong or missing X-Agent-Key: the agent's AGENT_KEY must equal the platform's."
    )
    assert placement.last_error in deployment.last_error


@pytest.mark.django_db(transaction=True)
def test_a_download_that_does_not_match_its_sha256_is_discarded(
    live_server, agent_key, settings, make_ready_version, monkeypatch, tmp_path
):
    from apps.fleet import agent_api
    from apps.fleet.artifacts import ArtifactDownloadError, download_servable

    version = make_ready_version()
    real = agent_api.file_manifest

    def tampered(root):
        return [
            entry | {"sha256": "0" * 64} if entry["path"] == "1/model.onnx" else entry for entry in real(root)
        ]

    monkeypatch.setattr(agent_api, "file_manifest", tampered)  # the live server runs in this process
    settings.PLATFORM_URL = live_server.url
    cache = tmp_path / "cache"
    with pytest.raises(
        ArtifactDownloadError, match=r"1/model.onnx does not match its sha256; download discarded"
    ):
        download_servable(version, cache)
    assert not (cache / str(version.pk)).exists()
    assert [p.name for p in cache.iterdir()] == []  # the temp dir is gone too
