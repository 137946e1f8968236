"""The documentation: every setting documented from one list, generated pages current, the site builds strictly."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from serving_platform import env
from serving_platform.config_reference import DERIVED, TYPES, VARIABLES

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = ROOT / "serving_platform" / "settings.py"
HELPERS = {"env_str", "env_bool", "env_int", "env_list"}


def _env_calls() -> list[ast.Call]:
    tree = ast.parse(SETTINGS.read_text())
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in HELPERS
    ]


def test_every_variable_settings_read_is_declared_with_its_type():
    calls = _env_calls()
    assert len(calls) > 80, "settings read their variables through the env helpers"
    read = {}
    for call in calls:
        first = call.args[0]
        assert isinstance(first, ast.Constant), f"line {call.lineno}: the variable's name must be a literal"
        name = first.value
        assert name in VARIABLES, f"{name} is read by settings but not declared in config_reference"
        var = VARIABLES[name]
        assert var.type in env._HELPER_TYPES[call.func.id], (
            f"{name}: declared {var.type}, read by {call.func.id}"
        )
        # The declaration owns the default and the minimum; only a DERIVED default is passed at the call.
        passed_default = len(call.args) > 1 or any(kw.arg == "default" for kw in call.keywords)
        assert passed_default == (var.default is DERIVED), f"{name}: default passed at line {call.lineno}"
        assert not any(kw.arg == "minimum" for kw in call.keywords), (
            f"{name}: minimum belongs to the declaration"
        )
        read[name] = call.lineno
    assert set(VARIABLES) == set(read), f"declared but never read: {sorted(set(VARIABLES) - set(read))}"


def test_declarations_are_well_formed():
    for var in VARIABLES.values():
        assert var.type in TYPES, var.name
        assert var.meaning.strip(), f"{var.name} has no meaning"
        if var.default is DERIVED:
            assert var.default_text, f"{var.name}: a derived default needs default_text"
        if var.minimum is not None:
            assert var.type == "int", var.name
            if var.default is not DERIVED:
                assert var.default >= var.minimum, var.name


def test_helpers_take_the_declared_default_and_minimum(monkeypatch):
    monkeypatch.delenv("GATEWAY_THREADS", raising=False)
    assert env.env_int("GATEWAY_THREADS") == VARIABLES["GATEWAY_THREADS"].default
    monkeypatch.setenv("GATEWAY_THREADS", "0")
    with pytest.raises(ImproperlyConfigured, match="below the minimum 1"):
        env.env_int("GATEWAY_THREADS")
    monkeypatch.delenv("GATEWAY_BIND", raising=False)
    assert env.env_str("GATEWAY_BIND") == "127.0.0.1:8080"


def test_helpers_refuse_a_read_that_disagrees_with_the_declaration():
    with pytest.raises(ImproperlyConfigured, match="its default is declared"):
        env.env_int("GATEWAY_THREADS", 4)
    with pytest.raises(ImproperlyConfigured, match="its minimum is declared"):
        env.env_int("GATEWAY_THREADS", minimum=0)
    with pytest.raises(ImproperlyConfigured, match="declared as int; env_bool cannot read it"):
        env.env_bool("GATEWAY_THREADS")
    with pytest.raises(ImproperlyConfigured, match="derived default: pass it"):
        env.env_bool("STATIC_MANIFEST")
    with pytest.raises(ImproperlyConfigured, match="not declared"):
        env.env_int("NOT_A_DECLARED_VARIABLE")


def _run(*args: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_generated_reference_pages_are_current():
    result = _run(sys.executable, "docs/generate_reference.py", "--check", timeout=120)
    assert result.returncode == 0, result.stderr + result.stdout
    page = (ROOT / "docs" / "operators" / "configuration-reference.md").read_text()
    for name in VARIABLES:
        assert f"`{name}`" in page


def test_mkdocs_builds_strictly(tmp_path):
    mkdocs = Path(sys.executable).parent / "mkdocs"
    assert mkdocs.exists(), "mkdocs is missing: pip install -e '.[dev]' installs it"
    result = _run(str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site"), timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "site" / "operators" / "configuration-reference" / "index.html").exists()


def test_readme_keeps_the_quick_start_and_links_every_page():
    readme = (ROOT / "README.md").read_text()
    assert "make run" in readme and "make test" in readme
    for page in (ROOT / "docs").rglob("*.md"):
        relative = page.relative_to(ROOT).as_posix()
        if relative != "docs/index.md":
            assert f"]({relative})" in readme, f"README does not link {relative}"
