"""``make k8s-check``: run the Kubernetes manifests with ``podman kube play`` and serve one inference through them.

The example overlay, rendered as ``kubectl kustomize`` would (``render.py``), is played on this machine beside the
PostgreSQL and Redis of ``play/data-services.yaml``: the migrate Job's pod, web, agent-api, worker, beat and the
gateway, then the host agent's pod with the DaemonSet's securityContext (root, six capabilities, nothing else).
The check creates a team, a token and a host, uploads a small MLP through the REST API (the worker converts it),
deploys it on the agent's instance and sends one KServe v2 inference through the gateway, checking the numbers.

What podman 4.3 cannot play is changed, and each change is printed (docs/operators/kubernetes.md lists them):
one network (the host's), so every process gets its own 127.0.0.1 port and Services become addresses; the Job
and the DaemonSet are played as Pods from their templates (without the Ascend resource, driver and npu-smi:
there is no NPU here); the Secret's values become plain environment variables; the volumes get a name prefix.

    .venv/bin/python deploy/kubernetes/play_check.py [--keep]
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import requests
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
IMAGES = ("triton-ge-platform:latest", "triton-ge-host-agent:latest")
DATA_IMAGE = "triton-ge-play-data:latest"
PREFIX = "tgek8s-"  # every pod and volume of the check: nothing else on the machine is touched
NODE = "play-node"
HTTPS = {"X-Forwarded-Proto": "https"}  # what the operator's TLS endpoint in front of web sets
# CHOWN 0, DAC_READ_SEARCH 2, FOWNER 3, KILL 5, SETGID 6, SETUID 7: the DaemonSet's six, as a CapEff mask.
AGENT_CAPABILITIES = sum(1 << bit for bit in (0, 2, 3, 5, 6, 7))

_spec = importlib.util.spec_from_file_location("k8s_render", HERE / "render.py")
render = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render)
_spec = importlib.util.spec_from_file_location("deploy_images", HERE.parent / "images.py")
images = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(images)


class CheckFailed(RuntimeError):
    pass


def say(message: str) -> None:
    print(f"k8s-check: {message}", flush=True)


def podman(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    result = subprocess.run(
        ["podman", "--runtime", "runc", *args], capture_output=True, text=True, timeout=timeout
    )
    if check and result.returncode != 0:
        raise CheckFailed(f"podman {' '.join(args[:3])}: {result.stderr.strip()[-2000:]}")
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, what: str, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise CheckFailed(f"timed out after {timeout:g} s waiting for {what}")


# --- turning the manifests into what podman kube play runs on one machine -------------------------------


class Plan:
    """Ports, secrets and the played objects."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        names = (
            "pg",
            "redis",
            "web",
            "agent_api",
            "gw_http",
            "gw_grpc",
            "gw_stats",
            "t_http",
            "t_grpc",
            "t_metrics",
        )
        self.port = {name: free_port() for name in names}
        self.db_password = secrets.token_urlsafe(24)
        self.secret = {
            "SECRET_KEY": secrets.token_urlsafe(50),
            "DATABASE_URL": f"postgres://platform:{self.db_password}@127.0.0.1:{self.port['pg']}/platform",
        }
        self.config = {
            "ALLOWED_HOSTS": "127.0.0.1,localhost",
            "CELERY_BROKER_URL": f"redis://127.0.0.1:{self.port['redis']}/0",
            "CELERY_RESULT_BACKEND": f"redis://127.0.0.1:{self.port['redis']}/1",
            "GATEWAY_BIND": f"127.0.0.1:{self.port['gw_http']}",
            "GATEWAY_GRPC_BIND": f"127.0.0.1:{self.port['gw_grpc']}",
            "GATEWAY_PUBLIC_URL": f"http://127.0.0.1:{self.port['gw_http']}",
            "GATEWAY_METRICS_URL": f"http://127.0.0.1:{self.port['gw_stats']}/metrics",
        }
        self.container_ports = {
            "web": {8000: self.port["web"]},
            "agent-api": {8000: self.port["agent_api"]},
            "gateway": {8080: self.port["gw_http"], 8081: self.port["gw_grpc"], 8404: self.port["gw_stats"]},
        }
        self.changes: set[str] = set()


def _strip_namespace(obj: dict) -> dict:
    obj = copy.deepcopy(obj)
    obj["metadata"].pop("namespace", None)
    obj["metadata"]["name"] = PREFIX + obj["metadata"]["name"]
    return obj


def _podman_probe(probe: dict, ports: dict[str, int], plan: Plan) -> None:
    get = probe.pop("httpGet", None)
    if get:
        # podman 4.3 runs an httpGet probe with curl inside the container, which the image does not carry.
        port = ports[get["port"]] if isinstance(get["port"], str) else get["port"]
        url = f"http://127.0.0.1:{port}{get['path']}"
        probe["exec"] = {
            "command": [f'python -c "import urllib.request; urllib.request.urlopen({url!r}, timeout=5)"']
        }
        plan.changes.add("httpGet probes run as exec probes with the image's python (podman would use curl)")
        return
    command = probe.get("exec", {}).get("command", [])
    if command[:2] == ["sh", "-c"]:
        # podman 4.3 joins an exec probe's words with spaces, splits them again and runs the result with
        # /bin/sh -c, so ["sh", "-c", script] would run `sh -c <first word of the script>`: the script alone.
        probe["exec"]["command"] = command[2:]
        plan.changes.add("exec probes [sh, -c, script] given as [script] (podman 4.3 joins a probe's words)")


def _adapt_pod_spec(spec: dict, name: str, plan: Plan) -> dict:
    spec = copy.deepcopy(spec)
    if spec.pop("initContainers", None):
        # podman 4.3 tries to remove an init container as soon as it started it (and fails: "it is
        # running"); the check runs the migrate pod to its end first, which is what they wait for.
        plan.changes.add(
            "init containers (wait for migrations) dropped: the migrate pod runs first (podman 4.3)"
        )
    if spec.pop("affinity", None):
        plan.changes.add("pod affinity dropped (one machine)")
    for volume in spec.get("volumes", []):
        if "persistentVolumeClaim" in volume:
            volume["persistentVolumeClaim"]["claimName"] = (
                PREFIX + volume["persistentVolumeClaim"]["claimName"]
            )
    for container in spec.get("initContainers", []) + spec["containers"]:
        env = [e for e in container.get("env", []) if e["name"] != "GATEWAY_STATS_BIND"]
        if any(e["name"] == "GATEWAY_STATS_BIND" for e in container.get("env", [])):
            env.append({"name": "GATEWAY_STATS_BIND", "value": f"127.0.0.1:{plan.port['gw_stats']}"})
        sources = []
        for source in container.get("envFrom", []):
            if "secretRef" in source:  # podman 4.3 cannot read a Secret it made from kube YAML
                env += [{"name": k, "value": v} for k, v in plan.secret.items()]
                plan.changes.add("Secret platform-secrets passed as environment variables (podman 4.3)")
            else:
                source = copy.deepcopy(source)
                source["configMapRef"]["name"] = PREFIX + source["configMapRef"]["name"]
                sources.append(source)
        container["envFrom"] = sources
        container["env"] = env
        mapping = plan.container_ports.get(name, {})
        named = {}
        for port in container.get("ports", []):
            port["containerPort"] = mapping[port["containerPort"]]
            named[port["name"]] = port["containerPort"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in container:
                _podman_probe(container[probe], named, plan)
        if container.pop("ports", None):  # on the host network the process binds its port itself
            plan.changes.add("containerPorts dropped (podman maps no ports on the host network)")
        command = container.get("command", [])
        for i, part in enumerate(command):
            for inside, outside in mapping.items():
                part = part.replace(f"0.0.0.0:{inside}", f"127.0.0.1:{outside}")
            command[i] = part
        if mapping:
            plan.changes.add("Services replaced by 127.0.0.1 ports (host network)")
    return spec


def platform_objects(plan: Plan) -> list[dict]:
    """The example overlay's ConfigMap, PVCs, migrate Job (as a Pod) and platform Deployments."""
    played = []
    for obj in render.render(HERE / "overlays" / "example"):
        kind = obj["kind"]
        if kind in ("Namespace", "Service", "Secret", "DaemonSet"):
            continue
        adapted = _strip_namespace(obj)
        if kind == "ConfigMap":
            adapted["data"].update(plan.config)
        elif kind == "Job":
            spec = _adapt_pod_spec(obj["spec"]["template"]["spec"], obj["metadata"]["name"], plan)
            adapted = {"apiVersion": "v1", "kind": "Pod", "metadata": adapted["metadata"], "spec": spec}
            plan.changes.add("Job migrate played as a Pod (podman 4.3 plays no Jobs)")
        elif kind == "Deployment":
            adapted["spec"]["template"]["spec"] = _adapt_pod_spec(
                obj["spec"]["template"]["spec"], obj["metadata"]["name"], plan
            )
        played.append(adapted)
    return played


def data_objects(plan: Plan) -> list[dict]:
    objects = [d for d in yaml.safe_load_all((HERE / "play" / "data-services.yaml").read_text()) if d]
    values = {"PGPORT": str(plan.port["pg"]), "REDIS_PORT": str(plan.port["redis"]),
              "POSTGRES_PASSWORD": plan.db_password}  # fmt: skip
    for obj in objects:
        obj["metadata"]["name"] = PREFIX + obj["metadata"]["name"]
        for container in obj["spec"]["template"]["spec"]["containers"]:
            for env in container.get("env", []):
                env["value"] = values.get(env["name"], env["value"])
            for probe in ("readinessProbe", "livenessProbe"):
                _podman_probe(container[probe], {}, plan)
    return objects


def agent_pod(plan: Plan, join_token: str) -> dict:
    """The DaemonSet's pod, as it would run on an Ascend node, less what needs one."""
    daemonset = next(o for o in render.render(HERE / "overlays" / "example") if o["kind"] == "DaemonSet")
    spec = copy.deepcopy(daemonset["spec"]["template"]["spec"])
    spec.pop("nodeSelector")
    spec.pop("dnsPolicy")
    (container,) = spec["containers"]
    limits = container["resources"]["limits"]
    for key in [k for k in limits if k.startswith("huawei.com/")]:
        del limits[key]
    ascend = {"ascend-driver", "npu-smi"}
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] not in ascend]
    fleet = plan.workdir / "fleet"
    tokens = plan.workdir / "join-tokens"
    fleet.mkdir()
    tokens.mkdir(mode=0o700)
    (tokens / NODE).write_text(join_token)
    volumes = []
    for volume in spec["volumes"]:
        if volume["name"] in ascend:
            continue
        if volume["name"] == "fleet":
            volume = {"name": "fleet", "hostPath": {"path": str(fleet), "type": "Directory"}}
        elif volume["name"] == "join-tokens":  # the Secret host-join-tokens, one key per node name
            volume = {"name": "join-tokens", "hostPath": {"path": str(tokens), "type": "Directory"}}
        volumes.append(volume)
    spec["volumes"] = volumes
    for probe in ("startupProbe", "livenessProbe"):
        _podman_probe(container[probe], {}, plan)
    env = {e["name"]: e for e in container["env"]}
    env["PLATFORM_URL"] = {"name": "PLATFORM_URL", "value": f"http://127.0.0.1:{plan.port['agent_api']}"}
    env["NODE_NAME"] = {"name": "NODE_NAME", "value": NODE}
    env["AGENT_PORT_RANGE"] = {"name": "AGENT_PORT_RANGE", "value": ""}  # its one instance is declared below
    container["env"] = list(env.values())
    plan.changes.add(
        "DaemonSet host-agent played as a Pod without nodeSelector, huawei.com resource, driver and npu-smi "
        "mounts (no NPU here); its fleet and join-token volumes are host directories"
    )
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": PREFIX + "host-agent"}, "spec": spec}


# --- running it -------------------------------------------------------------------------------------------


def play(plan: Plan, name: str, objects: list[dict]) -> Path:
    path = plan.workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump_all(objects, sort_keys=False))
    podman("kube", "play", "--network", "host", str(path), timeout=900)
    return path


def container_names() -> list[str]:
    out = podman("ps", "-a", "--format", "{{.Names}}").stdout.split()
    return [n for n in out if n.startswith(PREFIX) and not n.endswith("-infra")]


def container(pod: str) -> str:
    matches = [n for n in container_names() if n.startswith(f"{PREFIX}{pod}-")]
    if len(matches) != 1:
        raise CheckFailed(f"expected one container of {pod}, found {matches}")
    return matches[0]


def state(name: str) -> tuple[str, int]:
    out = podman("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", name).stdout.split()
    return out[0], int(out[1])


def answers(url: str, headers: dict | None = None) -> bool:
    try:
        return requests.get(url, timeout=5, headers=headers or {}).status_code == 200
    except requests.RequestException:
        return False


def healthy(name: str) -> bool:
    """The container's probe passes. podman 4.3 restarts a container whose liveness probe fails (and runs no
    probe on its own without systemd), so the probe's command is first tried with ``podman exec`` - which
    counts for nothing - and ``podman healthcheck run`` is asked only once that passes."""
    test = json.loads(podman("inspect", "--format", "{{json .Config.Healthcheck.Test}}", name).stdout)
    script = " ".join(test[1:]) if test and test[0] == "CMD-SHELL" else " ".join(test[1:] if test else [])
    if podman("exec", name, "/bin/sh", "-c", script, check=False, timeout=120).returncode != 0:
        return False
    return podman("healthcheck", "run", name, check=False, timeout=120).returncode == 0


def remove_leftovers() -> None:
    """Pods of an earlier check that stopped half way (and its volumes)."""
    pods = podman("pod", "ps", "--format", "{{.Name}}").stdout.split()
    for pod in [p for p in pods if p.startswith(PREFIX)]:
        podman("pod", "rm", "-f", pod, check=False)


def manage(plan: Plan, code: str) -> dict:
    result = podman("exec", container("web"), "python", "manage.py", "shell", "-c", code, timeout=120)
    return json.loads(result.stdout.strip().splitlines()[-1])


SETUP = """
import json
from django.contrib.auth import get_user_model
from apps.fleet import services as fleet
from apps.teams import services as teams
staff = get_user_model().objects.create_user("k8s-check", is_staff=True)
team = teams.create_team(actor=staff, name="K8s check", slug="k8s-check")
_, token = teams.create_token(actor=staff, team=team, name="k8s-check")
host, join = fleet.create_host(actor=staff, name="{node}", address="127.0.0.1")
instance = fleet.create_instance(actor=staff, host=host, name="cpu-0", http_port={t_http}, grpc_port={t_grpc},
                                 metrics_port={t_metrics})
print(json.dumps({{"token": token, "join": join, "instance": instance.pk}}))
"""


def mlp_onnx(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A two-layer MLP (4 -> 8 -> 3, ReLU between), batch dimension dynamic: its weights."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(7)
    w1, b1 = rng.standard_normal((4, 8)).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    w2, b2 = rng.standard_normal((8, 3)).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["input", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h2"]),
        helper.make_node("MatMul", ["h2", "w2"], ["o0"]),
        helper.make_node("Add", ["o0", "b2"], ["output"]),
    ]
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"), (b2, "b2"))],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return w1, b1, w2, b2


def serve_one_inference(plan: Plan, token: str, instance: int) -> dict:
    sys.path.insert(0, str(ROOT))
    from tgp.client import Client, UploadJournal

    def behind_tls(request) -> None:  # the operator's TLS endpoint: https outside, plain HTTP to web
        request.headers.update(HTTPS)
        if request.url.scheme == "https":
            request.url = request.url.copy_with(scheme="http")

    weights = mlp_onnx(plan.workdir / "mlp.onnx")
    api = Client(f"http://127.0.0.1:{plan.port['web']}", token, "k8s-check", timeout=120,
                 journal=UploadJournal(plan.workdir / "uploads.json"))  # fmt: skip
    api.http.event_hooks["request"].append(behind_tls)
    api.create_model("MLP", slug="mlp")
    version = api.upload(plan.workdir / "mlp.onnx", "mlp")
    say(f"uploaded version {version['number']}; the worker converts it")
    ready = api.wait_for_version("mlp", version["number"], timeout=600)
    say(f"version {ready['number']} {ready['state']}")
    api.deploy("mlp", ready["number"], instances=[instance])
    deployment = api.wait_for_deployment("mlp", timeout=600)
    say(f"deployment {deployment['id']} {deployment['state']}")
    x = np.array([[0.5, -1.0, 2.0, 0.25], [1.0, 1.0, -0.5, 0.0]], dtype=np.float32)
    body = {
        "inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]
    }
    url = f"http://127.0.0.1:{plan.port['gw_http']}/v2/models/k8s-check__mlp/infer"
    headers = {"Authorization": f"Bearer {token}"}

    def infer():
        try:
            response = requests.post(url, json=body, headers=headers, timeout=30)
        except requests.RequestException:
            return None
        return response.json() if response.status_code == 200 else None

    answer = wait_for(infer, 60, "the gateway to answer the inference")
    w1, b1, w2, b2 = weights
    expected = np.maximum(x @ w1 + b1, 0) @ w2 + b2
    got = np.array(answer["outputs"][0]["data"], dtype=np.float32).reshape(expected.shape)
    if not np.allclose(got, expected, rtol=1e-4, atol=1e-5):
        raise CheckFailed(f"the gateway answered {got.tolist()}, expected {expected.tolist()}")
    return {"expected": expected.round(4).tolist(), "got": got.round(4).tolist()}


def ensure_images() -> None:
    for image in IMAGES:
        if podman("image", "exists", image, check=False).returncode != 0:
            raise CheckFailed(f"image {image} is missing: build it first (make images)")
    if podman("image", "exists", DATA_IMAGE, check=False).returncode != 0:
        say(f"building {DATA_IMAGE} (PostgreSQL and Redis from Debian's packages)")
        podman("build", "--network", "host", "-t", DATA_IMAGE, "-f", str(HERE / "play" / "Containerfile"),
               str(HERE / "play"), timeout=1200)  # fmt: skip


def play_volumes(plan: Plan) -> Path:
    """The PVCs, played first: then their volumes are made writable by the platform's user (uid 1000), as
    fsGroup makes them on a cluster (podman 4.3 does not apply fsGroup)."""
    claims = [o for o in platform_objects(plan) if o["kind"] == "PersistentVolumeClaim"]
    for claim in claims:
        podman("volume", "rm", "-f", claim["metadata"]["name"], check=False)
    path = play(plan, "volumes", claims)
    for claim in claims:
        mountpoint = podman("volume", "inspect", "--format", "{{.Mountpoint}}", claim["metadata"]["name"])
        os.chown(mountpoint.stdout.strip(), 1000, 1000)
    plan.changes.add("PVC volumes chowned to uid 1000 (fsGroup, which podman 4.3 does not apply)")
    return path


def error_lines() -> list[str]:
    """Every log line at ERROR of every container of the check (PostgreSQL's too: a query the platform sent
    before its tables existed shows there)."""
    found = []
    for name in container_names():
        logs = podman("logs", name, check=False)
        for line in (logs.stdout + logs.stderr).splitlines():
            marked = " ERROR" in line or "[ERROR]" in line or "ERROR/" in line or "FATAL" in line
            if marked and not images.expected_refusal(line):
                found.append(f"{name}: {line[:300]}")
    return found


def teardown(played: list[Path]) -> None:
    for path in reversed(played):
        podman("kube", "down", str(path), check=False, timeout=300)
    for claim in ("artifacts", "gateway"):
        podman("volume", "rm", "-f", PREFIX + claim, check=False)


def dump_logs() -> None:
    for name in container_names():
        tail = (
            podman("logs", "--tail", "25", name, check=False).stdout
            + podman("logs", "--tail", "25", name, check=False).stderr
        )
        print(f"--- {name}\n{tail}", file=sys.stderr)


def run(keep: bool) -> dict:
    if not os.environ.get("CONTAINERS_CONF"):  # this machine's podman needs it; see the docs
        conf = Path(tempfile.mkdtemp(prefix="k8s-check-conf-")) / "containers.conf"
        conf.write_text("[containers]\ndefault_ulimits = []\n")
        os.environ["CONTAINERS_CONF"] = str(conf)
    ensure_images()
    workdir = Path(tempfile.mkdtemp(prefix="k8s-check-"))
    plan = Plan(workdir)
    played: list[Path] = []
    started = time.monotonic()
    try:
        remove_leftovers()
        played.append(play_volumes(plan))
        played.append(play(plan, "data", data_objects(plan)))
        wait_for(
            lambda: healthy(container("postgres")) and healthy(container("redis")),
            120,
            "PostgreSQL and Redis",
        )
        objects = [o for o in platform_objects(plan) if o["kind"] != "PersistentVolumeClaim"]
        config = [o for o in objects if o["kind"] == "ConfigMap"]
        # The migrate pod first, to its end: on a cluster the Deployments' init containers wait for it.
        played.append(play(plan, "migrate", config + [o for o in objects if o["kind"] == "Pod"]))
        migrate = container("migrate")
        wait_for(lambda: state(migrate)[0] == "exited", 300, "the migrate pod to finish")
        if state(migrate)[1] != 0:
            raise CheckFailed(f"migrate exited {state(migrate)[1]}")
        say("migrate: exit 0")
        played.append(play(plan, "platform", [o for o in objects if o["kind"] != "Pod"]))
        for change in sorted(plan.changes):
            say(f"changed for podman: {change}")
        port = plan.port
        wait_for(lambda: answers(f"http://127.0.0.1:{port['web']}/readyz"), 180, "web /readyz")
        wait_for(lambda: answers(f"http://127.0.0.1:{port['agent_api']}/healthz"), 180, "agent-api /healthz")
        wait_for(lambda: answers(f"http://127.0.0.1:{port['gw_http']}/v2/health/ready"), 180, "gateway ready")
        for pod in ("worker", "beat", "web", "agent-api", "gateway"):
            wait_for(lambda p=pod: healthy(container(p)), 240, f"{pod}'s probe (podman healthcheck)", 5)
        say(f"platform up and healthy in {time.monotonic() - started:.0f} s")
        setup = manage(plan, SETUP.format(node=NODE, **{k: v for k, v in port.items() if k.startswith("t_")}))
        played.append(play(plan, "host-agent", [agent_pod(plan, setup["join"])]))
        agent = container("host-agent")
        wait_for(lambda: healthy(agent), 300, "the host agent's probe (joined, running)", 5)
        caps = podman("exec", agent, "grep", "CapEff", "/proc/1/status").stdout.split()[-1]
        if int(caps, 16) != AGENT_CAPABILITIES:
            raise CheckFailed(f"the host agent runs with capabilities {caps}, not {AGENT_CAPABILITIES:016x}")
        say(f"host agent joined; its capabilities: {caps} (CHOWN DAC_READ_SEARCH FOWNER KILL SETGID SETUID)")
        result = serve_one_inference(plan, setup["token"], setup["instance"])
        # SIGTERM, as the kubelet sends it: the agent stops its tritonserver (another user's process: KILL)
        # and exits 0 within the grace period.
        podman("pod", "stop", "-t", "90", f"{PREFIX}host-agent", timeout=180)
        if state(agent) != ("exited", 0):
            raise CheckFailed(f"the host agent stopped with {state(agent)}")
        say("host agent stopped on SIGTERM: exit 0")
        errors = error_lines()
        if errors:
            raise CheckFailed("log lines at ERROR:\n" + "\n".join(errors[:20]))
        result["seconds"] = round(time.monotonic() - started)
        result["capabilities"] = caps
        return result
    except Exception:
        dump_logs()
        raise
    finally:
        if keep:
            say(f"kept: podman kube down {' '.join(str(p) for p in played)}")
        else:
            teardown(played)
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="Leave the pods running for a look.")
    args = parser.parse_args(argv)
    try:
        result = run(args.keep)
    except CheckFailed as exc:
        print(f"k8s-check: FAILED: {exc}", file=sys.stderr)
        return 1
    say(f"one inference through the gateway: {result['got']} (expected {result['expected']})")
    say(f"passed in {result['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
