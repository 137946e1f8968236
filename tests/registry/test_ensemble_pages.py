"""Ensemble pages: the version page draws the pipeline with each step's figures (the slow step marked), the
composer page posts the compose API's spec and shows the service's errors naming the step and the tensor, and
"update step X to version N" makes a new ensemble version (page and API)."""

from __future__ import annotations

import json

import pytest
from django.utils import timezone

from apps.monitoring.models import ModelMetrics
from apps.registry import ensembles
from apps.registry.models import ModelKind, RegisteredModel
from backend_ge import config as gc
from tests.registry.ensemble_builders import ensemble_model, ready_step, seed_spec, seed_steps
from tests.registry.uploads import models_url

pytestmark = pytest.mark.django_db

PAGE = "/teams/vision/models/classify/"


@pytest.fixture
def steps(owner, team, artifact_root):
    return seed_steps(owner, team)


@pytest.fixture
def composed(owner, team, steps):
    return ensembles.compose_ensemble(actor=owner, model=ensemble_model(owner, team), spec=seed_spec())


@pytest.fixture
def web(client, owner):
    client.force_login(owner)
    return client


def figures(version, instance, requests: int, queue_ms: float, compute_ms: float) -> None:
    ModelMetrics.objects.create(
        bucket=timezone.now(), team=version.model.team, model=version.model, version=version, instance=instance,
        success=requests, request_us=requests * (queue_ms + compute_ms) * 1000, queue_us=requests * queue_ms * 1000,
        compute_infer_us=requests * compute_ms * 1000,
    )  # fmt: skip


def test_version_page_shows_the_pipeline_wiring_and_the_slow_step(web, steps, composed, instance):
    figures(steps["preprocess"], instance, 100, 0.5, 1.0)
    figures(steps["resnet50"], instance, 100, 2.0, 40.0)
    figures(steps["postprocess"], instance, 100, 0.1, 0.2)
    html = web.get(f"{PAGE}versions/{composed.number}/").content.decode()
    assert 'id="pipeline"' in html
    order = [html.index(f'data-model="{slug}"') for slug in ("preprocess", "resnet50", "postprocess")]
    assert order == sorted(order)
    # The wiring, with the step tensors' types and shapes.
    assert "<code>raw_image</code> &rarr; input <code>input</code>" in html
    assert "output <code>output</code> &rarr; <code>logits</code>" in html
    assert "FP32 [3, 224, 224]" in html and "UINT8 [224, 224, 3]" in html
    # Per-step figures from what the platform scrapes per model version: the slow step is marked.
    assert html.count("slowest step") == 1
    assert (
        html.index('data-model="resnet50"')
        < html.index("slowest step")
        < html.index('data-model="postprocess"')
    )
    assert (
        '<span class="step-queue">2.00 ms</span>' in html
        and '<span class="step-compute">40.00 ms</span>' in html
    )
    assert '<span class="step-requests">100 requests</span>' in html


def test_version_page_of_a_plain_model_has_no_pipeline(web, steps):
    html = web.get("/teams/vision/models/resnet50/versions/1/").content.decode()
    assert 'id="pipeline"' not in html


def test_update_step_on_the_page_makes_a_new_version_pinning_it(web, steps, composed):
    ready_step(steps["resnet50"].model)  # v2
    html = web.get(f"{PAGE}versions/1/").content.decode()
    assert 'value="1:2"' in html and "step[1] resnet50: v1 -&gt; v2" in html
    response = web.post(f"{PAGE}versions/1/", {"op": "update_step", "step_update": "1:2"})
    assert response.status_code == 302 and response["Location"] == f"{PAGE}versions/2/"
    new = composed.model.versions.get(number=2)
    cfg = gc.parse_config(new.config_text)
    assert [s.model_version for s in cfg.ensemble_scheduling.step] == [1, 2, 1]
    assert [s.step_version.number for s in new.ensemble_steps.order_by("position")] == [1, 2, 1]


def test_update_step_api_and_its_mistakes(owner_client, outsider_client, steps, composed):
    url = f"{models_url()}classify/ensemble-versions/update-step/"
    assert owner_client.post(url, {"step": "resnet50", "version": 2}, format="json").status_code == 400
    ready_step(steps["resnet50"].model)  # v2
    same = owner_client.post(url, {"step": "1", "version": 1}, format="json")
    assert same.status_code == 400 and "already calls resnet50 v1" in repr(same.json())
    unknown = owner_client.post(url, {"step": "whisper", "version": 2}, format="json")
    assert unknown.status_code == 400 and "has no step 'whisper'" in repr(unknown.json())
    assert outsider_client.post(url, {"step": "resnet50", "version": 2}, format="json").status_code == 404
    made = owner_client.post(url, {"step": "resnet50", "version": 2}, format="json")
    assert made.status_code == 201, made.json()
    assert [p["version"] for p in made.json()["pipeline"]] == [1, 2, 1]
    # A step version whose signature does not fit the wiring is refused like any composed version.
    wrong = ready_step(steps["postprocess"].model)  # v2 of postprocess, then rewired below
    wrong.signature = {**wrong.signature, "inputs": [{"name": "input", "dtype": "FP16", "dims": [1000]}]}
    wrong.save()
    refused = owner_client.post(url, {"step": "2", "version": 2}, format="json")
    assert refused.status_code == 400
    assert "step[2].input_map.input" in repr(refused.json()) and "FP16" in repr(refused.json())


def test_new_model_form_makes_an_ensemble_and_opens_the_composer(web, team):
    response = web.post(
        "/teams/vision/models/new/", {"name": "Classify", "task_type": "other", "kind": "ensemble"}
    )
    assert response.status_code == 302 and response["Location"] == f"{PAGE}compose/"
    assert RegisteredModel.objects.get(slug="classify").kind == ModelKind.ENSEMBLE
    assert 'id="compose-link"' in web.get(PAGE).content.decode()


def test_composer_offers_the_teams_models_and_posts_the_compose_spec(
    web, steps, owner, team, outsider, other_team
):
    ensemble_model(owner, team)
    foreign = RegisteredModel.objects.create(team=other_team, name="resnet50", slug="resnet50")
    ready_step(foreign)  # another team's READY model of the same slug
    page = web.get(f"{PAGE}compose/")
    assert page.status_code == 200
    offered = [c["slug"] for c in page.context["choices"]]
    assert offered == ["postprocess", "preprocess", "resnet50"]  # the team's own models only
    assert all(c["versions"][0]["signature"]["inputs"] for c in page.context["choices"])
    response = web.post(f"{PAGE}compose/", {"spec": json.dumps(seed_spec())})
    assert response.status_code == 302 and response["Location"] == f"{PAGE}versions/1/"


def test_composer_shows_each_mistake_naming_step_and_tensor(web, steps, owner, team):
    ensemble_model(owner, team)
    spec = seed_spec()
    spec["steps"][1]["input_map"] = {"input": "raw_image"}
    response = web.post(f"{PAGE}compose/", {"spec": json.dumps(spec)})
    assert response.status_code == 400
    html = response.content.decode()
    assert "step[1].input_map.input" in html and "&#x27;raw_image&#x27; (ensemble input) is UINT8" in html
    assert 'id="posted-spec"' in html  # the editor comes back as it was
    another = web.post(
        f"{PAGE}compose/", {"spec": json.dumps({**seed_spec(), "steps": [{"model": "whisper"}]})}
    )
    assert another.status_code == 400 and "step[0]" in another.content.decode()
    assert web.post(f"{PAGE}compose/", {"spec": "{nope"}).status_code == 400


def test_outsider_gets_404_for_the_composer_and_the_pipeline(client, outsider, steps, composed):
    client.force_login(outsider)
    assert client.get(f"{PAGE}compose/").status_code == 404
    assert client.get(f"{PAGE}versions/1/").status_code == 404
