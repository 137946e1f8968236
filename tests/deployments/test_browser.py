"""Deploy from the UI with a live host agent, watch the page reach SERVING, run the playground. Screenshots
under var/screenshots/."""

from __future__ import annotations

import pytest

from apps.deployments.models import Deployment, DeploymentState
from apps.fleet.models import InstanceState, TritonInstance
from tests.conftest import PASSWORD, SCREENSHOTS, requires_chromium, wait_for

pytestmark = [
    pytest.mark.browser,
    pytest.mark.triton,
    pytest.mark.django_db(transaction=True),
    requires_chromium,
]


def test_deploy_from_the_ui_and_run_the_playground(
    page,
    live_server,
    start_agent,
    make_ready_version,
    owner,
):
    version = make_ready_version()
    agent = start_agent("host-a")
    wait_for(
        lambda: TritonInstance.objects.filter(host__name="host-a", state=InstanceState.READY).exists(),
        120,
        f"the agent's instance\n{agent.output()}",
    )
    page.goto(f"{live_server.url}/login/")
    page.fill("input[name=username]", owner.username)
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_selector(".stats")

    # From the model page: the READY version's Deploy link opens the form with it chosen.
    page.goto(f"{live_server.url}/teams/vision/models/{version.model.slug}/")
    page.click("tr[data-version='1'] a.deploy-link")
    page.wait_for_selector("#deploy-form")
    assert page.input_value("#id_model") == "classifier" and page.input_value("#id_version") == "1"
    checkbox = page.locator("#instance-choices input[name=instances]")
    assert checkbox.count() == 1 and checkbox.is_checked()  # the one instance is preselected
    page.screenshot(path=str(SCREENSHOTS / "deploy-form.png"), full_page=True)
    page.click("#deploy-submit")

    # The status partial polls until every placement is READY, then stops.
    page.wait_for_selector("#deployment-status[data-state=SERVING]", timeout=90_000)
    assert page.inner_text("#active-version") == "v1"
    assert page.get_attribute("#deployment-status", "hx-trigger") is None
    assert "deployed" in page.inner_text("#event-table")
    assert page.inner_text("#triton-model-name") == "vision__classifier"
    # Clients call the gateway with a token, never the instance.
    assert 'InferenceServerClient(url="127.0.0.1:8080")' in page.inner_text("#snippet-python")
    assert "curl -X POST http://127.0.0.1:8080/v2/models/vision__classifier/infer" in page.inner_text(
        "#snippet-curl"
    )
    deployment = Deployment.objects.get()
    assert deployment.state == DeploymentState.SERVING

    # Playground with random data: the classifier's top-5 and the latency.
    page.click("#playground-run")
    page.wait_for_selector("#playground-latency", timeout=30_000)
    assert page.inner_text("#playground-latency").endswith(" ms")
    assert page.locator("#top5-0 tbody tr").count() == 5
    page.screenshot(path=str(SCREENSHOTS / "deployment-playground.png"), full_page=True)

    # JSON values instead: the field shows once its mode is chosen; a wrong shape is explained in place.
    assert not page.locator("textarea[name=data_0]").is_visible()
    page.select_option("#mode_0", "json")
    page.fill("textarea[name=data_0]", "[1, 2, 3]")
    page.click("#playground-run")
    page.wait_for_selector("#playground-error")
    assert "needs shape [-1, 3, 224, 224]" in page.inner_text("#playground-error")
