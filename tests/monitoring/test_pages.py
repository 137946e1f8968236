"""The chart pages link each other: the instance page its charts, the version page a one-version model chart,
the deployment page its own charts (the model chart component, scoped to the deployment)."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from apps.deployments.models import Deployment, DeploymentState


@pytest.fixture
def viewer_client(viewer):
    """A signed-in browser session (the pages, unlike the API, read the session)."""
    client = Client()
    client.force_login(viewer)
    return client


def test_model_metrics_page_focuses_one_version_from_the_query(metrics_setup, viewer_client):
    url = reverse("model-metrics", args=["vision", "classifier"])
    page = viewer_client.get(url, {"version": "2", "range": "15m"}).content.decode()
    assert 'data-version="2"' in page and 'data-range="15m"' in page
    assert "Showing v2 only" in page and 'href="?range=15m&amp;version=2"' in page
    # Anything but a positive number shows every version; an unknown range falls back to 1 h.
    page = viewer_client.get(url, {"version": "2 OR 1", "range": "1y"}).content.decode()
    assert "data-version" not in page and 'data-range="1h"' in page


def test_instance_page_links_its_charts(metrics_setup, viewer_client):
    instance = metrics_setup["instance"]
    page = viewer_client.get(
        reverse("instance-detail", args=[instance.host.name, instance.name])
    ).content.decode()
    charts = reverse("instance-metrics-page", args=[instance.host.name, instance.name])
    assert f'href="{charts}" id="instance-charts"' in page
    assert viewer_client.get(charts).status_code == 200


def test_deployment_page_has_the_deployment_charts_with_live_refresh(metrics_setup, viewer_client):
    model, (_, v2) = metrics_setup["model"], metrics_setup["versions"]
    deployment = Deployment.objects.create(
        team=model.team, model=model, active_version=v2, state=DeploymentState.SERVING
    )
    page = viewer_client.get(reverse("deployment-detail", args=["vision", deployment.pk])).content.decode()
    api = reverse("team-model-metrics", args=["vision", "classifier"])
    assert f'data-api="{api}"' in page and f'data-deployment="{deployment.pk}"' in page
    assert 'id="chart-latency"' in page and 'id="chart-queue"' not in page  # the compact set
    assert "data-refresh checked" in page
    for key in ("15m", "1h", "6h", "24h", "7d"):
        assert f'data-range="{key}"' in page
