"""deploy/compose/render.py renders docker-compose.yml with an override as the Compose specification merges
them (what `make stack-check` starts with podman-compose): interpolation, required variables, replaced and
appended lists, ``!reset`` and ``!override``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("compose_render", ROOT / "deploy" / "compose" / "render.py")
render = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render)

STACK_ENV = {
    "SECRET_KEY": "k" * 50,
    "POSTGRES_PASSWORD": "pw",
    **{
        f"STACK_{name}_PORT": str(port)
        for port, name in enumerate(
            ("PG", "REDIS", "WEB", "AGENT_API", "GATEWAY", "GATEWAY_GRPC", "GATEWAY_STATS"), start=41000
        )
    },
}


def stack(env=STACK_ENV) -> dict:
    return render.render([ROOT / "docker-compose.yml", ROOT / "deploy" / "compose" / "stack-check.yml"], env)


def test_interpolation_follows_the_compose_rules():
    env = {"SET": "a", "EMPTY": ""}
    assert (
        render.interpolate("${SET}-${EMPTY:-d}-${EMPTY-d}-${UNSET-d}-$SET-$$HOME", env) == "a-d--d-a-$$HOME"
    )
    assert render.interpolate("${UNSET:-}", env) == ""
    assert render.interpolate("x$${SET}", env) == "x$${SET}"  # escaped stays escaped for podman-compose
    with pytest.raises(render.MissingVariable, match="^EMPTY is not set: give it$"):
        render.interpolate("${EMPTY:?give it}", env)
    assert render.interpolate("${EMPTY?give it}", env) == ""


@pytest.mark.parametrize("missing", ["SECRET_KEY", "POSTGRES_PASSWORD"])
def test_the_stack_refuses_to_render_without_a_secret_and_names_it_on_one_line(missing):
    env = {k: v for k, v in STACK_ENV.items() if k != missing}
    with pytest.raises(render.MissingVariable) as refused:
        stack(env)
    assert str(refused.value).startswith(f"{missing} is not set: set {missing}")
    assert "\n" not in str(refused.value)


def test_merge_replaces_commands_and_tests_appends_other_lists_and_honours_reset_and_override(tmp_path):
    (tmp_path / "a.yml").write_text(
        "services:\n  s:\n    command: [a, b]\n    ports: ['1:1']\n    devices: [/dev/x]\n"
        "    volumes: ['v:/data', 'w:/other']\n    healthcheck: {test: [CMD, old], interval: 5s}\n"
        "    environment: {A: '1', B: '2'}\n"
    )
    (tmp_path / "b.yml").write_text(
        "services:\n  s:\n    command: [c]\n    ports: ['2:2']\n    devices: !reset []\n"
        "    volumes: ['u:/data']\n    healthcheck: {test: [CMD, new]}\n    environment: !override {C: '3'}\n"
    )
    s = render.render([tmp_path / "a.yml", tmp_path / "b.yml"], {})["services"]["s"]
    assert s["command"] == ["c"]
    assert s["ports"] == ["1:1", "2:2"]
    assert "devices" not in s
    assert s["volumes"] == ["w:/other", "u:/data"]
    assert s["healthcheck"] == {"test": ["CMD", "new"], "interval": "5s"}
    assert s["environment"] == {"C": "3"}


def test_the_stack_check_override_changes_only_what_this_machine_needs():
    plain = render.render([ROOT / "docker-compose.yml"], STACK_ENV)["services"]
    checked = stack()["services"]
    assert set(checked) == set(plain)
    for name in ("postgres", "redis"):
        assert checked[name]["image"] == "triton-ge-stack-data:latest" != plain[name]["image"]
        assert checked[name]["healthcheck"] == plain[name]["healthcheck"]
    for name, service in checked.items():
        assert service["network_mode"] == "host" and "ports" not in service
        assert service["restart"] == plain[name]["restart"]
        assert service["healthcheck"]["test"] == plain[name]["healthcheck"]["test"]
        assert service.get("command") == plain[name].get("command")
    agent = checked["host-agent"]
    assert "devices" not in agent and agent["volumes"] == ["fleet:/fleet"]
    assert not {"DATABASE_URL", "SECRET_KEY", "CELERY_BROKER_URL"} & set(agent["environment"])
    web = checked["web"]["environment"]
    assert web["DATABASE_URL"] == "postgres://platform:pw@127.0.0.1:41000/platform"
    assert web["WEB_BIND"] == "127.0.0.1:41002" and web["SECRET_KEY"] == "k" * 50
    assert "$$WEB_BIND" in checked["web"]["command"][-1]


def test_the_stack_checks_pass_over_only_postgresqls_refusals_while_it_starts_or_stops():
    """A log line at ERROR fails the stack checks; PostgreSQL's FATAL for a connection it refuses while it
    starts (its readiness probe's, by design) is the one exception, and no other FATAL passes with it."""
    spec = importlib.util.spec_from_file_location("deploy_images", ROOT / "deploy" / "images.py")
    images = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(images)
    prefix = "2026-12-07 16:43:12.516 UTC [16] "
    assert images.expected_refusal(prefix + "FATAL:  the database system is starting up")
    assert images.expected_refusal(prefix + "FATAL:  the database system is shutting down")
    assert not images.expected_refusal(prefix + 'FATAL:  password authentication failed for user "platform"')
    assert not images.expected_refusal(prefix + 'FATAL:  database "platform" does not exist')
    assert not images.expected_refusal("ERROR apps.gateway.services: gateway sync failed")
