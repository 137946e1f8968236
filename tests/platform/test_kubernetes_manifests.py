"""The Kubernetes install (``deploy/kubernetes/``), checked offline: every object of every overlay is valid for
Kubernetes 1.30 (``kubernetes-validate``, strict: no unknown fields), and the facts a schema cannot see hold -
probes, no privileged container, non-root platform pods, the host agent's capabilities and Ascend resource, no
secret committed, the two images, commands that exist, and docker-compose.yml's services mirrored."""

from __future__ import annotations

import base64
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from django.core.management import get_commands

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.30"
IMAGES = {"platform": "triton-ge-platform:latest", "host-agent": "triton-ge-host-agent:latest"}
# overlay -> (the node label value, the Ascend device plugin resource its host agents ask for)
OVERLAYS = {
    "example": ("huawei-Ascend910", "huawei.com/Ascend910"),
    "ascend310p": ("huawei-Ascend310P", "huawei.com/Ascend310P"),
    "ascend310p-2c": ("huawei-Ascend310P", "huawei.com/Ascend310P-2c"),
    "ascend310": ("huawei-Ascend310", "huawei.com/Ascend310"),
}
# What the host agent keeps (docs/operators/kubernetes.md says why each): everything else is dropped.
AGENT_CAPABILITIES = {"CHOWN", "DAC_READ_SEARCH", "FOWNER", "KILL", "SETGID", "SETUID"}
ASCEND_RESOURCE = re.compile(
    r"^huawei\.com/Ascend(910[A-C]?|310P?)(-\d+c(\.\d+cpu)?(\.\d+g)?(\.ndvpp|\.dvpp)?)?$"
)

_spec = importlib.util.spec_from_file_location("k8s_render", KUBERNETES / "render.py")
render = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render)


def rendered(overlay: str) -> list[dict]:
    return render.render(KUBERNETES / "overlays" / overlay)


def play_objects() -> list[dict]:
    return [
        d
        for p in sorted((KUBERNETES / "play").glob("*.yaml"))
        for d in yaml.safe_load_all(p.read_text())
        if d
    ]


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"] if obj["kind"] != "Pod" else obj["spec"]


def workloads(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] in ("Deployment", "DaemonSet", "Job", "Pod")]


# --- schema validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid_for_the_named_kubernetes_version(overlay):
    objects = rendered(overlay)
    kinds = {o["kind"] for o in objects}
    assert kinds == {"Namespace", "ConfigMap", "Secret", "PersistentVolumeClaim", "Job", "Deployment",
                     "Service", "DaemonSet"}, kinds  # fmt: skip
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_the_play_check_manifests_are_valid_too():
    objects = play_objects()
    assert {o["metadata"]["name"] for o in objects} >= {"postgres", "redis"}
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (["spec", "template", "spec", "containers", 0, "securityContext", "privilegd"], True),  # a typo
        (["spec", "replicas"], "one"),
        (["spec", "template", "spec", "containers", 0, "readinessProbe", "httpGet", "port"], None),
    ],
)
def test_the_validation_refuses_a_broken_manifest(path, value):
    web = by_kind(rendered("example"), "Deployment")["web"]
    target = web
    for part in path[:-1]:
        target = target[part]
    if value is None:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(web, KUBERNETES_VERSION, strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed (kustomize comparison)")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_renderer_renders_what_kubectl_kustomize_does(overlay):
    out = subprocess.run(
        ["kubectl", "kustomize", str(KUBERNETES / "overlays" / overlay)],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    theirs = {key(o): o for o in yaml.safe_load_all(out) if o}
    ours = {key(o): o for o in rendered(overlay)}
    assert ours == theirs


def test_the_renderer_refuses_what_it_does_not_implement(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: staging-\n")
    with pytest.raises(render.RenderError, match="namePrefix"):
        render.render(tmp_path)


# --- what a schema cannot see ----------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_deployment_and_the_daemonset_have_probes(overlay):
    objects = rendered(overlay)
    long_running = [o for o in objects if o["kind"] in ("Deployment", "DaemonSet")]
    assert {o["metadata"]["name"] for o in long_running} == {"web", "agent-api", "worker", "beat", "gateway",
                                                              "host-agent"}  # fmt: skip
    for obj in long_running:
        for container in pod_spec(obj)["containers"]:
            assert "livenessProbe" in container, obj["metadata"]["name"]
            if container.get("ports"):  # serves traffic: only when ready
                assert "readinessProbe" in container, obj["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_container_is_privileged_and_the_platform_runs_as_non_root(overlay):
    for obj in workloads(rendered(overlay)) + workloads(play_objects()):
        spec, name = pod_spec(obj), obj["metadata"]["name"]
        assert not spec.get("hostPID") and not spec.get("hostIPC"), name
        assert spec.get("automountServiceAccountToken") is False, name
        for container in spec.get("initContainers", []) + spec["containers"]:
            context = container.get("securityContext", {})
            assert context.get("privileged", False) is False, name
            assert context.get("allowPrivilegeEscalation") is False, name
            assert context.get("capabilities", {}).get("drop") == ["ALL"], name
        if name != "host-agent":
            assert spec["securityContext"]["runAsNonRoot"] is True, name
            assert spec["securityContext"]["runAsUser"] != 0, name
            assert not spec.get("hostNetwork"), name
            assert all("add" not in c["securityContext"]["capabilities"] for c in spec["containers"]), name


@pytest.mark.parametrize(("overlay", "expected"), OVERLAYS.items())
def test_the_host_agent_asks_the_device_plugin_for_its_npu_on_ascend_nodes_only(overlay, expected):
    label, resource = expected
    agent = by_kind(rendered(overlay), "DaemonSet")["host-agent"]
    spec = pod_spec(agent)
    assert spec["nodeSelector"] == {"accelerator": label}
    (container,) = spec["containers"]
    npus = {k: v for k, v in container["resources"]["limits"].items() if k.startswith("huawei.com/")}
    assert npus == {resource: 1}
    assert ASCEND_RESOURCE.match(resource) and resource.removeprefix("huawei.com/").startswith(
        label.removeprefix("huawei-")
    )
    assert set(container["resources"]["requests"]) == {"cpu", "memory"}
    assert set(container["securityContext"]["capabilities"]["add"]) == AGENT_CAPABILITIES
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    for path in ("/usr/local/Ascend/driver", "/usr/local/bin/npu-smi"):
        assert mounts[path].get("readOnly") is True
        assert volumes[mounts[path]["name"]]["hostPath"]["path"] == path
    assert volumes["join-tokens"]["secret"]["optional"] is True


def test_no_secret_value_is_committed():
    committed = render._env_file(KUBERNETES / "overlays" / "example" / "secrets.env")
    assert set(committed) == {"SECRET_KEY", "DATABASE_URL"} and set(committed.values()) == {""}
    for overlay in OVERLAYS:
        secrets = by_kind(rendered(overlay), "Secret")
        assert set(secrets) == {"platform-secrets"}
        assert {base64.b64decode(v).decode() for v in secrets["platform-secrets"]["data"].values()} == {""}
    for path in KUBERNETES.rglob("*.yaml"):
        text = path.read_text()
        assert not re.search(r"(?i)(password|secret_key)\s*[:=]\s*['\"]?[A-Za-z0-9+/_-]{8,}", text), path


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_images_are_the_two_the_dockerfile_builds(overlay):
    for obj in workloads(rendered(overlay)):
        spec = pod_spec(obj)
        for container in spec.get("initContainers", []) + spec["containers"]:
            wanted = IMAGES["host-agent"] if obj["kind"] == "DaemonSet" else IMAGES["platform"]
            assert container["image"] == wanted, obj["metadata"]["name"]
            assert container["imagePullPolicy"] == "IfNotPresent"


def test_the_commands_the_containers_run_exist():
    commands = set(get_commands())
    seen = 0
    for obj in workloads(rendered("example")):
        for container in pod_spec(obj)["containers"]:  # the init containers' migrate --check: below
            line = " ".join(container.get("command", []))
            for name in re.findall(r"manage\.py (\w+)", line):
                assert name in commands, (obj["metadata"]["name"], name)
                seen += 1
            for module in re.findall(r"python -m (\w+)", line):
                assert importlib.util.find_spec(f"{module}.__main__"), module
                seen += 1
    assert seen == 3  # migrate, gateway, hostagent


def test_the_platform_starts_after_the_migrations():
    for deployment in by_kind(rendered("example"), "Deployment").values():
        (init,) = pod_spec(deployment)["initContainers"]
        assert "python manage.py migrate --check" in init["command"][-1], deployment["metadata"]["name"]
        assert init["envFrom"] == pod_spec(deployment)["containers"][0]["envFrom"]


def test_services_configuration_and_volumes_resolve():
    objects = rendered("example")
    deployments = by_kind(objects, "Deployment")
    names = {kind: set(by_kind(objects, kind)) for kind in ("ConfigMap", "Secret", "PersistentVolumeClaim")}
    for service in by_kind(objects, "Service").values():
        target = deployments[service["spec"]["selector"]["app.kubernetes.io/name"]]
        ports = {p["name"] for c in pod_spec(target)["containers"] for p in c.get("ports", [])}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports, service["metadata"]["name"]
    for obj in workloads(objects):
        spec = pod_spec(obj)
        assert obj["metadata"].get("namespace") == "triton-ge"
        for container in spec["containers"]:
            for source in container.get("envFrom", []):
                ref = source.get("configMapRef") or source.get("secretRef")
                kind = "ConfigMap" if "configMapRef" in source else "Secret"
                assert ref["name"] in names[kind], ref
        for volume in spec.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in names["PersistentVolumeClaim"]


def test_the_manifests_mirror_the_compose_stack():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    objects = rendered("example")
    deployments = by_kind(objects, "Deployment")
    platform_services = {n for n, s in compose["services"].items() if s.get("image") == IMAGES["platform"]}
    assert platform_services == set(deployments)
    config = by_kind(objects, "ConfigMap")["platform-config"]["data"]
    secret = by_kind(objects, "Secret")["platform-secrets"]["data"]
    assert set(compose["x-platform"]["environment"]) <= set(config) | set(secret)
    for name in platform_services:
        service, (container,) = compose["services"][name], pod_spec(deployments[name])["containers"]
        assert ("healthcheck" in service) == ("livenessProbe" in container), name
        if name in ("worker", "beat", "gateway"):
            assert container["command"] == service["command"], name
        extra = {k for k in service.get("environment", {}) if k not in compose["x-platform"]["environment"]}
        if "WEB_BIND" in extra:  # compose's command binds $WEB_BIND; the Deployment's binds the same address
            assert f"--bind {service['environment']['WEB_BIND']} " in container["command"][-1], name
            extra.remove("WEB_BIND")
        assert extra <= {e["name"] for e in container.get("env", [])}, name
