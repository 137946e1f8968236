"""A version derived from a READY one with other serving settings (what a tuning recommends): the same files,
the new config, READY at once; bad input is a 400 naming the field and creates nothing."""

from __future__ import annotations

import pytest

from apps.audit.models import AuditEvent
from apps.registry.models import ModelVersion, VersionState
from backend_ge import config as gc
from tests.conversions.helpers import config_url, converted
from tests.registry.hostile_configs import CASES

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def ready(make_version, mlp_bytes, owner, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no atc: the ONNX path, as on a CPU worker
    version, _ = converted(make_version, {"model.onnx": mlp_bytes}, owner)
    return version


def derive_url(version) -> str:
    return config_url(version) + "derive/"


SERVING = {
    "dynamic_batching": True,
    "max_batch_size": 4,
    "max_queue_delay_us": 500,
    "preferred": [2],
    "instance_count": 2,
}


def test_serving_settings_make_a_ready_version_with_the_same_files_and_the_new_config(
    ready, maintainer_client
):
    response = maintainer_client.post(derive_url(ready), {"serving": SERVING, "note": "tuned"}, format="json")
    assert response.status_code == 201, response.json()
    assert response.json()["version"] == ready.number + 1 and response.json()["state"] == "READY"
    derived = ModelVersion.objects.get(model=ready.model, number=ready.number + 1)
    assert derived.state == VersionState.READY and derived.is_servable() and derived.note == "tuned"
    assert (derived.signature, derived.sha256, derived.source_format) == (
        ready.signature,
        ready.sha256,
        ready.source_format,
    )
    cfg = gc.parse_config((derived.servable_dir() / "config.pbtxt").read_text())
    assert gc.render_config(cfg) == derived.config_text
    assert cfg.max_batch_size == 4 and list(cfg.dynamic_batching.preferred_batch_size) == [2]
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 500
    assert cfg.instance_group[0].count == 2 and cfg.name == ready.model.triton_model_name()
    # The model file is the same file; the original version's config is untouched.
    old_model = next((ready.servable_dir() / "1").iterdir())
    new_model = derived.servable_dir() / "1" / old_model.name
    assert new_model.read_bytes() == old_model.read_bytes()
    assert (ready.servable_dir() / "config.pbtxt").read_text() == ModelVersion.objects.get(
        pk=ready.pk
    ).config_text
    assert AuditEvent.objects.filter(action="version.derived", details__from=ready.number).exists()
    assert not list(derived.storage_dir().parent.glob(".*derive*"))


def test_a_whole_config_text_can_be_given_instead(ready, maintainer_client):
    text = ready.config_text.replace("max_batch_size: 8", "max_batch_size: 16")
    response = maintainer_client.post(derive_url(ready), {"config_text": text}, format="json")
    assert response.status_code == 201, response.json()
    assert "max_batch_size: 16" in response.json()["config_text"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "config_text"),
        ({"serving": SERVING, "config_text": "x"}, "config_text"),
        ({"serving": {**SERVING, "instance_count": 0}}, "serving"),
        ({"serving": {**SERVING, "max_batch_size": -1}}, "serving"),
        ({"serving": {**SERVING, "preferred": [16]}}, "dynamic_batching.preferred_batch_size"),
        ({"serving": {**SERVING, "max_queue_delay_us": 10**9}}, "serving"),
        ({"serving": {**SERVING, "instance_count": 8}}, "instance_group"),
        ({"serving": SERVING, "note": "x" * 2001}, "note"),
    ],
)
def test_bad_input_is_a_400_naming_the_field_and_creates_nothing(ready, maintainer_client, body, field):
    ready.model.team.quota_model_instances = 2
    ready.model.team.save(update_fields=["quota_model_instances"])
    response = maintainer_client.post(derive_url(ready), body, format="json")
    assert response.status_code == 400, response.json()
    assert any(f == field or f.startswith(field) for f in response.json()["fields"]), response.json()
    assert ModelVersion.objects.filter(model=ready.model).count() == 1
    assert not AuditEvent.objects.filter(action="version.derived").exists()


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_config_is_refused_as_in_an_edit(ready, maintainer_client, case):
    change, field = CASES[case]
    response = maintainer_client.post(
        derive_url(ready), {"config_text": change(ready.config_text)}, format="json"
    )
    assert response.status_code == 400 and field in response.json()["fields"]
    assert ModelVersion.objects.filter(model=ready.model).count() == 1


def test_a_version_that_is_not_ready_is_refused_and_viewers_and_outsiders_cannot_derive(
    ready, maintainer_client, viewer_client, outsider_client
):
    assert viewer_client.post(derive_url(ready), {"serving": SERVING}, format="json").status_code == 403
    assert outsider_client.post(derive_url(ready), {"serving": SERVING}, format="json").status_code == 404
    ModelVersion.objects.filter(pk=ready.pk).update(state=VersionState.CONVERTING)
    response = maintainer_client.post(derive_url(ready), {"serving": SERVING}, format="json")
    assert response.status_code == 400 and "READY" in response.json()["fields"]["version"][0]
    assert ModelVersion.objects.filter(model=ready.model).count() == 1


def test_the_version_page_shows_the_serving_settings_and_creates_a_version_with_others(ready, client, owner):
    client.force_login(owner)
    page = f"/teams/vision/models/{ready.model.slug}/versions/{ready.number}/"
    html = client.get(page).content.decode()
    assert 'id="serving-settings-current"' in html and "batching max 8" in html
    assert html.count('id="id_note"') == 1 and 'id="id_serving-note"' in html  # the notes form keeps its ids
    fields = {
        "dynamic_batching": "on",
        "max_batch_size": "8",
        "max_queue_delay_us": "1000",
        "preferred": "4, 8",
        "instance_count": "1",
        "note": "",
    }
    form = {"op": "derive", **{f"serving-{k}": v for k, v in fields.items()}}
    response = client.post(page, {**form, "serving-preferred": "4, x"})
    assert response.status_code == 400 and "Give up to 16 batch sizes" in response.content.decode()
    response = client.post(page, {**form, "serving-preferred": "16"})
    assert response.status_code == 400 and "larger than max_batch_size 8" in response.content.decode()
    assert ModelVersion.objects.filter(model=ready.model).count() == 1
    response = client.post(page, form)
    assert response.status_code == 302
    assert response["Location"] == f"/teams/vision/models/{ready.model.slug}/versions/{ready.number + 1}/"
    derived = ModelVersion.objects.get(model=ready.model, number=ready.number + 1)
    assert "max_queue_delay_microseconds: 1000" in derived.config_text
    assert derived.note == f"Derived from version {ready.number} with new serving settings."
    assert "delay 1000 us, preferred 4,8" in client.get(response["Location"]).content.decode()
