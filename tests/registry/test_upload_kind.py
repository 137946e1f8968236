"""A model without versions takes its kind from its first upload; one with versions keeps its kind and a wrong
upload is a 400 naming the model and the kind it has. Two concurrent first uploads of different kinds: one wins."""

from __future__ import annotations

import io
import threading

import pytest
from django.core.exceptions import ValidationError
from django.db import connection

from apps.audit.models import AuditEvent
from apps.registry import services
from apps.registry.models import ModelKind, RegisteredModel, VersionState
from tests.registry import builders
from tests.registry.ensemble_builders import ensemble_model, seed_ensemble_dir, seed_spec, seed_steps, tar_of
from tests.registry.uploads import models_url, upload


@pytest.fixture
def steps(owner, team, artifact_root):
    return seed_steps(owner, team)


def errors_of(response) -> str:
    return repr(response.json())


@pytest.mark.django_db
def test_ensemble_archive_makes_an_empty_plain_model_an_ensemble(owner_client, owner, team, steps, tmp_path):
    services.create_model(actor=owner, team=team, name="classify", slug="classify")  # kind left out: "model"
    response = upload(owner_client, "ensemble.tar.gz", tar_of(seed_ensemble_dir(tmp_path)), model="classify")
    assert response.status_code == 200, response.json()
    assert response.json()["state"] == VersionState.READY and response.json()["source_format"] == "ensemble"
    model = RegisteredModel.objects.get(team=team, slug="classify")
    assert model.kind == ModelKind.ENSEMBLE
    assert owner_client.get(f"{models_url()}classify/").json()["kind"] == "ensemble"
    event = AuditEvent.objects.get(action="model.kind_taken")
    assert event.actor == owner and event.target_id == str(model.pk)
    assert event.details == {"model": "classify", "from": "model", "to": "ensemble", "version": 1}
    # Now an ensemble with a version: it can be composed, and a model file is refused.
    assert (
        owner_client.post(
            f"{models_url()}classify/ensemble-versions/", seed_spec(), format="json"
        ).status_code
        == 201
    )
    refused = upload(owner_client, "m.onnx", builders.onnx_bytes(), model="classify")
    assert refused.status_code == 400
    assert "classify is of kind 'ensemble' and has versions" in errors_of(refused)


@pytest.mark.django_db
def test_model_file_makes_an_empty_ensemble_model_a_model(owner_client, owner, team, artifact_root):
    ensemble_model(owner, team)
    response = upload(owner_client, "m.onnx", builders.onnx_bytes(), model="classify")
    assert response.status_code == 200, response.json()
    assert RegisteredModel.objects.get(team=team, slug="classify").kind == ModelKind.MODEL
    assert AuditEvent.objects.get(action="model.kind_taken").details["to"] == "model"


@pytest.mark.django_db
def test_ensemble_archive_to_a_model_with_versions_is_a_400_naming_the_model_and_its_kind(
    owner_client, steps, tmp_path
):
    response = upload(owner_client, "ensemble.tar.gz", tar_of(seed_ensemble_dir(tmp_path)), model="resnet50")
    assert response.status_code == 400
    text = errors_of(response)
    assert "resnet50 is of kind 'model' and has versions" in text and "kind 'ensemble'" in text
    assert RegisteredModel.objects.get(slug="resnet50").kind == ModelKind.MODEL
    assert not AuditEvent.objects.filter(action="model.kind_taken").exists()


@pytest.mark.django_db
def test_a_rejected_upload_does_not_give_the_model_a_kind(owner_client, owner, team, steps, tmp_path):
    services.create_model(actor=owner, team=team, name="classify", slug="classify")
    directory = seed_ensemble_dir(tmp_path)
    (directory / "1" / "run.sh").write_text("echo")  # refused: a file in the ensemble's version folder
    assert upload(owner_client, "e.tar.gz", tar_of(directory), model="classify").status_code == 400
    model = RegisteredModel.objects.get(team=team, slug="classify")
    assert model.kind == ModelKind.MODEL and model.versions.get().state == VersionState.FAILED
    (directory / "1" / "run.sh").unlink()
    response = upload(owner_client, "e.tar.gz", tar_of(directory), model="classify")
    assert response.status_code == 200, response.json()
    model.refresh_from_db()
    assert model.kind == ModelKind.ENSEMBLE


def _open(owner, model, filename: str, data: bytes):
    session = services.start_upload(actor=owner, model=model, filename=filename, size=len(data))
    services.receive_chunk(session=session, offset=0, stream=io.BytesIO(data), length=len(data))
    return session


@pytest.mark.django_db(transaction=True)
def test_two_concurrent_first_uploads_of_different_kinds_only_one_wins(
    owner, team, steps, tmp_path, monkeypatch
):
    model = services.create_model(actor=owner, team=team, name="classify", slug="classify")
    sessions = {
        "ensemble": _open(owner, model, "e.tar.gz", tar_of(seed_ensemble_dir(tmp_path))),
        "model": _open(owner, model, "m.onnx", builders.onnx_bytes()),
    }
    # No conversion is queued from this test (the broker is shared); the kind is what is under test.
    monkeypatch.setattr(services.version_uploaded, "send", lambda **kwargs: [])
    # Both pass the check before the model's lock (the model is still empty for both), then race for it.
    barrier, checked, real = threading.Barrier(2, timeout=20), threading.local(), services.upload_kind

    def upload_kind(*args):
        if not getattr(checked, "once", False):
            checked.once = True
            barrier.wait()
        return real(*args)

    monkeypatch.setattr(services, "upload_kind", upload_kind)
    outcomes: dict[str, str] = {}

    def complete(kind: str) -> None:
        try:
            services.complete_upload(actor=owner, session=sessions[kind])
            outcomes[kind] = "won"
        except ValidationError as exc:
            outcomes[kind] = str(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=complete, args=(kind,)) for kind in sessions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(outcomes) == ["ensemble", "model"], outcomes
    winners = [kind for kind, outcome in outcomes.items() if outcome == "won"]
    assert len(winners) == 1, outcomes
    loser = "model" if winners == ["ensemble"] else "ensemble"
    model.refresh_from_db()
    assert model.kind == winners[0]
    assert f"classify is of kind '{winners[0]}' and has versions" in outcomes[loser]
    states = {v.source_filename: v.state for v in model.versions.all()}
    assert states[sessions[loser].filename] == VersionState.FAILED
    assert states[sessions[winners[0]].filename] != VersionState.FAILED
    # The model was created of kind "model": only an ensemble winning changed it.
    assert AuditEvent.objects.filter(action="model.kind_taken").count() == (
        1 if winners == ["ensemble"] else 0
    )
