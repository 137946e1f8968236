import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command

from serving_platform import env
from serving_platform.celery import app as celery_app
from serving_platform.celery import host_queue

ROOT = Path(__file__).resolve().parents[2]


def test_healthz_answers_without_database(client):
    response = client.get("/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


@pytest.mark.django_db
def test_readyz_reports_database_and_broker(client):
    response = client.get("/readyz")
    body = response.json()
    assert response.status_code == 200, body
    assert body["status"] == "ready"
    assert body["checks"]["database"]["ok"] and body["checks"]["broker"]["ok"]


@pytest.mark.django_db
def test_readyz_is_503_with_detail_when_broker_is_down(client, settings):
    settings.CELERY_BROKER_URL = "redis://127.0.0.1:1/0"
    response = client.get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert body["checks"]["database"]["ok"] is True
    assert body["checks"]["broker"]["ok"] is False and body["checks"]["broker"]["error"]


def test_env_helpers_fail_loudly(monkeypatch):
    monkeypatch.setenv("X_FLAG", "maybe")
    with pytest.raises(ImproperlyConfigured, match="X_FLAG='maybe' is not a boolean"):
        env.env_bool("X_FLAG", False)
    monkeypatch.setenv("X_NUM", "ten")
    with pytest.raises(ImproperlyConfigured, match="not an integer"):
        env.env_int("X_NUM", 1)
    monkeypatch.setenv("X_NUM", "-5")
    with pytest.raises(ImproperlyConfigured, match="below the minimum"):
        env.env_int("X_NUM", 1, minimum=0)
    monkeypatch.setenv("X_LIST", "a, b,,c")
    assert env.env_list("X_LIST", []) == ["a", "b", "c"]
    monkeypatch.setenv("X_FLAG", "Off")
    assert env.env_bool("X_FLAG", True) is False


def _production_env(**extra) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in {"DEBUG", "SECRET_KEY"}}
    return {**clean, "DEBUG": "0", "ALLOWED_HOSTS": "platform.example.com", **extra}


def test_secret_key_is_required_when_debug_is_off():
    result = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env=_production_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "SECRET_KEY is required when DEBUG is off" in result.stderr


def test_deploy_check_passes_with_production_settings():
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env=_production_env(SECRET_KEY="x" * 20 + "Q7-vL9#pZ2@kR4!mW8$tY1%nB6^cF3&hJ5*"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_bad_environment_value_stops_startup():
    result = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env={**os.environ, "DEBUG": "perhaps"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "DEBUG='perhaps' is not a boolean" in result.stderr


def test_openapi_schema_generates_without_warnings(tmp_path):
    target = tmp_path / "schema.yaml"
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(target))
    text = target.read_text()
    for path in (
        "/api/v1/me/",
        "/api/v1/teams/{team_slug}/tokens/",
        "/api/v1/teams/{team_slug}/audit-events/",
    ):
        assert path in text
    assert "bearerToken" in text


@pytest.mark.django_db
def test_schema_and_docs_pages_are_served(client):
    assert client.get("/api/schema/").status_code == 200
    docs = client.get("/api/docs/")
    assert docs.status_code == 200
    # Swagger UI comes from the npm package, not from a CDN.
    assert b"/static/vendor/swagger-ui/swagger-ui-bundle.js" in docs.content


def test_celery_reliability_settings():
    conf = celery_app.conf
    from django.conf import settings

    assert conf.task_acks_late is True and conf.task_reject_on_worker_lost is True
    assert conf.worker_prefetch_multiplier == 1
    assert conf.broker_transport_options["visibility_timeout"] > settings.CONVERSION_TIME_LIMIT
    assert {q.name for q in conf.task_queues} == {"default", "conversions"}
    assert conf.task_default_queue == "default"
    assert host_queue("npu-01") == "host.npu-01"
    celery_app.loader.import_default_modules()  # what a worker does at start
    for entry in conf.beat_schedule.values():
        assert entry["task"] in celery_app.tasks, entry["task"]


@pytest.mark.django_db
def test_pagination_refuses_unordered_querysets(rf):
    from rest_framework.request import Request

    from apps.core.pagination import OrderedPageNumberPagination
    from apps.teams.models import Team

    request = Request(rf.get("/"))
    with pytest.raises(ImproperlyConfigured, match="unordered"):
        OrderedPageNumberPagination().paginate_queryset(Team.objects.order_by(), request, view=object())


@pytest.mark.django_db
def test_api_404_for_unknown_object_is_json(owner_client, team):
    response = owner_client.get("/api/v1/teams/vision/members/999999/")
    assert response.status_code == 404 and response.json()["error"] == "not_found"


@pytest.mark.django_db
def test_bootstrap_demo_is_idempotent(settings, tmp_path, capsys):
    from apps.teams.models import Membership

    settings.VAR_DIR = tmp_path
    settings.DEMO_PASSWORD = None
    call_command("bootstrap_demo")
    first = capsys.readouterr().out
    call_command("bootstrap_demo")
    second = capsys.readouterr().out
    password = (tmp_path / "demo_password").read_text().strip()
    assert f"password '{password}'" in first and f"password '{password}'" in second
    assert Membership.objects.filter(user__username="admin", team__slug="demo", role="owner").count() == 1


@pytest.mark.django_db
def test_unknown_api_url_is_a_json_404(owner_client):
    response = owner_client.get("/api/v1/no-such-thing/")
    assert response.status_code == 404
    assert response.json()["error"] == "not_found" and "/api/docs/" in response.json()["message"]


def test_processes_started_together_on_a_fresh_var_dir_share_one_whole_secret_key(tmp_path):
    """`make run` starts web, worker and beat at once: each must read the same key, none an empty file."""
    env = {k: v for k, v in os.environ.items() if k != "SECRET_KEY"}
    env.update(DEBUG="1", VAR_DIR=str(tmp_path))
    script = "from django.conf import settings; import django; django.setup(); print(settings.SECRET_KEY)"
    env["DJANGO_SETTINGS_MODULE"] = "serving_platform.settings"
    starts = [
        subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(6)
    ]
    keys = {process.communicate(timeout=120)[0].strip() for process in starts}
    assert all(process.returncode == 0 for process in starts)
    key_file = tmp_path / "secret_key"
    assert keys == {key_file.read_text().strip()} and len(keys.pop()) >= 50
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert not list(tmp_path.glob(".secret_key.*")), "a draft key was left behind"
