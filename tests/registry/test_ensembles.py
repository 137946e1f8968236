"""Ensembles in the registry: the seed's ensemble uploaded and composed, and every wiring mistake refused
with a 400 that names the step and the tensor."""

from __future__ import annotations

import copy

import pytest

from apps.registry import services
from apps.registry.models import VersionState
from backend_ge import config as gc
from tests.registry.ensemble_builders import ensemble_model, seed_ensemble_dir, seed_spec, seed_steps, tar_of
from tests.registry.uploads import models_url, upload

pytestmark = pytest.mark.django_db


@pytest.fixture
def steps(owner, team, artifact_root):
    return seed_steps(owner, team)


@pytest.fixture
def ensemble(owner, team, artifact_root):
    return ensemble_model(owner, team)


def compose(client, spec, model="classify"):
    return client.post(f"{models_url()}{model}/ensemble-versions/", spec, format="json")


def messages(response) -> str:
    return repr(response.json())


def test_seed_ensemble_uploaded_is_ready_with_triton_names_and_pinned_versions(
    owner_client, steps, ensemble, tmp_path
):
    response = upload(owner_client, "ensemble.tar.gz", tar_of(seed_ensemble_dir(tmp_path)), model="classify")
    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["state"] == VersionState.READY and body["source_format"] == "ensemble"
    cfg = gc.parse_config(body["config_text"])
    assert cfg.name == "vision__classify" and cfg.platform == "ensemble"
    assert [(s.model_name, s.model_version) for s in cfg.ensemble_scheduling.step] == [
        ("vision__preprocess", 1),
        ("vision__resnet50", 1),
        ("vision__postprocess", 1),
    ]
    assert [p["model"] for p in body["pipeline"]] == ["preprocess", "resnet50", "postprocess"]
    assert body["signature"]["inputs"] == [
        {"name": "raw_image", "dtype": "UINT8", "dims": [224, 224, 3], "format": ""}
    ]
    version = ensemble.versions.get()
    assert (version.servable_dir() / "config.pbtxt").is_file() and (version.servable_dir() / "1").is_dir()


def test_ensemble_upload_with_a_file_in_its_version_folder_is_refused(
    owner_client, steps, ensemble, tmp_path
):
    directory = seed_ensemble_dir(tmp_path)
    (directory / "1" / "run.sh").write_text("echo")
    response = upload(owner_client, "ensemble.tar.gz", tar_of(directory), model="classify")
    assert response.status_code == 400
    assert "1/run.sh" in messages(response)


def test_ensemble_uploaded_to_a_plain_model_is_refused(owner_client, steps, tmp_path):
    response = upload(owner_client, "ensemble.tar.gz", tar_of(seed_ensemble_dir(tmp_path)), model="resnet50")
    assert response.status_code == 400
    assert "kind 'ensemble'" in messages(response)


def test_upload_naming_a_step_with_no_ready_version_is_refused(owner_client, owner, team, ensemble, tmp_path):
    seed_steps(owner, team)
    services.create_model(actor=owner, team=team, name="x", slug="x")
    text = (seed_ensemble_dir(tmp_path) / "config.pbtxt").read_text().replace('"resnet50"', '"x"')
    (tmp_path / "preprocess_resnet_postprocess" / "config.pbtxt").write_text(text)
    response = upload(
        owner_client, "e.tar.gz", tar_of(tmp_path / "preprocess_resnet_postprocess"), model="classify"
    )
    assert response.status_code == 400
    assert "step[1]: x has no READY version 1" in messages(response)
    assert ensemble.versions.get().state == VersionState.FAILED


def test_seed_pipeline_composed_through_the_api(owner_client, steps, ensemble):
    response = compose(owner_client, seed_spec())
    assert response.status_code == 201, response.json()
    cfg = gc.parse_config(response.json()["config_text"])
    assert [t.name for t in cfg.output] == ["predictions", "scores"]
    assert list(cfg.input[0].dims) == [224, 224, 3] and cfg.input[0].data_type == gc.mc.TYPE_UINT8
    assert cfg.ensemble_scheduling.step[0].model_version == 1  # "the version serving": the latest READY


def _step(spec, i):
    return spec["steps"][i]


MISTAKES = {
    "unknown model": (
        lambda s: _step(s, 1).update(model="nope"),
        "step[1]",
        "'nope' is not a model of this team",
    ),
    "another team's model by slug": (
        lambda s: _step(s, 1).update(model="whisper"),
        "step[1]",
        "'whisper' is not a model",
    ),
    "another team's model by Triton name": (
        lambda s: _step(s, 1).update(model="speech__whisper"),
        "step[1]",
        "'speech__whisper' is not a model",
    ),
    "no such version": (lambda s: _step(s, 1).update(version=7), "step[1]", "no READY version 7"),
    "dtype": (
        lambda s: _step(s, 1)["input_map"].update(input="raw_image"),
        "step[1].input_map.input",
        "input 'input' is FP32; 'raw_image' (ensemble input) is UINT8",
    ),
    "shape": (
        lambda s: s.update(inputs=[{"name": "raw_image", "data_type": "UINT8", "dims": [224, 224, 4]}]),
        "step[0].input_map.input",
        "has shape [224, 224, 3]; 'raw_image' (ensemble input) has shape [224, 224, 4]",
    ),
    "unfed tensor": (
        lambda s: _step(s, 2)["input_map"].update(input="logitz"),
        "step[2].input_map.input",
        "'logitz' is neither an ensemble input",
    ),
    "step input left unmapped": (
        lambda s: _step(s, 1).update(input_map={}),
        "step[1].input_map",
        "input 'input' is fed by no tensor",
    ),
    "output produced by nobody": (
        lambda s: s.update(
            outputs=[{"name": "predictions"}, {"name": "top", "data_type": "FP32", "dims": [5]}]
        ),
        "output[1]",
        "no step produces 'top'",
    ),
    "cycle": (
        lambda s: (
            _step(s, 0).update(input_map={"input": "logits"}),
            s.update(inputs=[{"name": "raw_image", "data_type": "UINT8", "dims": [224, 224, 3]}]),
        ),
        "step[0].input_map.input",
        "'logits' is neither an ensemble input nor an earlier step's output",
    ),
    "unused step": (
        lambda s: s["steps"].append(
            {"model": "resnet50", "input_map": {"input": "pre"}, "output_map": {"output": "spare"}}
        ),
        "step[3].output_map",
        "step[3] (resnet50 v1) is unused",
    ),
    "batch above a step's": (
        lambda s: s.update(max_batch_size=64),
        "step[0].model_name",
        "max_batch_size 64 is above it",
    ),
    "too many steps": (
        lambda s: s["steps"].extend([copy.deepcopy(s["steps"][0])] * 17),
        "ensemble_scheduling.step",
        "at most 16",
    ),
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_each_wiring_mistake_is_a_400_naming_the_step_and_the_tensor(
    owner_client, steps, ensemble, outsider, other_team, mistake
):
    services.create_model(actor=outsider, team=other_team, name="whisper", slug="whisper")
    change, field, text = MISTAKES[mistake]
    spec = seed_spec()
    change(spec)
    response = compose(owner_client, spec)
    assert response.status_code == 400, response.json()
    assert field in messages(response) and text in messages(response), response.json()
    assert ensemble.versions.count() == 0


def test_composing_into_a_plain_model_is_refused(owner_client, steps):
    response = compose(owner_client, seed_spec(), model="resnet50")
    assert response.status_code == 400
    assert "not an ensemble" in messages(response)


def test_outsider_gets_404_composing_in_another_team(outsider_client, steps, ensemble):
    assert compose(outsider_client, seed_spec()).status_code == 404


def test_a_step_version_an_ensemble_pins_cannot_be_archived(owner_client, steps, ensemble):
    assert compose(owner_client, seed_spec()).status_code == 201
    response = owner_client.post(f"{models_url()}resnet50/versions/1/archive/")
    assert response.status_code == 409
    assert "vision__classify" in messages(response) or "classify" in messages(response)
