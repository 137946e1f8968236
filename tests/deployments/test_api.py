"""Deployments API without a running agent: tenancy, roles, validation, quotas, snippets."""

from __future__ import annotations

import pytest

from apps.deployments import services
from apps.deployments.models import Deployment, DeploymentState, PlacementState
from apps.fleet.models import Host
from apps.registry.models import VersionState
from apps.teams.models import Role
from tests.conftest import bearer_client, client_for
from tests.factories import MembershipFactory, UserFactory
from tests.support.models import add_instance, make_version

pytestmark = pytest.mark.django_db

BASE = "/api/v1/teams/vision/deployments/"


@pytest.fixture
def deployment(owner, version, instance):
    return services.deploy_version(actor=owner, model=version.model, version=version, instances=[instance])


def deploy(client, version=1, instances=None, model="classifier"):
    return client.post(BASE, {"model": model, "version": version, "instances": instances}, format="json")


def test_maintainer_deploys_and_sees_placements_and_events(maintainer_client, version, instance):
    response = deploy(maintainer_client, instances=[instance.pk])
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["state"] == "DEPLOYING" and body["target_version"] == 1 and body["active_version"] is None
    assert body["triton_model_name"] == "vision__classifier"
    # Clients call the gateway; an instance would answer them 403, so its address is for staff only.
    assert body["endpoints"] == {
        "http": "http://127.0.0.1:8080",
        "grpc": "127.0.0.1:8081",
        "infer_url": "http://127.0.0.1:8080/v2/models/vision__classifier/infer",
    }
    assert body["instance_endpoints"] is None
    assert body["placements"][0] | {"updated_at": None} == {
        "instance": instance.pk,
        "instance_name": "local/cpu-0",
        "instance_state": "READY",
        "endpoint": None,
        "served_version": None,
        "canary_version": None,
        "state": "PENDING",
        "last_error": "",
        "retiring_reason": "",
        "updated_at": None,
    }
    assert [e["kind"] for e in body["events"]] == ["deploy_requested"]
    listed = maintainer_client.get(BASE).json()
    assert [d["id"] for d in listed["results"]] == [body["id"]]


def test_endpoints_follow_the_gateways_public_addresses(viewer_client, deployment, settings):
    settings.GATEWAY_PUBLIC_URL = "https://infer.example.com/"
    settings.GATEWAY_PUBLIC_GRPC = "grpc.example.com:443"
    body = viewer_client.get(f"{BASE}{deployment.pk}/").json()
    assert body["endpoints"] == {
        "http": "https://infer.example.com",
        "grpc": "grpc.example.com:443",
        "infer_url": "https://infer.example.com/v2/models/vision__classifier/infer",
    }
    listed = viewer_client.get(BASE).json()["results"][0]
    assert listed["endpoints"] == body["endpoints"] and listed["instance_endpoints"] is None


def test_platform_staff_also_see_the_instance_addresses(team, deployment, shared_host, make_token):
    second = add_instance(shared_host, "cpu-1", 18200)
    deployment.placements.create(instance=second, state=PlacementState.READY)
    ops = UserFactory(username="ops", is_staff=True)
    MembershipFactory(team=team, user=ops, role=Role.VIEWER)
    body = client_for(ops).get(f"{BASE}{deployment.pk}/").json()
    assert body["endpoints"]["http"] == "http://127.0.0.1:8080"
    assert body["instance_endpoints"] == ["http://127.0.0.1:18200", "http://127.0.0.1:18100"]  # READY first
    assert sorted(p["endpoint"] for p in body["placements"]) == [
        "http://127.0.0.1:18100",
        "http://127.0.0.1:18200",
    ]
    # A token acts for its team only, never with its creator's platform powers.
    _, secret = make_token(user=ops)
    by_token = bearer_client(secret).get(f"{BASE}{deployment.pk}/").json()
    assert by_token["instance_endpoints"] is None and {p["endpoint"] for p in by_token["placements"]} == {
        None
    }


def test_an_undeployed_deployment_has_no_endpoints(owner_client, deployment):
    Deployment.objects.filter(pk=deployment.pk).update(state=DeploymentState.UNDEPLOYED)
    assert owner_client.get(f"{BASE}{deployment.pk}/").json()["endpoints"] is None


def test_viewer_reads_but_cannot_deploy_switch_or_undeploy(viewer_client, deployment, model, instance):
    assert viewer_client.get(f"{BASE}{deployment.pk}/").status_code == 200
    make_version(model, 2)
    for response in (
        deploy(viewer_client, instances=[instance.pk]),
        viewer_client.post(f"{BASE}{deployment.pk}/switch/", {"version": 2}, format="json"),
        viewer_client.post(f"{BASE}{deployment.pk}/undeploy/"),
    ):
        assert response.status_code == 403
        assert "you need the role maintainer" in response.json()["message"]
    assert Deployment.objects.get(pk=deployment.pk).state == DeploymentState.DEPLOYING


def test_outsider_gets_404_for_list_detail_snippets_and_playground(outsider_client, deployment):
    for response in (
        outsider_client.get(BASE),
        outsider_client.get(f"{BASE}{deployment.pk}/"),
        outsider_client.get(f"{BASE}{deployment.pk}/snippets/"),
        outsider_client.post(f"{BASE}{deployment.pk}/playground/", {}, format="json"),
        outsider_client.post(f"{BASE}{deployment.pk}/undeploy/"),
    ):
        assert response.status_code == 404
        assert response.json()["error"] == "not_found"


def test_another_teams_deployment_is_404_even_under_the_outsiders_own_team(outsider_client, deployment):
    assert outsider_client.get(f"/api/v1/teams/speech/deployments/{deployment.pk}/").status_code == 404


def test_quota_of_deployed_models_exceeded_is_400_with_the_message(
    owner_client, team, owner, version, instance
):
    team.quota_deployed_models = 1
    team.save()
    services.deploy_version(actor=owner, model=version.model, version=version, instances=[instance])
    other = version.model.__class__.objects.create(team=team, name="Second", slug="second")
    make_version(other, 1)
    response = deploy(owner_client, model="second", instances=[instance.pk])
    assert response.status_code == 400
    body = response.json()
    assert body["error"] == "invalid"
    assert body["message"] == "Team quota exceeded: Vision may deploy 1 models at once; undeploy one first."


def test_quota_of_instances_exceeded_is_400_on_the_instances_field(owner_client, team, version, shared_host):
    team.quota_instances = 1
    team.save()
    first, second = add_instance(shared_host, "cpu-0", 18100), add_instance(shared_host, "cpu-1", 18110)
    response = deploy(owner_client, instances=[first.pk, second.pk])
    assert response.status_code == 400
    assert (
        "Team quota exceeded: Vision may use 1 instances; this would use 2."
        in response.json()["fields"]["instances"]
    )


def test_a_version_that_is_not_ready_is_400(owner_client, model, instance):
    make_version(model, 1, state=VersionState.CONVERTING)
    response = deploy(owner_client, instances=[instance.pk])
    assert response.status_code == 400
    assert "only READY versions can be deployed" in response.json()["fields"]["version"][0]


def test_a_model_already_deployed_is_400(owner_client, deployment, instance):
    response = deploy(owner_client, instances=[instance.pk])
    assert response.status_code == 400
    assert "already deployed" in response.json()["fields"]["model"][0]


def test_validation_errors_name_their_fields(owner_client, version, instance, other_team):
    assert deploy(owner_client, model="nope", instances=[instance.pk]).json()["fields"] == {
        "model": ["Team vision has no model 'nope'."]
    }
    assert deploy(owner_client, version=7, instances=[instance.pk]).json()["fields"] == {
        "version": ["Classifier has no version 7."]
    }
    empty = deploy(owner_client, instances=[])
    assert empty.status_code == 400 and "instances" in empty.json()["fields"]
    # An instance on a host dedicated to another team is invisible: the same answer as a missing id.
    foreign = add_instance(Host.objects.create(name="speech-npu", address="10.0.0.9", team=other_team))
    response = deploy(owner_client, instances=[foreign.pk])
    assert response.status_code == 400
    assert response.json()["fields"]["instances"] == [
        f"No instance with id {foreign.pk} that this team may deploy on."
    ]


def test_switch_needs_a_serving_deployment_and_another_version(
    owner_client, deployment, model, version, instance
):
    make_version(model, 2)
    busy = owner_client.post(f"{BASE}{deployment.pk}/switch/", {"version": 2}, format="json")
    assert busy.status_code == 400 and "wait until it is SERVING" in busy.json()["message"]
    deployment.placements.update(state=PlacementState.READY, served_version=version)
    services.placement_finished(deployment.placements.get())
    same = owner_client.post(f"{BASE}{deployment.pk}/switch/", {"version": 1}, format="json")
    assert same.status_code == 400 and "already the served version" in same.json()["message"]
    ok = owner_client.post(f"{BASE}{deployment.pk}/switch/", {"version": 2}, format="json")
    assert ok.status_code == 200
    assert ok.json()["state"] == "SWITCHING" and ok.json()["target_version"] == 2
    assert ok.json()["active_version"] == 1


def test_undeploy(owner_client, deployment):
    response = owner_client.post(f"{BASE}{deployment.pk}/undeploy/")
    assert response.status_code == 200 and response.json()["state"] == "UNDEPLOYING"
    assert response.json()["events"][0]["kind"] == "undeploy_requested"


def test_snippets_describe_the_model_for_viewers(viewer_client, deployment):
    body = viewer_client.get(f"{BASE}{deployment.pk}/snippets/").json()
    # Everything a user copies points at the gateway (GATEWAY_PUBLIC_URL) with a token header.
    assert body["endpoint"] == "http://127.0.0.1:8080" and body["grpc_endpoint"] == "127.0.0.1:8081"
    assert body["triton_model_name"] == "vision__classifier" and body["version"] == 1
    assert body["infer_url"] == "http://127.0.0.1:8080/v2/models/vision__classifier/infer"
    call = 'client.infer(model_name="vision__classifier", inputs=inputs, outputs=outputs, headers=headers)'
    assert call in body["tritonclient"]
    assert 'InferenceServerClient(url="127.0.0.1:8080")' in body["tritonclient"]
    assert 'headers = {"Authorization": "Bearer " + os.environ["TGP_TOKEN"]}' in body["tritonclient"]
    # The gRPC script: the gateway's gRPC address, metadata key in lower case (tritonclient.grpc's rule).
    grpc_script = body["tritonclient_grpc"]
    assert "import tritonclient.grpc as grpcclient" in grpc_script
    assert 'grpcclient.InferenceServerClient(url="127.0.0.1:8081")' in grpc_script
    assert 'headers = {"authorization": "Bearer " + os.environ["TGP_TOKEN"]}' in grpc_script
    assert call in grpc_script
    compile(grpc_script, "snippet", "exec")
    assert "curl -X POST http://127.0.0.1:8080/v2/models/vision__classifier/infer" in body["curl"]
    assert '-H "Authorization: Bearer $TGP_TOKEN"' in body["curl"]


def test_snippets_of_an_undeployed_deployment_are_400(owner_client, deployment):
    Deployment.objects.filter(pk=deployment.pk).update(state=DeploymentState.UNDEPLOYED)
    response = owner_client.get(f"{BASE}{deployment.pk}/snippets/")
    assert response.status_code == 400
    assert response.json()["message"] == "This deployment was undeployed; there is nothing to call."


def test_playground_without_a_ready_instance_is_409(viewer_client, deployment):
    response = viewer_client.post(f"{BASE}{deployment.pk}/playground/", {}, format="json")
    assert response.status_code == 409
    assert response.json()["error"] == "not_serving"
    assert "no READY instance yet" in response.json()["message"]


def test_playground_rejects_unknown_inputs_and_bad_json(viewer_client, deployment, version):
    deployment.placements.update(state=PlacementState.READY, served_version=version)
    url = f"{BASE}{deployment.pk}/playground/"
    unknown = viewer_client.post(url, {"inputs": {"image": {"mode": "random"}}}, format="json")
    assert unknown.status_code == 400
    assert unknown.json()["fields"]["inputs"] == ["The model has no input 'image'; its inputs: input."]
    wrong = viewer_client.post(url, {"inputs": {"input": {"mode": "json", "data": [1, 2, 3]}}}, format="json")
    assert wrong.status_code == 400
    assert "needs shape [-1, 3, 224, 224]" in wrong.json()["fields"]["inputs.input"][0]
    mode = viewer_client.post(url, {"inputs": {"input": {"mode": "magic"}}}, format="json")
    assert mode.json()["fields"]["inputs.input"] == ["'magic' is not an input mode; use random, json, file."]
