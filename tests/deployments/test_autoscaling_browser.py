"""The deploy form's autoscaling settings in Chromium: a bound out of range is refused with a message next to
its field and nothing is deployed; good settings deploy an autoscaled deployment whose page shows them."""

from __future__ import annotations

import pytest
from django.utils import timezone

from apps.deployments.models import Deployment
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
