"""docker-compose.yml and an override rendered into one file, as ``docker compose -f A -f B config`` renders them.

podman-compose 1.0.3 (Debian 12's) merges lists by appending (an override cannot replace a healthcheck's or a
command's list, nor drop the NPU devices), knows neither ``!reset`` nor ``!override``, and leaves
``${VAR:-}`` uninterpolated. ``make stack-check`` therefore renders the two files here, following the Compose
specification's rules, and starts the result with podman-compose:

- interpolation: ``$$``, ``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?message}``,
  ``${VAR?message}``; a required variable that is missing stops the render with one line naming it;
- merge: mappings merge key by key; ``command``, ``entrypoint`` and a healthcheck's ``test`` are replaced;
  other sequences (ports, volumes, devices, ...) are appended, volumes by their target; ``!reset`` removes a
  value, ``!override`` replaces it whole.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from pathlib import Path

import yaml


class MissingVariable(ValueError):
    """A ``${VAR:?message}`` whose variable is not set: the one line a user reads."""


class _Reset:
    pass


class _Override:
    def __init__(self, value):
        self.value = value


class _Loader(yaml.SafeLoader):
    pass


def _reset(loader, node):
    return _Reset()


def _override(loader, node):
    if isinstance(node, yaml.MappingNode):
        return _Override(loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return _Override(loader.construct_sequence(node, deep=True))
    return _Override(loader.construct_scalar(node))


_Loader.add_constructor("!reset", _reset)
_Loader.add_constructor("!override", _override)

_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|(?P<named>[A-Za-z_][A-Za-z0-9_]*)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\})"
)
REPLACED = {"command", "entrypoint", "test"}


def interpolate(value, env: Mapping[str, str]):
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, _Override):
        return _Override(interpolate(value.value, env))
    if not isinstance(value, str):
        return value

    def one(match: re.Match) -> str:
        if match.group("escaped"):
            return "$$"  # kept escaped: the rendered file is interpolated once more by podman-compose
        name = match.group("named") or match.group("braced")
        op, arg = match.group("op"), match.group("arg") or ""
        current = env.get(name)
        unset = current is None or (op is not None and op.startswith(":") and current == "")
        if op in (":-", "-"):
            return _escape(arg if unset else current)
        if op in (":?", "?") and unset:
            raise MissingVariable(f"{name} is not set: {arg or 'it is required'}")
        return _escape(current or "")

    return _VARIABLE.sub(one, value)


def _escape(text: str) -> str:
    return text.replace("$", "$$")


def _volume_target(entry) -> str:
    if isinstance(entry, dict):
        return str(entry.get("target", ""))
    parts = str(entry).split(":")
    return parts[1] if len(parts) > 1 else parts[0]


def merge(base, override, key: str = ""):
    if isinstance(override, _Reset):
        return _Reset()
    if isinstance(override, _Override):
        return copy.deepcopy(override.value)
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for k, v in override.items():
            merged[k] = merge(base[k], v, k) if k in base else _strip(copy.deepcopy(v))
        return {k: v for k, v in merged.items() if not isinstance(v, _Reset)}
    if isinstance(base, list) and isinstance(override, list) and key not in REPLACED:
        if key == "volumes":
            targets = {_volume_target(v) for v in override}
            return [v for v in base if _volume_target(v) not in targets] + list(override)
        return list(base) + [v for v in override if v not in base]
    return copy.deepcopy(override)


def _strip(value):
    if isinstance(value, _Override):
        return value.value
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if not isinstance(v, _Reset)}
    return value


def load(path: Path):
    return yaml.load(path.read_text(), Loader=_Loader)


def render(files: list[Path], env: Mapping[str, str]) -> dict:
    """The merged, interpolated project; ``x-`` extension keys dropped as compose drops them."""
    result: dict = {}
    for path in files:
        document = interpolate(load(path), env)
        result = merge(result, document) if result else _strip(document)
    return {k: v for k, v in result.items() if not k.startswith("x-")}


def dump(project: dict) -> str:
    return yaml.safe_dump(project, sort_keys=False, width=1000)
