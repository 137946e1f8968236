"""The comparison page in headless Chromium: reached from the versions list, differences visible, the hostile
config text shown as text (no script runs)."""

from __future__ import annotations

import pytest

from tests.conftest import SCREENSHOTS, requires_chromium
from tests.monitoring.builders import HOSTILE
from tests.support.browser import login

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True), requires_chromium]


def test_compare_from_the_versions_list(page, live_server, compared, viewer):
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    login(page, live_server, viewer.username)
    page.goto(f"{live_server.url}/teams/vision/models/classifier/")
    form = page.locator("#versions-compare")
    form.locator("select[name=a]").select_option("1")
    form.locator("select[name=b]").select_option("2")
    form.locator("button[type=submit]").click()
    page.wait_for_selector("#compare-config")
    assert page.url.endswith("/teams/vision/models/classifier/compare/?a=1&b=2")

    diff = page.locator("#config-diff")
    assert f"+# {HOSTILE}" in diff.inner_text()  # the tenant's text, as text
    assert page.locator("#config-diff script, #config-diff img").count() == 0
    colour = "el => getComputedStyle(el).backgroundColor"
    added = page.locator("#config-diff .diff-add").first.evaluate(colour)
    removed = page.locator("#config-diff .diff-del").first.evaluate(colour)
    same = page.locator("#config-diff .diff-same").first.evaluate(colour)
    assert len({added, removed, same}) == 3, (added, removed, same)
    changed_input = page.locator('tr[data-tensor="input"] td.changed')
    assert changed_input.count() == 4  # type and shape, on both sides
    assert page.locator('tr[data-tensor="output"] td.changed').count() == 0
    plain = page.locator('tr[data-tensor="input"] td').first.evaluate(colour)
    assert changed_input.first.evaluate(colour) != plain  # the changed cells are marked, not only bold
    assert "Ascend310P3" in page.locator("#compare-conversion").inner_text()

    # Another range from the picker keeps both versions.
    page.select_option("#compare-range", "6h")
    page.locator("#compare-form button[type=submit]").click()
    page.wait_for_url("**range=6h**")
    assert "a=1" in page.url and "b=2" in page.url
    assert "Serving, last 6h" in page.locator("#compare-serving").inner_text()
    page.screenshot(path=str(SCREENSHOTS / "version-compare.png"), full_page=True)
    assert dialogs == []
