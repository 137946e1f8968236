"""One writer per model: ``apps.deployments.services`` writes deployments, placements and events (the agents'
reports on placements in ``apps.deployments.reports``), ``apps.deployments.scheduler`` places replicas
(creates and retires placements, with their events; an ensemble's steps in ``.ensemble_placing``), and
``apps.deployments.rollouts`` (the rollout state machine's owner) writes rollouts and their analyses. Every
other module of the platform - signal receivers, other apps, pages - calls them instead of writing rows.

The check reads the source (``ast``) of ``apps/`` and ``frontend/``: a write is a call of a write method
(``create``, ``update``, ``save``, ``delete``, ``bulk_*``, ``*_or_create``, and ``add``/``set``/``remove``/
``clear`` on the deployment's instances) on something that leads to one of the five models - the model class
itself, a related manager (``.placements``, ``.events``, ``.rollouts``, ``.analyses``, ``.deployments``), or
a name bound to such a thing in the same function (an assignment, a ``for`` loop, a parameter annotated with
one of the models or named like one). Raw SQL naming their tables counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("apps", "frontend")

OWNERS = {
    "apps/deployments/services.py": {"Deployment", "DeploymentInstance", "DeploymentEvent"},
    # The scheduler's decisions are placements: it creates, retires and releases them, records why replicas
    # are pending (and PENDING <-> DEPLOYING), and writes each decision's event. What a deployment's state
    # becomes from its placements' reports stays with services.
    "apps/deployments/scheduler.py": {"Deployment", "DeploymentInstance", "DeploymentEvent"},
    # The scheduler's decisions for an ensemble's steps: the step replicas placed with an ensemble's replica
    # (a step deployment's replicas grow by one where it lacked none; PENDING -> DEPLOYING), with events.
    "apps/deployments/ensemble_placing.py": {"Deployment", "DeploymentInstance", "DeploymentEvent"},
    # The agents' reports: the placement a report is about (fenced on its generation) and its event. What the
    # deployment's state becomes from them is settled by services.
    "apps/deployments/reports.py": {"DeploymentInstance", "DeploymentEvent"},
    "apps/deployments/rollouts.py": {"Rollout", "RolloutAnalysis"},
    # The autoscaler's decisions are replica counts (sleep and wake too), each with its event; the
    # placements they lead to are the scheduler's.
    "apps/deployments/autoscaling.py": {"Deployment", "DeploymentEvent", "ReplicaSample"},
    # Drain, then unload: the gateway's marks and confirmations and the unload hand-over, with their events.
    "apps/deployments/draining.py": {"DeploymentInstance", "DeploymentEvent"},
}
MODELS = {
    "Deployment",
    "DeploymentInstance",
    "DeploymentEvent",
    "Rollout",
    "RolloutAnalysis",
    "ReplicaSample",
}
# Related managers and foreign keys that reach the five models' rows (from a team, a model, an instance or
# each other), and the names the codebase gives such rows: a name or attribute so called holds one.
RELATED = {
    "deployments": "Deployment",
    "placements": "DeploymentInstance",
    "events": "DeploymentEvent",
    "rollouts": "Rollout",
    "analyses": "RolloutAnalysis",
    "replica_samples": "ReplicaSample",
}
ROW_NAMES = {
    "deployment": "Deployment",
    "placement": "DeploymentInstance",
    "event": "DeploymentEvent",
    "rollout": "Rollout",
    "analysis": "RolloutAnalysis",
}
WRITES = {
    "create",
    "bulk_create",
    "get_or_create",
    "update_or_create",
    "update",
    "bulk_update",
    "delete",
    "save",
}
M2M_WRITES = {"add", "set", "remove", "clear"}  # on ``deployment.instances`` (through DeploymentInstance)
TABLES = ("deployments_deployment", "deployments_rollout")  # every table of the five starts so

# Calls the check reports that write none of the five models, as "path: call" -> why. Empty today; an entry
# is a blind spot of the check (a name it believes holds rows and does not), never a second writer.
ALLOWED: dict[str, str] = {}


def _annotation_names(node: ast.expr | None) -> set[str]:
    if node is None:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return set()
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def _bound_names(target: ast.AST) -> list[str]:
    """The names an assignment rebinds (``a, (b, *c) = ...``), not those whose attribute it sets."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Starred):
        return _bound_names(target.value)
    if isinstance(target, ast.Tuple | ast.List):
        return [name for each in target.elts for name in _bound_names(each)]
    return []


class _Scope(ast.NodeVisitor):
    """Walks one function (or a module's top level), tracking which names hold rows (or querysets) of
    which of the five models, and reports the writes to models ``owned`` does not include."""

    def __init__(self, path: str, owned: set[str], held: dict[str, set[str]], found: list[str]) -> None:
        self.path, self.owned, self.held, self.found = path, owned, dict(held), found

    def reached(self, node: ast.AST) -> set[str]:
        """The models a call's receiver reaches: walking the chain inwards, the first related manager,
        foreign key, model class or name holding rows decides."""
        while True:
            if isinstance(node, ast.Name):
                if node.id in MODELS:
                    return {node.id}
                return self.held.get(node.id, set())
            if isinstance(node, ast.Attribute):
                model = RELATED.get(node.attr) or ROW_NAMES.get(node.attr)
                if model:
                    return {model}
                node = node.value
            elif isinstance(node, ast.Call):
                node = node.func
            elif isinstance(node, ast.Subscript):
                node = node.value
            else:
                return set()

    def mentioned(self, node: ast.AST | None) -> set[str]:
        if node is None:
            return set()
        models: set[str] = set()
        for each in ast.walk(node):
            if isinstance(each, ast.Name | ast.Attribute):
                models |= self.reached(each)
        return models

    def bind(self, target: ast.AST, value: ast.AST | None) -> None:
        models = self.mentioned(value)
        for name in _bound_names(target):
            if models:
                self.held[name] = {ROW_NAMES[name]} if name in ROW_NAMES else models
            else:
                self.held.pop(name, None)

    # --- bindings
    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        for target in node.targets:
            self.bind(target, node.value)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.generic_visit(node)
        annotated = _annotation_names(node.annotation) & MODELS
        if annotated and isinstance(node.target, ast.Name):  # ``x: Deployment = ...``
            self.held[node.target.id] = annotated
        elif node.value is not None:
            self.bind(node.target, node.value)

    def visit_For(self, node: ast.For) -> None:
        self.bind(node.target, node.iter)
        self.generic_visit(node)

    def visit_comprehension(self, node: ast.comprehension) -> None:
        self.bind(node.target, node.iter)
        self.generic_visit(node)

    def visit_withitem(self, node: ast.withitem) -> None:
        if node.optional_vars is not None:
            self.bind(node.optional_vars, node.context_expr)
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        scan_function(node, self.path, self.owned, self.held, self.found)

    visit_AsyncFunctionDef = visit_FunctionDef

    # --- writes
    def visit_Call(self, node: ast.Call) -> None:
        self.generic_visit(node)
        func = node.func
        if not isinstance(func, ast.Attribute):
            return
        if (
            func.attr in M2M_WRITES
            and isinstance(func.value, ast.Attribute)
            and func.value.attr == "instances"
        ):
            models = {"DeploymentInstance"} if self.reached(func.value.value) & {"Deployment"} else set()
        elif func.attr in WRITES:
            models = self.reached(func.value)
        else:
            return
        if models - self.owned:
            self.found.append(f"{self.path}:{node.lineno}: {ast.unparse(node)[:120]}")

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and any(table in node.value.lower() for table in TABLES):
            self.found.append(f"{self.path}:{node.lineno}: raw SQL on a table of the five models")


def scan_function(node, path: str, owned: set[str], outer: dict[str, set[str]], found: list[str]) -> None:
    held = dict(outer)
    for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
        annotated = _annotation_names(arg.annotation) & MODELS
        if annotated:
            held[arg.arg] = annotated
        elif arg.arg in ROW_NAMES:
            held[arg.arg] = {ROW_NAMES[arg.arg]}
        else:
            held.pop(arg.arg, None)  # a parameter shadows an outer name
    scope = _Scope(path, owned, held, found)
    for decorator in node.decorator_list:
        scope.visit(decorator)
    for statement in node.body:
        scope.visit(statement)


def writes_in(source: str, path: str = "<source>", owned: frozenset[str] = frozenset()) -> list[str]:
    """The writes to the five models in one module's source, but to those ``owned``."""
    found: list[str] = []
    scope = _Scope(path, set(owned), {}, found)
    for statement in ast.parse(source).body:
        scope.visit(statement)
    return found


def _without_line(write: str) -> str:
    """ "apps/x.py:12: call" -> "apps/x.py: call": an allow-list entry survives edits above it."""
    where, line_and_call = write.split(":", 1)
    return f"{where}:{line_and_call.split(':', 1)[1]}"


def platform_writes() -> list[str]:
    found: list[str] = []
    for folder in SCANNED:
        for file in sorted((ROOT / folder).rglob("*.py")):
            path = file.relative_to(ROOT).as_posix()
            if "/migrations/" in path:
                continue
            writes = writes_in(file.read_text(), path, frozenset(OWNERS.get(path, ())))
            found += [w for w in writes if _without_line(w) not in ALLOWED]
    return found


def test_only_the_owners_write_deployments_placements_events_rollouts_and_analyses():
    writes = platform_writes()
    assert not writes, "\n".join(["Call the owner (apps.deployments.services / .rollouts) instead:", *writes])


def test_the_check_sees_each_kind_of_write():
    """The check can fail: each of these is a write it must report, each of the last ones is not."""
    caught = {
        "class": "Deployment.objects.filter(pk=1).update(state='FAILED')",
        "F": "DeploymentInstance.objects.filter(pk=1).update(generation=F('generation') + 1)",
        "related": "def f(model):\n    model.deployments.filter(state='X').delete()",
        "events": "def f(d):\n    d.events.create(kind='x', message='y')",
        "instance": "def f(deployment):\n    deployment.state = 'FAILED'\n    deployment.save()",
        "tuple": "def f(x: Rollout):\n    x.state, x.reason = 'ABORTED', ''\n    x.save()",
        "foreign key": "def f(p):\n    p.deployment.save()",
        "annotated": "def f(x: 'Rollout'):\n    x.save(update_fields=['state'])",
        "loop": "for r in Rollout.objects.live():\n    r.delete()",
        "assigned": "def f():\n    a = RolloutAnalysis.objects.get(pk=1)\n    a.passed = False\n    a.save()",
        "bulk": "DeploymentEvent.objects.bulk_create([])",
        "m2m": "def f(deployment, i):\n    deployment.instances.add(i)",
        "sql": "def f(c):\n    c.execute('UPDATE deployments_deployment SET state = 1')",
    }
    for kind, source in caught.items():
        assert writes_in(source), f"the check misses a write ({kind}): {source}"
    reads = [
        "def f(context):\n    context.update({'a': 1})",
        "def f(model):\n    return list(model.deployments.filter(state='SERVING'))",
        "def f(deployment):\n    deployment = None\n    deployment.save()",  # rebound to something else
        "Deployment.objects.select_for_update().filter(pk=1).exists()",
    ]
    for source in reads:
        assert not writes_in(source), f"the check reports a read as a write: {source}"


def test_an_owner_writing_the_other_owners_rows_is_reported():
    source = (ROOT / "apps/deployments/services.py").read_text()
    sneaked = source + "\n\ndef sneak(rollout):\n    rollout.state = 'ABORTED'\n    rollout.save()\n"
    writes = writes_in(
        sneaked, "apps/deployments/services.py", frozenset(OWNERS["apps/deployments/services.py"])
    )
    assert len(writes) == 1 and "rollout.save()" in writes[0], writes
