"""The ensemble composer in headless Chromium: the seed's pipeline composed from the team's own models, the
tensor editor offering only the tensors that fit each step input, a wiring mistake shown naming the step and
the tensor, and the version page drawing the pipeline."""

from __future__ import annotations

import pytest

from apps.registry.models import VersionState
from backend_ge import config as gc
from tests.conftest import SCREENSHOTS, requires_chromium
from tests.registry.ensemble_builders import ensemble_model, seed_steps
from tests.support.browser import login

pytestmark = [pytest.mark.browser, requires_chromium, pytest.mark.django_db(transaction=True)]


def offered(page, position: int, tensor: str) -> list[str]:
    select = f'fieldset[data-position="{position}"] select.step-input[data-input="{tensor}"]'
    return page.eval_on_selector_all(f"{select} option", "options => options.map(o => o.value)")


def add_step(page, position: int, slug: str) -> None:
    page.click("#add-step")
    page.select_option(f'fieldset[data-position="{position}"] select.step-model', slug)


def test_seed_pipeline_composed_in_the_browser(page, live_server, owner, team, artifact_root):
    seed_steps(owner, team)
    model = ensemble_model(owner, team)
    login(page, live_server, "olivia")
    page.goto(f"{live_server.url}/teams/vision/models/classify/")
    page.click("#compose-link")
    page.wait_for_selector("#compose-form")

    add_step(page, 0, "preprocess")
    assert offered(page, 0, "input") == ["new"]  # nothing before the first step: a new ensemble input
    page.fill('fieldset[data-position="0"] input.step-input-name', "raw_image")
    # Typed key by key: the editor is drawn again on each key, the field keeps the focus.
    page.fill('fieldset[data-position="0"] input.step-output[data-output="output"]', "")
    page.keyboard.type("pre")

    add_step(page, 1, "resnet50")
    page.select_option('fieldset[data-position="1"] select.step-version', "1")
    # resnet50's FP32 [3, 224, 224] input: the preprocess output fits, the UINT8 image does not.
    assert offered(page, 1, "input") == ["t:pre", "new"]
    page.fill('fieldset[data-position="1"] input.step-output[data-output="output"]', "logits")

    add_step(page, 2, "postprocess")
    assert offered(page, 2, "input") == ["t:logits", "new"]  # FP32 [1000]: only the logits
    page.fill('fieldset[data-position="2"] input.step-output[data-output="output"]', "predictions")
    page.fill('fieldset[data-position="2"] input.step-output[data-output="scores"]', "scores")
    page.check('fieldset[data-position="2"] input.step-export[data-output="output"]')
    page.check('fieldset[data-position="2"] input.step-export[data-output="scores"]')
    assert page.input_value("#compose-max-batch") == "32"  # the steps' own limit

    # A batch size above the steps' is refused, naming the step.
    page.fill("#compose-max-batch", "64")
    page.click("#compose-submit")
    page.wait_for_selector("#compose-errors")
    errors = page.inner_text("#compose-errors")
    assert "step[0]" in errors and "max_batch_size 64 is above it" in errors, errors
    assert model.versions.count() == 0
    # The editor comes back as it was: fix the batch size and submit.
    assert page.input_value('fieldset[data-position="1"] input.step-output') == "logits"
    page.fill("#compose-max-batch", "32")
    page.screenshot(path=str(SCREENSHOTS / "ensemble-composer.png"), full_page=True)
    page.click("#compose-submit")
    page.wait_for_url("**/teams/vision/models/classify/versions/1/")

    version = model.versions.get()
    assert version.state == VersionState.READY
    cfg = gc.parse_config(version.config_text)
    assert [(s.model_name, s.model_version) for s in cfg.ensemble_scheduling.step] == [
        ("vision__preprocess", 1),
        ("vision__resnet50", 1),
        ("vision__postprocess", 1),
    ]
    assert [t.name for t in cfg.input] == ["raw_image"] and cfg.input[0].data_type == gc.mc.TYPE_UINT8
    assert [t.name for t in cfg.output] == ["predictions", "scores"]
    steps = page.locator("#pipeline li.pipeline-step")
    assert steps.count() == 3
    assert "resnet50 v1" in steps.nth(1).inner_text() and "logits" in steps.nth(1).inner_text()
    page.screenshot(path=str(SCREENSHOTS / "ensemble-pipeline.png"), full_page=True)
