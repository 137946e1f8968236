"""The rollout panel of the deployment page (an htmx partial): start form, live state with both versions side
by side and the gates, confirmed controls, roles and tenancy - without an agent."""

from __future__ import annotations

import pytest
from django.test import Client

from apps.deployments import rollouts, services
from apps.deployments.models import RolloutAnalysis, RolloutState
from tests.deployments.helpers import report_canary, serving
from tests.support.models import make_version

pytestmark = pytest.mark.django_db
HX = {"HTTP_HX_REQUEST": "true"}


@pytest.fixture(autouse=True)
def no_agents(monkeypatch):
    monkeypatch.setattr(services, "_enqueue", lambda placements: None)


@pytest.fixture
def deployment(owner, version, instance):
    return serving(owner, version, [instance])


def web(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def panel_url(deployment) -> str:
    return f"/teams/vision/deployments/{deployment.pk}/rollout/"


def test_the_deployment_page_loads_the_panel_and_a_maintainer_gets_the_start_form(
    maintainer, deployment, model
):
    make_version(model, 2)
    page = web(maintainer).get(f"/teams/vision/deployments/{deployment.pk}/").content.decode()
    assert f'hx-get="{panel_url(deployment)}"' in page and "frontend/rollout.js" in page
    html = web(maintainer).get(panel_url(deployment)).content.decode()
    assert 'id="rollout-start"' in html and '<option value="2">v2</option>' in html
    # Idle: a rollout started elsewhere still shows up, but never while someone fills in the start form.
    assert "hx-trigger=\"every 10s [!document.querySelector('#rollout-start[open]')]\"" in html


def test_start_from_the_panel_then_side_by_side_figures_gates_and_confirmed_controls(
    maintainer, deployment, model
):
    make_version(model, 2)
    client = web(maintainer)
    html = client.post(
        panel_url(deployment),
        {"op": "start", "version": "2", "steps": "20, 100", "step_interval_s": "5", "min_success_pct": "99.5",
         "min_requests": "10", "traffic_deadline_s": "60", "max_failed_checks": "2"},
        **HX,
    ).content.decode()  # fmt: skip
    rollout = deployment.rollouts.get()
    assert rollout.steps == [20, 100] and rollout.min_success_rate == pytest.approx(0.995)
    assert 'id="rollout-state">Running' in html and "waiting for the canary to load" in html
    assert 'hx-trigger="every 2s"' in html and 'id="rollout-start"' not in html
    assert 'hx-confirm="Abort and roll back?' in html and 'hx-confirm="Promote v2 now?' in html
    compare = f"/teams/{deployment.team.slug}/models/{model.slug}/compare/?a=1&amp;b=2&amp;range=1h"
    assert f'id="rollout-compare" href="{compare}"' in html
    report_canary(rollout)
    assert rollouts.check_rollouts()["begun"] == 1
    rollout.refresh_from_db()
    RolloutAnalysis.objects.create(
        rollout=rollout, checked_at=rollout.step_started_at, window_start=rollout.step_started_at, weight=20,
        passed=False, failed_gates=[{"gate": "success_rate", "value": 0.7, "limit": 0.995}],
        figures={"stable": {"requests": 80, "success_rate": 1.0, "p99_ms": 2.0},
                 "canary": {"requests": 20, "success_rate": 0.7, "p99_ms": 3.0}},
    )  # fmt: skip
    html = client.get(panel_url(deployment)).content.decode()
    assert 'id="rollout-weight">20 %' in html and 'data-status="current">20 %' in html
    assert "Last check failed" in html and "≥ 99.50%" in html
    assert (
        '<tr data-figure="success_rate" class="gate-failed"><th>Success rate</th><td>100.00%</td><td>70.00%</td>'
        in html
    )
    html = client.post(panel_url(deployment), {"op": "pause", "rollout": rollout.pk}, **HX).content.decode()
    assert 'id="rollout-state">Paused' in html and '"op": "resume"' in html
    html = client.post(panel_url(deployment), {"op": "abort", "rollout": rollout.pk}, **HX).content.decode()
    assert (
        'id="rollout-state">Aborted' in html and "aborted by" in html and 'id="rollout-actions"' not in html
    )
    rollout.refresh_from_db()
    assert rollout.state == RolloutState.ABORTED


def test_a_refused_start_shows_the_message_in_the_panel(maintainer, deployment, model):
    make_version(model, 2)
    html = (
        web(maintainer)
        .post(panel_url(deployment), {"op": "start", "version": "2", "steps": "50 20"}, **HX)
        .content.decode()
    )
    assert 'id="rollout-error"' in html and "Steps must increase" in html
    assert not deployment.rollouts.exists()


def test_viewers_see_the_rollout_without_controls_and_cannot_post(viewer, owner, deployment, model):
    rollouts.start_rollout(actor=owner, deployment=deployment, canary=make_version(model, 2))
    client = web(viewer)
    html = client.get(panel_url(deployment)).content.decode()
    assert 'id="rollout-state">Running' in html and 'id="rollout-actions"' not in html
    assert client.post(panel_url(deployment), {"op": "abort", "rollout": "1"}).status_code == 403


def test_outsiders_get_404(outsider, deployment):
    assert web(outsider).get(panel_url(deployment)).status_code == 404


def test_model_list_and_model_page_show_which_version_serves_where_at_what_weight(
    viewer, owner, deployment, model, instance
):
    client = web(viewer)
    page = client.get("/teams/vision/models/classifier/").content.decode()
    assert 'data-version="1" data-weight="100">v1 · <strong>100 %</strong> on local/cpu-0' in page
    rollout = rollouts.start_rollout(actor=owner, deployment=deployment, canary=make_version(model, 2))
    report_canary(rollout)
    rollouts.check_rollouts()
    for url in ("/teams/vision/models/", "/teams/vision/models/classifier/"):
        page = client.get(url).content.decode()
        assert "v1 (stable) · <strong>90 %</strong> on local/cpu-0" in page, url
        assert "v2 (canary) · <strong>10 %</strong> on local/cpu-0" in page, url
