"""The fleet sits below the deployments: it executes and reports, and never imports the apps built on it."""

from __future__ import annotations

import ast
from pathlib import Path

FLEET = Path(__file__).resolve().parents[2] / "apps" / "fleet"
ABOVE = ("apps.deployments", "apps.monitoring", "apps.gateway", "frontend")


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_no_fleet_module_imports_an_app_above_it_even_inside_a_function():
    offenders = {
        f"{path.relative_to(FLEET)}: {name}"
        for path in FLEET.rglob("*.py")
        for name in imported_modules(path)
        if name.startswith(ABOVE)
    }
    assert not offenders, sorted(offenders)
