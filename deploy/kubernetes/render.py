"""Render a kustomization of this folder without kubectl: the objects ``kubectl kustomize <dir>`` prints.

Only the kustomize features these manifests use are implemented - ``resources`` (files and folders),
``secretGenerator``/``configMapGenerator`` from env files (with ``disableNameSuffixHash``) and ``patches``
holding JSON 6902 operations with a kind/name target - and anything else is refused, so a manifest change
that needs more fails here instead of rendering differently. The test suite compares this with
``kubectl kustomize`` wherever kubectl is installed.

    python deploy/kubernetes/render.py deploy/kubernetes/overlays/example
"""

from __future__ import annotations

import base64
import copy
import sys
from pathlib import Path

import yaml

KNOWN_KEYS = {"apiVersion", "kind", "resources", "patches", "secretGenerator", "configMapGenerator",
              "generatorOptions"}  # fmt: skip


class RenderError(ValueError):
    """The kustomization uses something this renderer does not implement, or a patch does not apply."""


def _env_file(path: Path) -> dict[str, str]:
    data = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            if not sep:
                raise RenderError(f"{path}: {line!r} is not KEY=value")
            data[key] = value
    return data


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise RenderError(f"JSON pointer {path!r} must start with /")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def apply_json6902(document: dict, operations: list[dict]) -> dict:
    """RFC 6902 add, remove and replace (the operations the overlays use) on a copy of ``document``."""
    document = copy.deepcopy(document)
    for operation in operations:
        op, parts = operation["op"], _pointer(operation["path"])
        parent = document
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent[part]
        last = parts[-1]
        if isinstance(parent, list):
            index = len(parent) if last == "-" else int(last)
            if op == "add":
                parent.insert(index, operation["value"])
            elif op in ("remove", "replace"):
                if op == "remove":
                    del parent[index]
                else:
                    parent[index] = operation["value"]
            else:
                raise RenderError(f"JSON patch op {op!r} is not implemented")
            continue
        if op == "add":
            parent[last] = operation["value"]
        elif op in ("remove", "replace"):
            if last not in parent:
                raise RenderError(f"{operation['path']} does not exist ({op})")
            if op == "remove":
                del parent[last]
            else:
                parent[last] = operation["value"]
        else:
            raise RenderError(f"JSON patch op {op!r} is not implemented")
    return document


def _generated(kind: str, spec: dict, folder: Path) -> dict:
    data: dict[str, str] = {}
    for env in spec.get("envs", []):
        data.update(_env_file(folder / env))
    unknown = set(spec) - {"name", "namespace", "envs", "behavior"}
    if unknown:
        raise RenderError(f"{folder}: {kind} generator keys {sorted(unknown)} are not implemented")
    metadata = {"name": spec["name"]}
    if "namespace" in spec:
        metadata["namespace"] = spec["namespace"]
    if kind == "Secret":
        encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
        return {"apiVersion": "v1", "kind": "Secret", "metadata": metadata, "type": "Opaque", "data": encoded}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}


def render(folder: Path) -> list[dict]:
    """The objects of the kustomization in ``folder``, in file order."""
    folder = Path(folder)
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KNOWN_KEYS
    if unknown:
        raise RenderError(f"{folder}: kustomization keys {sorted(unknown)} are not implemented")
    objects: list[dict] = []
    for resource in kustomization.get("resources", []):
        path = folder / resource
        if path.is_dir():
            objects += render(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    generators = [("Secret", s) for s in kustomization.get("secretGenerator", [])]
    generators += [("ConfigMap", s) for s in kustomization.get("configMapGenerator", [])]
    if generators and not kustomization.get("generatorOptions", {}).get("disableNameSuffixHash"):
        raise RenderError(f"{folder}: generated names need generatorOptions.disableNameSuffixHash: true")
    for kind, spec in generators:
        made = _generated(kind, spec, folder)
        behavior = spec.get("behavior", "create")
        existing = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == spec["name"]]
        if behavior == "create":
            if existing:
                raise RenderError(f"{folder}: {kind} {spec['name']} exists already (behavior: create)")
            objects.append(made)
        elif behavior == "merge" and existing:
            existing[0].setdefault("data", {}).update(made["data"])
        else:
            raise RenderError(f"{folder}: generator behavior {behavior!r} is not implemented here")
    for patch in kustomization.get("patches", []):
        target = patch.get("target", {})
        if set(target) - {"kind", "name"} or set(patch) - {"path", "target"}:
            raise RenderError(f"{folder}: only patches with path and a kind/name target are implemented")
        operations = yaml.safe_load((folder / patch["path"]).read_text())
        hits = [
            i
            for i, o in enumerate(objects)
            if o["kind"] == target.get("kind", o["kind"])
            and o["metadata"]["name"] == target.get("name", o["metadata"]["name"])
        ]
        if not hits:
            raise RenderError(f"{folder}: patch {patch['path']} matches no object")
        for i in hits:
            objects[i] = apply_json6902(objects[i], operations)
    return objects


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python deploy/kubernetes/render.py <kustomization folder>", file=sys.stderr)
        return 2
    print(yaml.safe_dump_all(render(Path(argv[0])), sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
