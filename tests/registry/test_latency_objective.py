"""A model's latency objective (what tuning measures a version's configs against): set over the API, on the
model page and with tgp; out of bounds is a 400 naming the field and changes nothing."""

from __future__ import annotations

import pytest

from apps.audit.models import AuditEvent
from apps.registry.models import RegisteredModel
from tests.registry.uploads import models_url

pytestmark = pytest.mark.django_db


def url() -> str:
    return f"{models_url()}resnet50/"


def test_a_maintainer_sets_changes_and_clears_the_objective(maintainer_client, model):
    response = maintainer_client.patch(url(), {"objective_p99_ms": 25}, format="json")
    assert response.status_code == 200, response.json()
    assert (response.json()["objective_p99_ms"], response.json()["objective_rate_rps"]) == (25.0, None)
    assert RegisteredModel.objects.get(pk=model.pk).latency_objective().describe() == (
        "the most throughput with p99 <= 25 ms"
    )
    response = maintainer_client.patch(
        url(), {"objective_p99_ms": 40, "objective_rate_rps": 200}, format="json"
    )
    assert response.status_code == 200
    assert (
        RegisteredModel.objects.get(pk=model.pk).latency_objective().describe()
        == "p99 <= 40 ms at 200 requests/s"
    )
    response = maintainer_client.patch(url(), {"objective_p99_ms": None}, format="json")
    assert response.json()["objective_p99_ms"] is None and response.json()["objective_rate_rps"] is None
    events = AuditEvent.objects.filter(action="model.objective_changed").order_by("pk")
    assert [e.details["to"] for e in events] == [
        {"p99_ms": 25.0, "rate_rps": None},
        {"p99_ms": 40.0, "rate_rps": 200.0},
        {"p99_ms": None, "rate_rps": None},
    ]
    # The same objective again records nothing.
    maintainer_client.patch(url(), {"objective_p99_ms": None}, format="json")
    assert events.count() == 3


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"objective_p99_ms": 0}, "objective_p99_ms"),
        ({"objective_p99_ms": -5}, "objective_p99_ms"),
        ({"objective_p99_ms": 600001}, "objective_p99_ms"),
        ({"objective_p99_ms": "fast"}, "objective_p99_ms"),
        ({"objective_p99_ms": 10, "objective_rate_rps": 0}, "objective_rate_rps"),
        ({"objective_p99_ms": 10, "objective_rate_rps": 1e9}, "objective_rate_rps"),
        ({"objective_p99_ms": None, "objective_rate_rps": 50}, "objective_rate_rps"),
        ({"objective_rate_rps": 50}, "objective_rate_rps"),
    ],
)
def test_an_objective_out_of_bounds_is_a_400_naming_the_field_and_changes_nothing(
    maintainer_client, model, body, field
):
    maintainer_client.patch(url(), {"objective_p99_ms": 30}, format="json")
    response = maintainer_client.patch(url(), {**body, "name": "renamed"}, format="json")
    assert response.status_code == 400, response.json()
    assert list(response.json()["fields"]) == [field]
    model.refresh_from_db()
    assert (model.objective_p99_ms, model.objective_rate_rps, model.name) == (30.0, None, "ResNet 50")


def test_viewers_read_the_objective_and_cannot_set_it_and_outsiders_see_nothing(
    maintainer_client, viewer_client, outsider_client, model
):
    maintainer_client.patch(url(), {"objective_p99_ms": 30}, format="json")
    assert viewer_client.get(url()).json()["objective_p99_ms"] == 30.0
    assert viewer_client.patch(url(), {"objective_p99_ms": 5}, format="json").status_code == 403
    assert outsider_client.patch(url(), {"objective_p99_ms": 5}, format="json").status_code == 404
    assert RegisteredModel.objects.get(pk=model.pk).objective_p99_ms == 30.0


def test_the_model_page_sets_the_objective_and_shows_field_errors(client, owner, model):
    client.force_login(owner)
    page = "/teams/vision/models/resnet50/"
    assert "none set" in client.get(page).content.decode()
    response = client.post(page, {"op": "objective", "objective_p99_ms": "12.5", "objective_rate_rps": "300"})
    assert response.status_code == 302
    html = client.get(page).content.decode()
    assert "p99 &lt;= 12.5 ms at 300 requests/s" in html
    response = client.post(page, {"op": "objective", "objective_p99_ms": "0", "objective_rate_rps": ""})
    assert response.status_code == 400
    assert "must be a number of milliseconds from 1 to 60000" in response.content.decode()
    response = client.post(page, {"op": "objective", "objective_p99_ms": "", "objective_rate_rps": ""})
    assert response.status_code == 302
    assert RegisteredModel.objects.get(pk=model.pk).latency_objective() is None
