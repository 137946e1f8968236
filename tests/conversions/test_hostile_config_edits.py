"""Config edits (PUT .../versions/{n}/config/) get the same allow-list as uploads: a 400 lists every refused
field path with its reason, and neither the row nor the served file changes."""

from __future__ import annotations

import pytest

from apps.audit.models import AuditEvent
from tests.conversions.helpers import config_url, converted
from tests.registry.hostile_configs import CASES, instances

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def ready(make_version, mlp_bytes, owner, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no atc: the ONNX path, as on a CPU worker
    version, _ = converted(make_version, {"model.onnx": mlp_bytes}, owner)
    return version


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_config_edit_is_refused_naming_the_field(ready, maintainer_client, case):
    change, field = CASES[case]
    before = ready.config_text
    served = (ready.servable_dir() / "config.pbtxt").read_text()
    response = maintainer_client.put(config_url(ready), {"config_text": change(before)}, format="json")
    assert response.status_code == 400, response.json()
    body = response.json()
    assert body["error"] == "invalid" and field in body["fields"], body
    assert all(isinstance(m, str) and m for m in body["fields"][field])
    ready.refresh_from_db()
    assert ready.config_text == before
    assert (ready.servable_dir() / "config.pbtxt").read_text() == served
    assert not AuditEvent.objects.filter(action="version.config_updated").exists()


def test_every_refused_field_is_listed_in_one_response(ready, maintainer_client):
    text = (
        ready.config_text
        + '\ndefault_model_filename: "../../x.onnx"\nresponse_cache { enable: true }\n'
        + 'parameters { key: "EXECUTION_ENV_PATH" value { string_value: "/tmp/env" } }\n'
    )
    response = maintainer_client.put(config_url(ready), {"config_text": text}, format="json")
    assert response.status_code == 400
    fields = response.json()["fields"]
    assert {"default_model_filename", "response_cache", "parameters.EXECUTION_ENV_PATH"} <= set(fields)
    assert "file names are the platform's" in " ".join(fields["default_model_filename"])


def test_generated_config_round_trips_and_the_name_stays_the_platforms(ready, maintainer_client):
    text = ready.config_text.replace(f'name: "{ready.model.triton_model_name()}"', 'name: "other--model"')
    response = maintainer_client.put(config_url(ready), {"config_text": text}, format="json")
    assert response.status_code == 200, response.json()
    assert f'name: "{ready.model.triton_model_name()}"' in response.json()["config_text"]
    assert "other--model" not in response.json()["config_text"]


def test_config_edit_instance_count_is_bounded_by_the_teams_quota(ready, maintainer_client):
    team = ready.model.team
    team.quota_model_instances = 2
    team.save(update_fields=["quota_model_instances"])
    before = ready.config_text
    response = maintainer_client.put(
        config_url(ready), {"config_text": instances("instance_group { count: 3 }")(before)}, format="json"
    )
    assert response.status_code == 400, response.json()
    messages = response.json()["fields"]["instance_group[0].count"]
    assert "the team's limit (quota_model_instances) is 2" in messages[0], messages
    ready.refresh_from_db()
    assert ready.config_text == before
    response = maintainer_client.put(
        config_url(ready), {"config_text": instances("instance_group { count: 2 }")(before)}, format="json"
    )
    assert response.status_code == 200, response.json()
    assert "count: 2" in response.json()["config_text"]
