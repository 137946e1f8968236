"""The house's layer contract (``[tool.importlinter]`` in pyproject.toml): imports point downward only.

``lint-imports`` checks the layers, the declared order of the apps and the absence of cycles inside every
package. Two things it cannot see are checked here: a top-level package left out of the contract (it would
be read as a third-party package, its imports unchecked), and an import placed inside a function, which
hides a cycle from the reader even where the contract lists it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUR_PACKAGES = ("apps", "frontend", "serving_platform", "backend_ge", "hostagent", "tgp")
# Django imports these where an import at the top would run before the app registry is ready.
APP_REGISTRY_HOOKS = {"ready"}


def test_lint_imports_keeps_every_contract():
    lint_imports = Path(sys.executable).parent / "lint-imports"
    assert lint_imports.exists(), (
        f"{lint_imports} is missing: install the dev extra (pip install -e '.[dev]')"
    )
    result = subprocess.run(
        [str(lint_imports), "--no-cache", "--no-logo"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"lint-imports failed:\n{result.stdout}\n{result.stderr}"
    assert "0 broken" in result.stdout, result.stdout


def test_every_top_level_package_is_in_the_contract():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    packages = {path.parent.name for path in ROOT.glob("*/__init__.py") if path.parent.name != "tests"}
    assert packages == set(config["root_packages"]), (
        "root_packages of [tool.importlinter] must list every top-level package of the house"
    )


def _function_level_imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if path.name == "apps.py" and function.name in APP_REGISTRY_HOOKS:
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found += [(node.lineno, name) for name in names if name.split(".")[0] in OUR_PACKAGES]
    return found


def test_no_platform_module_imports_the_house_inside_a_function():
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for folder in ("apps", "frontend", "hostagent", "tgp")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if "node_modules" not in path.parts
        for line, name in _function_level_imports(path)
    ]
    assert not offenders, (
        "imports inside functions (move them to the top; a cycle means a layer is wrong):\n"
        + ("\n".join(offenders))
    )
