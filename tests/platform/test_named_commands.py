"""Every command a page, a doc or a message names exists: ``manage.py <command>`` is a registered management
command, ``python -m <module>`` is importable and runnable, ``make <target>`` is a Makefile target and
``tgp <subcommand>`` is one of the command line's. Only code is read (Markdown code spans and blocks, HTML
``<code>``, Python's ``...``/``...`` spans in strings and docstrings): prose that says "make room" is not a
command."""

from __future__ import annotations

import ast
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
from django.core.management import get_commands

from tgp.cli import cli as tgp_cli

ROOT = Path(__file__).resolve().parents[2]
PYTHON_PACKAGES = ("apps", "serving_platform", "hostagent", "backend_ge", "tgp", "frontend")

_MANAGE = re.compile(r"manage\.py\s+([a-z][a-z0-9_]*)")
_PYTHON_M = re.compile(r"(?:^|[\s/;&|(])python3?(?:\.\d+)?\s+-m\s+([A-Za-z_][\w.]*)")
_MAKE = re.compile(r"(?:^|[\s;&|(])make\s+(?:-\S+\s+)*([a-z][\w-]*)(?![\w-]*=)")
_TGP = re.compile(r"(?:^|[\s;&|(])tgp\s+([a-z][\w-]*)(?:\s+([a-z][\w-]*))?")


@dataclass(frozen=True)
class Named:
    kind: str  # manage.py | python -m | make | tgp
    name: str  # the command, module, target or "subcommand [subsubcommand]"
    where: str  # file:line


# --- where code is written --------------------------------------------------------------------------


def _markdown_code(text: str) -> list[tuple[int, str]]:
    spans = []
    for match in re.finditer(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M):
        spans.append((match.start(1), match.group(1)))
    prose = re.sub(r"^```[^\n]*\n(.*?)^```", lambda m: " " * len(m.group(0)), text, flags=re.S | re.M)
    for match in re.finditer(r"(`+)(.+?)\1", prose, re.S):
        spans.append((match.start(2), match.group(2)))
    return [(text.count("\n", 0, start) + 1, code) for start, code in spans]


def _html_code(text: str) -> list[tuple[int, str]]:
    return [
        (text.count("\n", 0, m.start(1)) + 1, re.sub(r"{{.*?}}|{%.*?%}", "X", m.group(1), flags=re.S))
        for m in re.finditer(r"<code[^>]*>(.*?)</code>", text, re.S)
    ]


def _python_code(text: str) -> list[tuple[int, str]]:
    spans = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            for match in re.finditer(r"(`+)(.+?)\1", node.value, re.S):
                spans.append((node.lineno, match.group(2)))
    return spans


def _sources() -> list[tuple[Path, list[tuple[int, str]]]]:
    found = []
    for path in sorted([*(ROOT / "docs").rglob("*.md"), ROOT / "README.md"]):
        found.append((path, _markdown_code(path.read_text())))
    for path in sorted((ROOT / "frontend" / "templates").rglob("*.html")):
        found.append((path, _html_code(path.read_text())))
    for package in PYTHON_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "node_modules" not in path.parts and "migrations" not in path.parts:
                found.append((path, _python_code(path.read_text())))
    return found


def named_commands(code: str, where: str) -> list[Named]:
    named = [Named("manage.py", m.group(1), where) for m in _MANAGE.finditer(code)]
    named += [Named("python -m", m.group(1), where) for m in _PYTHON_M.finditer(code)]
    named += [Named("make", m.group(1), where) for m in _MAKE.finditer(code)]
    named += [Named("tgp", " ".join(filter(None, m.groups())), where) for m in _TGP.finditer(code)]
    return named


def _all_named() -> list[Named]:
    named = []
    for path, spans in _sources():
        for line, code in spans:
            named += named_commands(code, f"{path.relative_to(ROOT)}:{line}")
    return named


# --- what exists ------------------------------------------------------------------------------------


def _make_targets() -> set[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        match = re.match(r"^([A-Za-z][\w.-]*(?:\s+[A-Za-z][\w.-]*)*)\s*:(?![=:])", line)
        if match:
            targets.update(match.group(1).split())
    return targets


def _runnable_module(name: str) -> bool:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if spec.submodule_search_locations is not None:  # a package: needs its __main__
        return importlib.util.find_spec(f"{name}.__main__") is not None
    origin = Path(spec.origin or "")
    if ROOT in origin.parents:  # one of ours: it must run something when run
        return '__name__ == "__main__"' in origin.read_text()
    return True


def _tgp_exists(words: str) -> bool:
    command: click.Command = tgp_cli
    for i, word in enumerate(words.split()):
        if not isinstance(command, click.Group):
            return i > 0  # the rest are arguments (a model's name)
        sub = command.commands.get(word)
        if sub is None:
            return False
        command = sub
    return True


def missing(named: list[Named]) -> list[str]:
    commands, targets = set(get_commands()), _make_targets()
    checks = {
        "manage.py": lambda n: n in commands,
        "python -m": _runnable_module,
        "make": lambda n: n in targets,
        "tgp": _tgp_exists,
    }
    return [f"{n.where}: `{n.kind} {n.name}` does not exist" for n in named if not checks[n.kind](n.name)]


# --- the tests ----------------------------------------------------------------------------------------


def test_every_command_the_docs_pages_and_messages_name_exists():
    named = _all_named()
    kinds = {n.kind for n in named}
    assert kinds == {"manage.py", "python -m", "make", "tgp"}, f"the scan found only {kinds}"
    assert len(named) > 60, f"only {len(named)} commands found: the scan is broken"
    assert missing(named) == []


def test_the_hosts_page_names_the_host_agent_as_it_is_run():
    pages = {n.name for n in _all_named() if n.where.startswith("frontend/templates/frontend/fleet/")}
    assert "hostagent" in pages


@pytest.mark.parametrize(
    ("code", "problem"),
    [
        ("python manage.py hostagent --platform X", "`manage.py hostagent` does not exist"),
        ("python -m hostagent.nonexistent", "`python -m hostagent.nonexistent` does not exist"),
        ("python -m apps.fleet", "`python -m apps.fleet` does not exist"),  # a package without __main__
        ("make images-of-nothing", "`make images-of-nothing` does not exist"),
        ("tgp deploy-everything", "`tgp deploy-everything` does not exist"),
        ("tgp rollout restart", "`tgp rollout restart` does not exist"),
    ],
)
def test_a_command_that_does_not_exist_is_reported(code, problem):
    assert missing(named_commands(code, "page:1")) == [f"page:1: {problem}"]


@pytest.mark.parametrize(
    "code",
    [
        "python -m hostagent --platform https://p.example.com",
        "python manage.py gateway",
        "make test PYTEST_ARGS=-x",
        "tgp rollout status my-model",
        "tgp deploy my-model --replicas 2",
        "python -m apps.registry.onnx_check model.onnx root",
    ],
)
def test_commands_that_exist_pass(code):
    assert named_commands(code, "page:1"), code
    assert missing(named_commands(code, "page:1")) == []


def test_prose_is_not_read_as_a_command():
    assert named_commands("make room for the new model", "page:1") != []  # the pattern alone would match...
    assert _markdown_code("Evictions make room for it; run `make run`.") == [(1, "make run")]  # ...code only
