"""The next step is always offered: the conversion page links the model and version, shows the duration and a
Deploy (or the deployment) once READY; "already deployed" links the deployment; a flash describing a state
goes once the state has settled."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.conversions.models import ConversionJob, JobState
from apps.deployments import services
from apps.deployments.models import Deployment, PlacementState

pytestmark = pytest.mark.django_db


@pytest.fixture
def web(client, maintainer):
    client.force_login(maintainer)
    return client


@pytest.fixture
def job(version):
    started = timezone.now() - timedelta(seconds=80)
    return ConversionJob.objects.create(
        version=version,
        state=JobState.SUCCEEDED,
        started_at=started,
        finished_at=started + timedelta(seconds=65),
    )


def test_conversion_page_links_model_and_version_shows_duration_and_offers_deploy(web, job):
    html = web.get(f"/teams/vision/conversions/{job.pk}/").content.decode()
    assert 'href="/teams/vision/models/classifier/" id="model-link"' in html
    assert 'href="/teams/vision/models/classifier/versions/1/" id="version-link"' in html
    assert '<dd id="job-duration">1 min 5 s</dd>' in html
    assert (
        'id="next-step" href="/teams/vision/deployments/new/?model=classifier&amp;version=1">Deploy v1'
        in html
    )


def test_conversion_page_of_a_deployed_model_offers_its_deployment(web, owner, job, version, instance):
    deployment = services.deploy_version(
        actor=owner, model=version.model, version=version, instances=[instance]
    )
    html = web.get(f"/teams/vision/conversions/{job.pk}/").content.decode()
    assert f'id="next-step" href="/teams/vision/deployments/{deployment.pk}/"' in html


def test_running_conversion_offers_no_deploy_and_counts_its_duration(web, version):
    running = ConversionJob.objects.create(
        version=version, state=JobState.RUNNING, started_at=timezone.now() - timedelta(seconds=3)
    )
    html = web.get(f"/teams/vision/conversions/{running.pk}/").content.decode()
    assert 'id="next-step"' not in html and " s so far</dd>" in html


def test_viewer_is_not_offered_to_deploy(client, viewer, job):
    client.force_login(viewer)
    assert 'id="next-step"' not in client.get(f"/teams/vision/conversions/{job.pk}/").content.decode()


def test_second_deploy_links_the_existing_deployment(web, owner, version, instance):
    deployment = services.deploy_version(
        actor=owner, model=version.model, version=version, instances=[instance]
    )
    response = web.post(
        "/teams/vision/deployments/new/", {"model": "classifier", "version": 1, "instances": [instance.pk]}
    )
    html = response.content.decode()
    assert response.status_code == 400 and "already deployed" in html
    assert f'href="/teams/vision/deployments/{deployment.pk}/" id="existing-deployment"' in html


def test_following_flash_shows_while_deploying_and_goes_once_serving(web, version, instance):
    response = web.post(
        "/teams/vision/deployments/new/", {"model": "classifier", "version": 1, "instances": [instance.pk]}
    )
    deployment = Deployment.objects.get()
    page = web.get(response["Location"]).content.decode()
    assert 'id="state-flash">Deploying Classifier v1; this page follows it until it serves.' in page
    deployment.placements.update(state=PlacementState.READY, served_version=version)
    services.placement_finished(deployment.placements.get())
    partial = web.get(
        f"/teams/vision/deployments/{deployment.pk}/status/", HTTP_HX_REQUEST="true"
    ).content.decode()
    assert '<span id="state-flash" hx-swap-oob="true" hidden></span>' in partial  # the polled swap removes it


def test_following_flash_is_left_out_when_the_state_settled_before_the_page(web, owner, version, instance):
    deployment = services.deploy_version(
        actor=owner, model=version.model, version=version, instances=[instance]
    )
    deployment.placements.update(state=PlacementState.READY, served_version=version)
    services.placement_finished(deployment.placements.get())
    session_flash = web.post(f"/teams/vision/deployments/{deployment.pk}/", {"op": "undeploy"})
    deployment.placements.update(state=PlacementState.UNLOADED)
    services.placement_finished(deployment.placements.get())
    html = web.get(session_flash["Location"]).content.decode()
    assert "Undeploying Classifier" not in html and 'id="state-flash"' not in html
