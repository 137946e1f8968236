"""Every main page at 390x844 (a phone): no horizontal page scroll, the top bar collapses behind a menu button
that opens onto the navigation, the team switcher and logout; the version page in the browser. Screenshots
land under var/screenshots/ (ignored by git)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.conversions.models import ConversionJob, JobState
from apps.deployments import reports
from apps.deployments import services as deployments
from apps.deployments.models import PlacementState
from apps.registry.models import ModelVersion
from apps.teams import services as teams
from apps.teams.models import Membership, Role
from tests.conftest import SCREENSHOTS, requires_chromium
from tests.registry.builders import with_files
from tests.support.browser import sign_in
from tests.support.models import make_version

pytestmark = [pytest.mark.browser, requires_chromium]

PHONE = {"width": 390, "height": 844}
NO_SIDEWAYS_SCROLL = "document.documentElement.scrollWidth <= window.innerWidth"
WIDEST = """() => {
  const limit = window.innerWidth;
  return [...document.querySelectorAll('body *')]
    .filter(e => e.getBoundingClientRect().right > limit + 0.5 && !e.closest('.table-wrap, pre'))
    .slice(0, 5).map(e => e.tagName + '#' + e.id + '.' + e.className + ' ' + Math.round(e.getBoundingClientRect().right));
}"""


@pytest.fixture
def estate(owner, other_team, model, instance, artifact_root):
    """One of everything a main page shows: a served version with a job, tokens, audit events, a second team."""
    Membership.objects.create(team=other_team, user=owner, role=Role.OWNER)
    v1 = with_files(make_version(model, 1))
    ModelVersion.objects.filter(pk=v1.pk).update(
        sha256="e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        size_bytes=123_456_789,
        source_filename="a-rather-long-model-file-name-for-a-phone-screen-resnet50-v1.5-int8.onnx",
        config_text='name: "vision__classifier"\nbackend: "ge"\nmax_batch_size: 8\n'
        + "# "
        + "x" * 300
        + "\n",
        tags=["prod", "int8"],
    )
    started = timezone.now() - timedelta(minutes=3)
    job = ConversionJob.objects.create(
        version=v1,
        state=JobState.SUCCEEDED,
        started_at=started,
        finished_at=started + timedelta(seconds=42),
        command=["atc", "--model=/artifacts/teams/1/models/1/versions/1/source/model.onnx", "--framework=5",
                 "--output=/artifacts/teams/1/models/1/versions/1/model/1/model", "--soc_version=Ascend310P3"],
        log="ATC start working now, please wait for a moment.\n" + "a-very-long-log-line-" * 40,
    )  # fmt: skip
    deployment = deployments.deploy_version(actor=owner, model=model, version=v1, instances=[instance])
    deployment.placements.update(state=PlacementState.READY, served_version=v1)
    deployments.placement_finished(deployment.placements.get())
    teams.create_token(actor=owner, team=model.team, name="ci pipeline token", read_only=True)
    return {"model": model, "version": v1, "job": job, "deployment": deployment, "instance": instance}


def main_pages(estate) -> dict[str, str]:
    host = estate["instance"].host.name
    name = estate["instance"].name
    deployment = estate["deployment"].pk
    return {
        "dashboard": "/",
        "models": "/teams/vision/models/",
        "model": "/teams/vision/models/classifier/",
        "version": "/teams/vision/models/classifier/versions/1/",
        "upload": "/teams/vision/models/classifier/upload/",
        "conversion": f"/teams/vision/conversions/{estate['job'].pk}/",
        "deployments": "/teams/vision/deployments/",
        "deployment": f"/teams/vision/deployments/{deployment}/",
        "hosts": "/hosts/",
        "host": f"/hosts/{host}/",
        "instance": f"/hosts/{host}/instances/{name}/",
        "model-metrics": "/teams/vision/models/classifier/metrics/",
        "instance-metrics": f"/hosts/{host}/instances/{name}/metrics/",
        "fleet-metrics": "/fleet/metrics/",
        "alerts": "/teams/vision/alerts/",
        "team": "/teams/vision/settings/",
        "audit": "/teams/vision/audit/",
    }


def test_no_main_page_scrolls_sideways_on_a_phone(page, live_server, estate):
    page.set_viewport_size(PHONE)
    sign_in(page, live_server.url)
    wide = {}
    for name, path in main_pages(estate).items():
        response = page.goto(f"{live_server.url}{path}")
        assert response.status == 200, (name, response.status)
        page.wait_for_load_state("networkidle")
        if not page.evaluate(NO_SIDEWAYS_SCROLL):
            wide[name] = (page.evaluate("document.documentElement.scrollWidth"), page.evaluate(WIDEST))
            page.screenshot(path=str(SCREENSHOTS / f"phone-{name}-too-wide.png"), full_page=True)
    assert wide == {}


def test_menu_button_opens_the_navigation_team_switcher_and_logout(page, live_server, estate):
    page.set_viewport_size(PHONE)
    sign_in(page, live_server.url)
    page.goto(f"{live_server.url}/teams/vision/models/")
    assert page.locator("#nav-toggle").is_visible()
    assert not page.locator("nav.mainnav").is_visible()
    assert not page.locator("#team-switcher").is_visible()
    page.click("#nav-toggle")
    assert page.locator("#nav-toggle").get_attribute("aria-expanded") == "true"
    assert page.locator("nav.mainnav >> text=Deployments").is_visible()
    assert page.locator("#team-switcher").is_visible()
    logout = page.locator("header form[action='/logout/'] button")
    assert logout.is_visible()
    box = logout.bounding_box()
    assert box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"]
    assert page.evaluate(NO_SIDEWAYS_SCROLL)
    page.screenshot(path=str(SCREENSHOTS / "phone-menu-open.png"), full_page=True)
    page.click("nav.mainnav >> text=Deployments")
    page.wait_for_url("**/teams/vision/deployments/")
    page.click("#nav-toggle")
    page.select_option("#team-switcher", "speech")
    page.wait_for_function("document.querySelector('#team-switcher').value === 'speech'")
    page.click("#nav-toggle")
    logout = page.locator("header form[action='/logout/'] button")
    logout.click()
    page.wait_for_url("**/login/**")


def test_desktop_keeps_the_full_top_bar_and_upload_page_does_not_scroll_sideways(page, live_server, estate):
    sign_in(page, live_server.url)
    page.goto(f"{live_server.url}/teams/vision/models/classifier/upload/")
    assert not page.locator("#nav-toggle").is_visible() and page.locator("nav.mainnav").is_visible()
    assert page.evaluate(NO_SIDEWAYS_SCROLL)
    assert page.locator("#file-input").bounding_box()["width"] <= 1


def test_version_page_in_the_browser_archive_refused_then_deleted_after_undeploy(
    page, live_server, estate, owner
):
    page.set_viewport_size(PHONE)
    sign_in(page, live_server.url)
    page.goto(f"{live_server.url}/teams/vision/models/classifier/")
    page.click("a.version-link >> text=v1")
    page.wait_for_url("**/versions/1/")
    assert "[-1, 3, 224, 224]" in page.locator("#signature").inner_text()
    assert "max_batch_size: 8" in page.locator("#served-config").inner_text()
    assert "117.7 MiB" in page.locator("#facts").inner_text()
    assert "42.0 s" in page.locator("#conversion-duration").inner_text()
    assert f"Deployment #{estate['deployment'].pk}" in page.locator("#serving").inner_text()
    page.click("#archive")
    flash = page.locator(".flash-error")
    assert "cannot be archived while it is in use" in flash.inner_text()
    flash.locator("a").click()
    page.wait_for_url(f"**/deployments/{estate['deployment'].pk}/")
    page.screenshot(path=str(SCREENSHOTS / "phone-version-refusal-followed.png"), full_page=True)

    deployments.undeploy(actor=owner, deployment=estate["deployment"])
    placement = estate["deployment"].placements.get()
    reports.placement_unloaded(placement.pk, placement.generation, "unloaded")
    page.goto(f"{live_server.url}/teams/vision/models/classifier/versions/1/")
    page.fill("#id_note", "Kept for the audit of May.")
    page.fill("#id_tags", "prod, audit-2026")
    page.click("#notes-form button[type=submit]")
    assert "Kept for the audit of May." in page.locator("#version-note").inner_text()
    page.click("#archive")
    assert page.locator("#version-archived").is_visible()
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#delete-version")
    page.wait_for_url("**/models/classifier/")
    assert "deleted" in page.locator(".flash-success").inner_text()
    assert not ModelVersion.objects.filter(model=estate["model"], number=1).exists()
