"""The host agent is a program of its own: it imports and runs without Django, and its configuration is one
typed object read from flags and the environment that refuses a bad value at start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hostagent import config as agent_config

ROOT = Path(__file__).resolve().parents[2]
WITHOUT_DJANGO = ROOT / "tests" / "without_django"


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter where Django and the platform's packages cannot be imported."""
    environ = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(WITHOUT_DJANGO), **env}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=120
    )


def test_every_module_of_the_agent_imports_and_runs_without_django():
    code = """
import pkgutil, importlib, sys, tempfile
import hostagent
for module in pkgutil.iter_modules(hostagent.__path__):
    if module.name != "__main__":
        importlib.import_module(f"hostagent.{module.name}")
from hostagent.config import AgentConfig
from hostagent.supervisor import HostAgent

class Platform:
    def desired_state(self, etag, wait=0):
        return '"3"', {"generation": 3, "instances": [], "placements": [], "versions": {}}

agent = HostAgent(Platform(), "h", AgentConfig(platform="http://127.0.0.1:1", root=tempfile.mkdtemp()))
assert agent.fetch_desired_state(force=True) and agent.desired.generation == 3
agent.reconcile()
assert "django" not in sys.modules and not any(m.split(".")[0] == "apps" for m in sys.modules), sorted(sys.modules)
print("ok")
"""
    result = run_python(code)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_the_import_guard_really_refuses_django():
    # The check above would pass vacuously if the guard let Django in.
    result = run_python("import django")
    assert result.returncode != 0 and "not installed on an inference host" in result.stderr


def test_help_lists_every_option_with_its_environment_variable():
    result = run_python("from hostagent.cli import main; main(['--help'])")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps lines at the terminal's width
    for option in agent_config.OPTIONS.values():
        assert option.flag in text and f"env {option.env};" in text, option


def test_flags_win_over_the_environment_and_paths_are_made_absolute(tmp_path):
    env = {
        "PLATFORM_URL": "http://platform.example:8000",
        "FLEET_MAX_CRASHES": "7",
        "FLEET_ROOT": str(tmp_path),
    }
    config = agent_config.load(["--max-crashes", "3", "--private-path", "a", "--private-path", "/b"], env)
    assert config.platform == "http://platform.example:8000" and config.max_crashes == 3
    assert config.root == tmp_path and config.credential_file == tmp_path / "host-credential"
    assert config.cache_dir == tmp_path / "cache"
    assert config.private_paths == (Path("a").absolute(), Path("/b"))
    from_env = agent_config.load([], {**env, "AGENT_PRIVATE_PATHS": "/x:/y"})
    assert from_env.max_crashes == 7 and from_env.private_paths == (Path("/x"), Path("/y"))


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {}, "Give the platform's URL"),
        (["--platform", "platform.example"], {}, "is not an http(s) URL"),
        (
            ["--platform", "http://p"],
            {"FLEET_MAX_CRASHES": "many"},
            "FLEET_MAX_CRASHES = 'many' is not an integer",
        ),
        (
            ["--platform", "http://p", "--max-crashes", "0"],
            {},
            "--max-crashes (FLEET_MAX_CRASHES) = 0 is below",
        ),
        (["--platform", "http://p"], {"FLEET_RECONCILE_INTERVAL_MS": "10"}, "is below the minimum 50"),
        (["--platform", "http://p", "--wait", "soon"], {}, "--wait = 'soon' is not a number"),
        (
            ["--platform", "http://p", "--log-level", "LOUD"],
            {},
            "--log-level (AGENT_LOG_LEVEL) must be one of",
        ),
    ],
)
def test_a_bad_value_stops_the_agent_naming_the_option(argv, env, message):
    with pytest.raises(agent_config.ConfigError) as error:
        agent_config.load(argv, env)
    assert message in str(error.value)


def test_the_program_exits_2_with_the_message_on_a_bad_value():
    result = run_python("from hostagent.cli import main; raise SystemExit(main([]))")
    assert result.returncode == 2
    assert "python -m hostagent: error: Give the platform's URL" in result.stderr


def test_without_a_credential_or_join_token_the_agent_says_what_to_do(tmp_path):
    result = run_python(
        "from hostagent.cli import main; raise SystemExit(main(['--platform', 'http://127.0.0.1:9']))",
        FLEET_ROOT=str(tmp_path),
    )
    assert result.returncode == 1
    assert (
        f"No host credential in {tmp_path / 'host-credential'}: start once with --join-token" in result.stderr
    )
