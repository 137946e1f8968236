import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_has_every_service_with_a_healthcheck(compose):
    services = compose["services"]
    assert set(services) == {
        "postgres",
        "redis",
        "web",
        "agent-api",
        "worker",
        "beat",
        "gateway",
        "host-agent",
    }
    for name, service in services.items():
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"


def test_host_agent_mounts_the_npu_devices_and_driver_read_only(compose):
    agent = compose["services"]["host-agent"]
    devices = {entry.split(":")[0] for entry in agent["devices"]}
    assert {"/dev/davinci0", "/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"} <= devices
    assert "/usr/local/Ascend/driver:/usr/local/Ascend/driver:ro" in agent["volumes"]
    # The Dockerfile's host-agent stage: `python -m hostagent` is its entry point, Django is not in it.
    assert agent["build"]["target"] == "host-agent" and agent["command"][0] == "--platform"
    dockerfile = (ROOT / "Dockerfile").read_text()
    stage = dockerfile.split("AS host-agent", 1)[1].split("\nFROM ", 1)[0]
    assert 'ENTRYPOINT ["python", "-m", "hostagent"]' in stage
    assert "COPY apps" not in stage and "manage.py" not in stage and "npm" not in stage


def test_the_host_agent_holds_no_database_broker_or_platform_secret(compose):
    agent = compose["services"]["host-agent"]
    assert not {"DATABASE_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"} & set(agent["environment"])
    assert "artifacts:/artifacts" not in agent["volumes"]
    assert "SECRET_KEY" not in agent["environment"]


def test_platform_services_use_postgres_and_redis(compose):
    for name in ("web", "agent-api", "worker", "beat", "gateway"):
        env = compose["services"][name]["environment"]
        assert env["DATABASE_URL"].startswith("postgres://") and env["CELERY_BROKER_URL"].startswith(
            "redis://"
        )
        assert env["DEBUG"] == "0"


def _compose_command() -> list[str] | None:
    """`docker compose` (plugin) or the standalone `docker-compose`; either validates without an engine."""
    if (
        shutil.which("docker")
        and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
    ):
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


@pytest.mark.skipif(
    _compose_command() is None, reason="neither `docker compose` nor `docker-compose` is installed here"
)
def test_docker_compose_config_validates():
    result = subprocess.run(
        [*_compose_command(), "-f", str(COMPOSE), "config", "--quiet"],
        env={
            "PATH": "/usr/bin:/bin:/usr/local/bin",
            "SECRET_KEY": "x",
            "POSTGRES_PASSWORD": "y",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_the_agent_api_answers_agents_over_plain_http_without_a_redirect(compose):
    # The agents' PLATFORM_URL is http://agent-api:8000: a redirect to https would keep every agent from joining.
    assert compose["services"]["agent-api"]["environment"]["SECURE_SSL_REDIRECT"] == "0"
    assert compose["services"]["host-agent"]["command"][-1].startswith(
        "${PLATFORM_URL:-http://agent-api:8000}"
    )
