"""Deployment pages without an agent: empty state, deploy form, detail with snippets and playground form,
switch/undeploy, roles and tenancy."""

from __future__ import annotations

import pytest

from apps.deployments import services
from apps.deployments.models import Deployment, DeploymentState, PlacementState
from apps.teams.models import Role
from tests.factories import MembershipFactory, UserFactory
from tests.support.models import make_version

pytestmark = pytest.mark.django_db


@pytest.fixture
def web(client, owner):
    client.force_login(owner)
    return client


@pytest.fixture
def viewer_web(client, viewer):
    client.force_login(viewer)
    return client


@pytest.fixture
def serving(owner, version, instance):
    deployment = services.deploy_version(
        actor=owner, model=version.model, version=version, instances=[instance]
    )
    deployment.placements.update(state=PlacementState.READY, served_version=version)
    services.placement_finished(deployment.placements.get())
    return Deployment.objects.get(pk=deployment.pk)


def test_empty_list_offers_to_deploy_and_nav_has_deployments_and_hosts(web, team):
    html = web.get("/teams/vision/deployments/").content.decode()
    assert "No deployments yet" in html and 'id="deploy-first"' in html
    assert '<a href="/teams/vision/deployments/" aria-current="page">Deployments</a>' in html
    assert '<a href="/hosts/" >Hosts</a>' in html


def test_deploy_form_lists_ready_versions_and_usable_instances_and_deploys(web, model, version, instance):
    make_version(model, 2, state="CONVERTING")
    html = web.get("/teams/vision/deployments/new/").content.decode()
    assert '<option value="1"' in html and '<option value="2"' not in html  # only READY versions
    assert f'name="instances" value="{instance.pk}" checked' in html  # the one instance is preselected
    response = web.post(
        "/teams/vision/deployments/new/", {"model": "classifier", "version": 1, "instances": [instance.pk]}
    )
    deployment = Deployment.objects.get()
    assert (
        response.status_code == 302 and response["Location"] == f"/teams/vision/deployments/{deployment.pk}/"
    )
    assert deployment.state == DeploymentState.DEPLOYING


def test_deploy_form_shows_service_errors(web, team, owner, version, instance):
    services.deploy_version(actor=owner, model=version.model, version=version, instances=[instance])
    response = web.post(
        "/teams/vision/deployments/new/", {"model": "classifier", "version": 1, "instances": [instance.pk]}
    )
    assert response.status_code == 400
    assert "already deployed; switch its version or undeploy it first" in response.content.decode()
    missing = web.post("/teams/vision/deployments/new/", {"model": "classifier", "version": 1})
    assert "Pick at least one instance to deploy on." in missing.content.decode()


def test_model_detail_links_ready_versions_to_the_deploy_form(web, model, version):
    make_version(model, 2, state="FAILED")
    html = web.get("/teams/vision/models/classifier/").content.decode()
    assert html.count('class="deploy-link"') == 1
    assert 'href="/teams/vision/deployments/new/?model=classifier&amp;version=1"' in html


def test_viewer_sees_the_deployment_but_cannot_deploy_switch_or_undeploy(viewer_web, serving, model):
    make_version(model, 2)
    html = viewer_web.get(f"/teams/vision/deployments/{serving.pk}/").content.decode()
    assert 'id="switch-form"' not in html and 'id="undeploy"' not in html
    assert 'id="playground-form"' in html  # reading includes the playground
    assert viewer_web.get("/teams/vision/deployments/new/").status_code == 403
    assert viewer_web.post(f"/teams/vision/deployments/{serving.pk}/", {"op": "undeploy"}).status_code == 403
    assert Deployment.objects.get(pk=serving.pk).state == DeploymentState.SERVING


def test_outsider_gets_404_for_deployment_pages(client, outsider, serving):
    client.force_login(outsider)
    for url in (
        "/teams/vision/deployments/",
        f"/teams/vision/deployments/{serving.pk}/",
        f"/teams/vision/deployments/{serving.pk}/status/",
    ):
        assert client.get(url).status_code == 404
    assert client.post(f"/teams/vision/deployments/{serving.pk}/playground/").status_code == 404


def test_detail_shows_how_to_call_it_and_a_playground_form_from_the_signature(web, serving):
    html = web.get(f"/teams/vision/deployments/{serving.pk}/").content.decode()
    assert '<code id="triton-model-name">vision__classifier</code>' in html
    assert '<code id="endpoint">http://127.0.0.1:8080</code>' in html  # the gateway, never an instance
    assert '<code id="grpc-endpoint">127.0.0.1:8081</code>' in html
    assert "http://127.0.0.1:18100" not in html  # an instance's address is for staff
    assert "client.infer(model_name=&quot;vision__classifier&quot;" in html
    assert "curl -X POST http://127.0.0.1:8080/v2/models/vision__classifier/infer" in html
    assert "Authorization: Bearer $TGP_TOKEN" in html
    assert 'data-copy="snippet-python"' in html and 'data-copy="snippet-curl"' in html
    assert 'data-input="input"' in html and "File (.npy or image)" in html  # [3,224,224] is image-shaped
    # Settled: the status partial does not poll.
    assert (
        'data-state="SERVING"' in html
        and "hx-trigger" not in html.split('id="deployment-status"')[1].split(">")[0]
    )


def test_status_partial_polls_while_switching_and_stops_when_settled(web, owner, serving, model, version):
    v2 = make_version(model, 2)
    web.post(f"/teams/vision/deployments/{serving.pk}/", {"op": "switch", "version": 2})
    partial = web.get(f"/teams/vision/deployments/{serving.pk}/status/").content.decode()
    assert 'data-state="SWITCHING"' in partial and 'hx-trigger="load delay:0.5s, every 2s"' in partial
    assert '<strong id="target-version">v2</strong>' in partial
    placement = serving.placements.get()
    placement.__class__.objects.filter(pk=placement.pk).update(state=PlacementState.READY, served_version=v2)
    services.placement_finished(placement)
    partial = web.get(f"/teams/vision/deployments/{serving.pk}/status/").content.decode()
    assert 'data-state="SERVING"' in partial and "hx-trigger" not in partial
    assert '<strong id="active-version">v2</strong>' in partial and "switched" in partial


def test_undeploy_from_the_page(web, serving):
    response = web.post(f"/teams/vision/deployments/{serving.pk}/", {"op": "undeploy"})
    assert response.status_code == 302
    assert Deployment.objects.get(pk=serving.pk).state == DeploymentState.UNDEPLOYING


def test_playground_without_a_ready_instance_explains_why(web, owner, version, instance):
    deployment = services.deploy_version(
        actor=owner, model=version.model, version=version, instances=[instance]
    )
    response = web.post(f"/teams/vision/deployments/{deployment.pk}/playground/", HTTP_HX_REQUEST="true")
    assert response.status_code == 200  # htmx swaps only 2xx answers
    assert "has no READY instance yet" in response.content.decode()


def test_staff_see_each_placements_instance_address(client, team, serving):
    ops = UserFactory(username="ops", is_staff=True)
    MembershipFactory(team=team, user=ops, role=Role.VIEWER)
    client.force_login(ops)
    html = client.get(f"/teams/vision/deployments/{serving.pk}/status/").content.decode()
    assert '<small class="muted">http://127.0.0.1:18100</small>' in html
