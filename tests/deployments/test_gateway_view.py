"""The gateway's half of SERVING (``GatewayView``): a deployment whose placements serve is reported SERVING
only once every gateway that reported lately routes its active version to a server in rotation."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.deployments import routing
from apps.deployments.models import Deployment, DeploymentState, GatewayRouting, GatewayView
from tests.support.models import add_instance, make_version, serving_rows

pytestmark = pytest.mark.django_db

BASE = "/api/v1/teams/vision/deployments/"


@pytest.fixture
def deployment(team, owner, shared_host) -> Deployment:
    return serving_rows(team, owner, "a", add_instance(shared_host, "cpu-0"))


def fresh(deployment: Deployment) -> Deployment:
    return Deployment.objects.get(pk=deployment.pk)


def test_without_a_gateway_the_placements_alone_decide(deployment):
    assert fresh(deployment).reported_state() == DeploymentState.SERVING
    assert fresh(deployment).waiting_for() == ""


def test_serving_waits_until_the_gateway_routes_the_active_version_with_a_server_in_rotation(
    deployment, owner_client
):
    routing.record_gateway_routes("gw-1 :8080", {})
    body = owner_client.get(f"{BASE}{deployment.pk}/").json()
    assert body["state"] == "DEPLOYING"
    assert body["waiting_for"] == "the gateway to route version 1 (its next sync)"

    routing.record_gateway_routes("gw-1 :8080", {deployment.pk: (1, 0)})
    body = owner_client.get(f"{BASE}{deployment.pk}/").json()
    assert (body["state"], body["waiting_for"]) == (
        "DEPLOYING",
        "the gateway to put a replica of version 1 in rotation",
    )

    routing.record_gateway_routes("gw-1 :8080", {deployment.pk: (1, 1)})
    body = owner_client.get(f"{BASE}{deployment.pk}/").json()
    assert (body["state"], body["waiting_for"]) == ("SERVING", "")
    listed = owner_client.get(BASE).json()["results"]
    assert [(d["id"], d["state"]) for d in listed] == [(deployment.pk, "SERVING")]


def test_every_running_gateway_must_route_it_and_a_silent_one_is_not_waited_for(deployment, settings):
    routing.record_gateway_routes("gw-1 :8080", {deployment.pk: (1, 1)})
    routing.record_gateway_routes("gw-2 :8080", {})
    assert fresh(deployment).reported_state() == DeploymentState.DEPLOYING
    stale = timezone.now() - timedelta(seconds=settings.GATEWAY_ROUTES_STALE_S + 1)
    GatewayRouting.objects.filter(name="gw-2 :8080").update(seen_at=stale)
    assert fresh(deployment).reported_state() == DeploymentState.SERVING
    routing.forget_gateway("gw-1 :8080")
    assert GatewayView.load().gateways == ()


def test_a_switch_is_reported_until_the_gateway_routes_the_new_version(deployment):
    version = make_version(deployment.model, 2)
    Deployment.objects.filter(pk=deployment.pk).update(active_version=version)
    routing.record_gateway_routes("gw-1 :8080", {deployment.pk: (1, 1)})
    switched = fresh(deployment)
    assert switched.reported_state() == DeploymentState.SWITCHING
    assert switched.waiting_for() == "the gateway to route version 2 (it routes version 1)"
    routing.record_gateway_routes("gw-1 :8080", {deployment.pk: (0, 1)})
    assert (
        fresh(deployment).waiting_for()
        == "the gateway to route version 2 (it routes every version (a switch))"
    )
    routing.record_gateway_routes("gw-1 :8080", {deployment.pk: (2, 1)})
    assert fresh(deployment).reported_state() == DeploymentState.SERVING


def test_a_model_scaled_to_zero_is_callable_with_no_server_since_the_gateway_holds_and_wakes(deployment):
    Deployment.objects.filter(pk=deployment.pk).update(pinned=False, min_replicas=0, max_replicas=1)
    routing.record_gateway_routes("gw-1 :8080", {deployment.pk: (1, 0)})
    asleep = fresh(deployment)
    assert asleep.reported_state() == DeploymentState.SERVING
    # Loaded on an instance but not yet in the gateway's rotation: still waking, as the page says.
    assert asleep.residency() == "waking"


def test_the_deployment_page_says_what_it_waits_for_and_keeps_following(deployment, client, owner):
    routing.record_gateway_routes("gw-1 :8080", {})
    client.force_login(owner)
    page = client.get(f"/teams/vision/deployments/{deployment.pk}/").content.decode()
    assert 'id="deployment-state">Deploying</span>' in page
    assert "waiting for the gateway to route version 1 (its next sync)" in page
    assert 'hx-trigger="load delay:0.5s, every 2s"' in page
