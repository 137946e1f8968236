"""The API says what it does: the schema's types match the answers, every error status an operation can give
is declared, JSON bodies are bounded, and beat starts on a fresh VAR_DIR whatever the broker."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from django.core.management import call_command

from apps.deployments import services as deployment_services
from tests.support.models import add_instance, make_version

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def schema(tmp_path_factory) -> dict:
    target = tmp_path_factory.mktemp("schema") / "schema.yaml"
    call_command("spectacular", "--file", str(target))
    return yaml.safe_load(target.read_text())


def response_schema(schema: dict, path: str, method: str = "get", code: str = "200") -> dict:
    return schema["paths"][path][method]["responses"][code]["content"]["application/json"]["schema"]


def test_fleet_and_model_metrics_are_documented_as_the_objects_they_return(schema):
    assert response_schema(schema, "/api/v1/metrics/fleet/") == {"$ref": "#/components/schemas/FleetMetrics"}
    model_path = "/api/v1/teams/{team_slug}/models/{model_slug}/metrics/"
    assert response_schema(schema, model_path) == {"$ref": "#/components/schemas/ModelMetrics"}


def test_a_conversion_jobs_toolchain_may_be_empty(schema):
    job = schema["components"]["schemas"]["ConversionJob"]["properties"]["toolchain"]
    refs = [choice["$ref"].rsplit("/", 1)[1] for choice in job["oneOf"]]
    assert refs == ["ToolchainEnum", "BlankEnum"]


def test_common_error_statuses_are_declared_on_every_operation(schema):
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            codes = set(operation["responses"])
            assert {"401", "403"} <= codes, (method, path)
            if "{" in path:
                assert "404" in codes, (method, path)
            if "requestBody" in operation:
                assert {"400", "413"} <= codes, (method, path)
    tokens = schema["paths"]["/api/v1/teams/{team_slug}/tokens/"]["post"]
    assert response_schema(schema, "/api/v1/teams/{team_slug}/tokens/", "post", "413") == {
        "$ref": "#/components/schemas/Error"
    }
    assert tokens["responses"]["401"]["description"] == "No valid session or API token."


@pytest.mark.django_db
def test_a_deployment_event_names_its_instance_or_none(owner_client, owner, team):
    from apps.fleet.models import Host
    from apps.registry.models import RegisteredModel

    shared_host = Host.objects.create(name="local", address="127.0.0.1")
    model = RegisteredModel.objects.create(team=team, name="Classifier", slug="classifier", created_by=owner)
    version = make_version(model, 1)
    instance = add_instance(shared_host)
    deployment = deployment_services.deploy_version(
        actor=owner, model=model, version=version, instances=[instance]
    )
    deployment.events.create(kind="serving", message="serves", instance=instance, version=version)
    events = owner_client.get(f"/api/v1/teams/vision/deployments/{deployment.pk}/").json()["events"]
    assert [e["instance"] for e in events] == ["local/cpu-0", None]  # newest first; the request had none


@pytest.mark.django_db
def test_a_json_body_over_django_s_upload_limit_is_413_in_the_error_shape(owner_client, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 4096
    body = '{"name": "ci", "padding": "' + "x" * 8192 + '"}'
    response = owner_client.post("/api/v1/teams/vision/tokens/", body, content_type="application/json")
    assert response.status_code == 413
    assert response.json() == {
        "error": "too_large",
        "message": "The request body is larger than the 0.00390625 MiB this endpoint accepts.",
    }


@pytest.mark.servers
def test_beat_starts_on_a_fresh_var_dir_with_redis(tmp_path):
    var = tmp_path / "var"
    env = dict(os.environ, VAR_DIR=str(var), DEBUG="1")
    env.update(
        CELERY_BROKER_URL="redis://127.0.0.1:6379/14", CELERY_RESULT_BACKEND="redis://127.0.0.1:6379/15"
    )
    env.pop("DATABASE_URL", None)
    beat = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "serving_platform", "beat", "--loglevel", "INFO"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and beat.poll() is None:
            if list((var / "celery").glob("beat-schedule*")):
                break
            time.sleep(0.2)
        # Nothing may happen: a beat that cannot use its schedule or its broker dies right after opening the
        # schedule file; a second of staying up is what this asserts.
        time.sleep(1)
        assert beat.poll() is None, beat.communicate()[0][-2000:]
        assert list((var / "celery").glob("beat-schedule*"))
    finally:
        beat.terminate()
        beat.wait(10)


@pytest.mark.django_db
def test_filters_take_only_values_the_database_can_hold(owner_client):
    # PostgreSQL refuses a UTC offset beyond 15:59; the filter hands it the time in UTC instead.
    far_offset = owner_client.get("/api/v1/teams/vision/audit-events/?since=0113-05-10T21:38:41-21:59")
    assert far_offset.status_code == 200
    too_early = owner_client.get("/api/v1/teams/vision/audit-events/?until=0001-01-01T00:00:00%2B05:00")
    assert too_early.status_code == 400 and "between the years 1 and 9999" in str(too_early.json()["fields"])
    huge_id = owner_client.get("/api/v1/teams/vision/conversion-jobs/?version=-1.8623158285658952e%2B101")
    assert huge_id.status_code == 400 and "version" in huge_id.json()["fields"]
