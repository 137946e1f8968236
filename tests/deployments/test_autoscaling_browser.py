"""Autoscaling in Chromium: the deploy form's settings (a bound out of range is refused with a message next to
its field and nothing is deployed; good settings deploy an autoscaled deployment whose page shows them), and
the deployment page's chart of its replicas over time with the autoscaler's decisions as markers."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest
from django.utils import timezone

from apps.deployments import autoscaling, services
from apps.deployments.models import Deployment, PlacementState
from apps.fleet.models import Host, Pool
from apps.registry.models import RegisteredModel
from tests.conftest import PASSWORD, SCREENSHOTS, requires_chromium
from tests.support.models import add_instance, make_version

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True), requires_chromium]


def test_autoscaling_is_set_in_the_deploy_form_with_its_bounds(page, live_server, owner, team):
    pool = Pool.objects.create(name="cpu", memory_budget_mb=1000)
    host = Host.objects.create(name="h0", address="127.0.0.1", last_heartbeat_at=timezone.now(), pool=pool)
    add_instance(host, "cpu-0", 18400)
    model = RegisteredModel.objects.create(team=team, name="Sleepy", slug="sleepy", created_by=owner)
    make_version(model)
    page.goto(f"{live_server.url}/login/")
    page.fill("input[name=username]", owner.username)
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_selector(".stats")

    page.goto(f"{live_server.url}/teams/vision/deployments/new/?model=sleepy")
    page.wait_for_selector("#deploy-form")
    page.check("#deploy-form input[name=placement][value=pool]")
    page.select_option("#id_pool", "cpu")
    page.check("#id_autoscale")
    page.fill("#id_min_replicas", "3")
    page.fill("#id_max_replicas", "2")
    page.fill("#id_idle_period_s", "60")
    page.click("#deploy-submit")
    error = page.wait_for_selector("small.field-error[data-field=max_replicas]")
    assert "max_replicas (2) is below min_replicas (3)" in error.inner_text()
    assert not Deployment.objects.filter(model=model).exists()  # nothing left behind

    page.fill("#id_min_replicas", "0")
    page.fill("#id_idle_period_s", "0")
    page.click("#deploy-submit")
    error = page.wait_for_selector("small.field-error[data-field=idle_period_s]")
    assert "Give 1 to" in error.inner_text() and not Deployment.objects.filter(model=model).exists()

    page.fill("#id_idle_period_s", "120")
    page.fill("#id_target_in_flight", "2.5")
    page.screenshot(path=str(SCREENSHOTS / "deploy-form-autoscaling.png"), full_page=True)
    page.click("#deploy-submit")
    page.wait_for_selector("#autoscaling")
    text = page.inner_text("#autoscaling")
    assert (
        "Autoscaling: 0..2 replicas, target 2.5 in flight per replica" in text
        and "asleep after 120 s" in text
    )
    deployment = Deployment.objects.get(model=model)
    assert (deployment.min_replicas, deployment.max_replicas, deployment.idle_period_s) == (0, 2, 120)


def test_the_deployment_page_charts_replicas_over_time_with_the_decisions(page, live_server, owner, team):
    pool = Pool.objects.create(name="cpu", memory_budget_mb=1000)
    for i in range(3):
        host = Host.objects.create(
            name=f"h{i}", address="127.0.0.1", last_heartbeat_at=timezone.now(), pool=pool
        )
        add_instance(host, "cpu-0", 18410 + i)
    model = RegisteredModel.objects.create(team=team, name="Bursty", slug="bursty", created_by=owner)
    version = make_version(model)
    deployment = services.deploy_version(actor=owner, model=model, version=version, replicas=1, pool=pool)
    autoscaling.configure(actor=owner, deployment=deployment, values={
        "min_replicas": 0, "max_replicas": 3, "target_in_flight": 4, "scale_down_window_s": 0, "idle_period_s": 60})  # fmt: skip
    start = time.time() // 60 * 60 - 30 * 60

    def evaluate_at(at: float, load: tuple) -> None:
        # The evaluation as it ran then: its events dated like its samples (the clock is the test's).
        newest = deployment.events.order_by("-id").values_list("id", flat=True).first() or 0
        autoscaling.evaluate({deployment.pk: load}, now=at)
        deployment.events.filter(id__gt=newest).update(created_at=datetime.fromtimestamp(at, UTC))

    evaluate_at(start, (0, 0))
    evaluate_at(start + 60, (19.2, 10))  # 1 -> 3
    deployment.placements.update(state=PlacementState.READY)
    evaluate_at(start + 120, (12, 20))
    evaluate_at(start + 600, (0, 20))  # quiet: 3 -> 0 after the idle period

    page.goto(f"{live_server.url}/login/")
    page.fill("input[name=username]", owner.username)
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_selector(".stats")
    page.goto(f"{live_server.url}/teams/vision/deployments/{deployment.pk}/")
    page.wait_for_selector("#metrics[data-loaded=true]")
    labels = page.evaluate("() => window.metricsCharts['chart-replicas'].series.slice(1).map(s => s.label)")
    assert labels == ["desired", "ready"]
    desired = page.evaluate("() => window.metricsCharts['chart-replicas'].data[1]")
    ready = page.evaluate("() => window.metricsCharts['chart-replicas'].data[2]")
    known = [(d, r) for d, r in zip(desired, ready, strict=True) if d is not None]
    # 1 wanted (none ready), 3 wanted, 3 ready, then asleep: the steps in order, nothing else.
    steps = [pair for i, pair in enumerate(known) if i == 0 or pair != known[i - 1]]
    assert steps[:3] == [(1, 0), (3, 0), (3, 3)] and steps[-1][0] == 0, steps
    markers = page.locator("#chart-replicas .chart-marker span")
    texts = markers.all_inner_texts()
    assert "1→3" in texts and "3→0" in texts, texts
    title = markers.nth(texts.index("1→3")).get_attribute("title")
    assert "UTC" in title and "19.2 in flight per replica, target 4" in title
    assert "replicas ready now (0..3)" in page.inner_text("#replicas-panel .replicas-now")
    page.locator("#replicas-panel").screenshot(path=str(SCREENSHOTS / "deployment-replicas.png"))
