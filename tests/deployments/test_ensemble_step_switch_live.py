"""A step switched through its ensemble, against a real host agent, tritonserver and HAProxy: "update step
resnet50 to version 2" makes a new ensemble version, switching the ensemble's deployment to it loads resnet50
v2 beside v1, switches the ensemble, then the step (v1 unloads) - with every request through the gateway
answered under load. And the playground runs the ensemble from its signature, the seed's raw uint8 image."""

from __future__ import annotations

import http.client
import json
import shutil
import threading
import time
import urllib.request

import numpy as np
import pytest

from apps.deployments import rollouts
from apps.deployments.models import Deployment, DeploymentState
from apps.registry.models import VersionState
from tests.conftest import requires_chromium, wait_for
from tests.deployments.ensemble_live import BUILDERS, converted_step, infer
from tests.registry.ensemble_builders import ensemble_model, seed_spec
from tests.support.browser import login
from tests.support.servers import deploy, ready_instance

pytestmark = [
    pytest.mark.triton,
    pytest.mark.servers,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed"),
]

LOAD_MAX_REQUESTS = 4000
LOAD_MAX_SECONDS = 300
# A client's patience: a request the gateway holds while the machine is busy loading versions is slow, not
# failed; one that gets no answer within this is counted as failed.
REQUEST_TIMEOUT_S = 60


def seed_pipeline_serving(owner, team, owner_client, start_agent, scratch):
    """The three steps converted and deployed on one instance, the ensemble composed through the API and
    deployed there: (agent, instance, ensemble deployment)."""
    agent, instance = ready_instance(start_agent, "host-a")
    for slug in BUILDERS:
        converted_step(owner, team, slug, scratch)
        deploy(owner_client, "vision", slug, 1, [instance])
    ensemble_model(owner, team)
    composed = owner_client.post(
        "/api/v1/teams/vision/models/classify/ensemble-versions/", seed_spec(), format="json"
    )
    assert composed.status_code == 201, composed.json()
    return agent, instance, deploy(owner_client, "vision", "classify", 1, [instance])


def loaded_versions(instance) -> dict[str, list[str]]:
    """What Triton on the instance has READY: {model: [versions]}."""
    request = urllib.request.Request(
        f"{instance.endpoint_url()}/v2/repository/index",
        data=b"{}",
        method="POST",
        headers={"Content-Type": "application/json", **instance.key_headers()},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        index = json.loads(response.read())
    out: dict[str, list[str]] = {}
    for entry in index:
        if entry.get("state") == "READY":
            out.setdefault(entry["name"], []).append(str(entry.get("version")))
    return {name: sorted(versions) for name, versions in out.items()}


class Load:
    """Requests to the ensemble through the gateway from ``threads`` threads until stopped (bounded in count
    and time); each thread sends one request after the other, so requests are in flight at every moment."""

    def __init__(self, gateway, token: str, image: np.ndarray, threads: int = 2):
        body = {
            "inputs": [
                {
                    "name": "raw_image",
                    "shape": list(image.shape),
                    "datatype": "UINT8",
                    "data": image.ravel().tolist(),
                }
            ]
        }
        self.gateway, self.token, self.body = gateway, token, json.dumps(body).encode()
        self.sent, self.failures, self.slowest_s = 0, [], 0.0
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(threads)]

    def request(self) -> tuple[int, str]:
        """One inference on its own connection (no retry): (status, what went wrong or "")."""
        connection = http.client.HTTPConnection("127.0.0.1", self.gateway.port, timeout=REQUEST_TIMEOUT_S)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.token}"}
        try:
            connection.request("POST", "/v2/models/vision__classify/infer", body=self.body, headers=headers)
            response = connection.getresponse()
            status, raw = response.status, response.read()
        except (OSError, http.client.HTTPException) as exc:
            return 0, repr(exc)
        finally:
            connection.close()
        if status != 200:
            return status, raw[:300].decode(errors="replace")
        shapes = [o["shape"] for o in json.loads(raw).get("outputs", [])]
        return (200, "") if shapes == [[1, 5], [1, 5]] else (200, f"outputs of shapes {shapes}")

    def run(self) -> None:
        deadline = time.monotonic() + LOAD_MAX_SECONDS
        while not self.stop.is_set() and self.sent < LOAD_MAX_REQUESTS and time.monotonic() < deadline:
            started = time.monotonic()
            status, problem = self.request()
            with self.lock:
                self.sent += 1
                self.slowest_s = max(self.slowest_s, time.monotonic() - started)
                if problem:
                    self.failures.append((status, problem))

    @property
    def running(self) -> bool:
        return any(thread.is_alive() for thread in self.threads)

    def sent_at_least(self, count: int) -> bool:
        assert self.running or self.sent >= count, f"the load ended at its bound after {self.sent} requests"
        return self.sent >= count

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)
        assert not self.running, "a load thread did not stop within 30 s"


def describe(*deployments) -> str:
    """The deployments' states, placements and last events (what a timed-out wait shows)."""
    lines = []
    for deployment in deployments:
        row = Deployment.objects.get(pk=deployment.pk)
        lines.append(f"{row.model.slug}: {row.state} active={row.active_version} target={row.target_version}")
        for p in row.placements.all():
            lines.append(f"  placement {p.state} served={p.served_version} canary={p.canary_version} "
                         f"gen={p.generation}/{p.applied_generation} {p.last_error}")  # fmt: skip
        for event in row.events.order_by("-pk")[:6]:
            lines.append(f"  event {event.kind}: {event.message[:200]}")
    return "\n".join(lines)


@pytest.mark.timeout(600)
def test_a_step_switched_through_the_ensemble_under_load_fails_no_request(
    owner, team, owner_client, start_agent, start_gateway, make_token, tmp_path
):
    agent, instance, ensemble = seed_pipeline_serving(owner, team, owner_client, start_agent, tmp_path)
    resnet = Deployment.objects.get(model__slug="resnet50")
    converted_step(owner, team, "resnet50", tmp_path, number=2)
    made = owner_client.post(
        "/api/v1/teams/vision/models/classify/ensemble-versions/update-step/",
        {"step": "resnet50", "version": 2},
        format="json",
    )
    assert made.status_code == 201, made.json()
    assert made.json()["state"] == VersionState.READY and [p["version"] for p in made.json()["pipeline"]] == [
        1,
        2,
        1,
    ]
    # The step alone still cannot move: the live ensemble calls v1.
    refused = owner_client.post(
        f"/api/v1/teams/vision/deployments/{resnet.pk}/switch/", {"version": 2}, format="json"
    )
    assert refused.status_code == 409, refused.json()

    _, token = make_token(name="load")
    gateway = start_gateway()
    wait_for(lambda: gateway.get("/v2/models/vision__classify/ready", token)[0] == 200, 30, "the route")
    image = np.random.default_rng(26).integers(0, 256, (1, 224, 224, 3), dtype=np.uint8)
    before = infer(gateway, "vision__classify", token, "raw_image", image, "UINT8")

    with Load(gateway, token, image) as load:
        wait_for(lambda: load.sent_at_least(5), 60, "the load to start")
        switch_started = load.sent
        switched = owner_client.post(
            f"/api/v1/teams/vision/deployments/{ensemble.pk}/switch/", {"version": 2}, format="json"
        )
        assert switched.status_code == 200, switched.json()

        def step_followed():
            e = Deployment.objects.get(pk=ensemble.pk)
            r = Deployment.objects.get(pk=resnet.pk)
            placement = r.placements.get()
            return (
                e.state == DeploymentState.SERVING
                and e.active_version.number == 2
                and r.state == DeploymentState.SERVING
                and r.active_version.number == 2
                and r.target_version_id is None
                and placement.served_version.number == 2
                and placement.canary_version_id is None
            )

        try:
            wait_for(step_followed, 240, "the step to follow its ensemble to v2", interval=0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{describe(ensemble, resnet)}\n{agent.output()[-3000:]}") from None
        during_switch = load.sent - switch_started
        wait_for(
            lambda: loaded_versions(instance).get("vision__resnet50") == ["2"], 60, "resnet50 v1 to unload"
        )
        settled_at = load.sent
        wait_for(lambda: load.sent_at_least(settled_at + 20), 60, "requests after the switch")
    assert load.failures == [], load.failures[:5]
    # Requests were in flight through the whole switch (both steps' versions loaded, the ensemble moved,
    # the step moved), not only before and after it.
    assert during_switch >= 10, during_switch
    loaded = loaded_versions(instance)
    assert loaded["vision__classify"] == ["2"] and loaded["vision__resnet50"] == ["2"], loaded
    events = list(Deployment.objects.get(pk=resnet.pk).events.values_list("kind", "message"))
    assert any("the ensembles calling resnet50 moved to it" in message for _, message in events), events
    # The same image, the same answer (v2 of the seed's resnet50 is built the same way).
    after = infer(gateway, "vision__classify", token, "raw_image", image, "UINT8")
    np.testing.assert_array_equal(after["predictions"], before["predictions"])
    print(
        f"step switch through the ensemble: {load.sent} requests ({during_switch} while it switched), "
        f"{len(load.failures)} failed, the slowest answered in {load.slowest_s:.1f} s"
    )


@pytest.mark.timeout(600)
@pytest.mark.browser
@requires_chromium
def test_the_playground_runs_the_ensemble_from_its_signature(
    owner, team, owner_client, viewer_client, start_agent, tmp_path, page, live_server
):
    _, _, ensemble = seed_pipeline_serving(owner, team, owner_client, start_agent, tmp_path)
    url = f"/api/v1/teams/vision/deployments/{ensemble.pk}/playground/"
    random = viewer_client.post(url, {}, format="json")
    assert random.status_code == 200, random.json()
    body = random.json()
    assert body["inputs"] == [
        {"name": "raw_image", "mode": "random", "shape": [1, 224, 224, 3], "datatype": "UINT8"}
    ]
    assert [(o["name"], o["shape"]) for o in body["outputs"]] == [("predictions", [1, 5]), ("scores", [1, 5])]

    # The seed's raw uint8 image as JSON values: the answer is the pipeline's, step by step.
    image = np.random.default_rng(3).integers(0, 256, (224, 224, 3), dtype=np.uint8)
    exact = owner_client.post(
        url, {"inputs": {"raw_image": {"mode": "json", "data": image.tolist()}}}, format="json"
    ).json()
    predictions = np.array(exact["outputs"][0]["data"])
    assert predictions.shape == (5,) and len(set(predictions.tolist())) == 5
    scores = np.array(exact["outputs"][1]["data"])
    assert list(scores) == sorted(scores, reverse=True)

    # In the browser: the deployment page offers the image input and runs it.
    login(page, live_server, "olivia")
    page.goto(f"{live_server.url}/teams/vision/deployments/{ensemble.pk}/")
    box = page.locator('.playground-input[data-input="raw_image"]')
    assert box.get_attribute("data-dtype") == "UINT8" and box.get_attribute("data-shape") == "-1,224,224,3"
    page.click("#playground-run")
    page.wait_for_selector("#playground-result :text('predictions')", timeout=60_000)
    assert "scores" in page.inner_text("#playground-result")


@pytest.mark.timeout(600)
def test_a_rolled_back_step_switch_unloads_the_companion_under_load(
    owner, team, owner_client, start_agent, start_gateway, make_token, tmp_path, settings
):
    """The ensemble's new version (resnet50 v2) rolled out as a canary, then rolled back: resnet50 v2 was
    loaded beside v1 for the canary and is unloaded once the canary is; v1 of both serves throughout."""
    settings.ROLLOUT_UNLOAD_DELAY_S = 0
    agent, instance, ensemble = seed_pipeline_serving(owner, team, owner_client, start_agent, tmp_path)
    resnet = Deployment.objects.get(model__slug="resnet50")
    converted_step(owner, team, "resnet50", tmp_path, number=2)
    made = owner_client.post(
        "/api/v1/teams/vision/models/classify/ensemble-versions/update-step/",
        {"step": "resnet50", "version": 2},
        format="json",
    )
    assert made.status_code == 201, made.json()
    _, token = make_token(name="load")
    gateway = start_gateway()
    wait_for(lambda: gateway.get("/v2/models/vision__classify/ready", token)[0] == 200, 30, "the route")
    image = np.random.default_rng(22).integers(0, 256, (1, 224, 224, 3), dtype=np.uint8)

    with Load(gateway, token, image) as load:
        wait_for(lambda: load.sent_at_least(5), 60, "the load to start")
        started = owner_client.post(
            f"/api/v1/teams/vision/deployments/{ensemble.pk}/rollouts/", {"version": 2}, format="json"
        )
        assert started.status_code == 201, started.json()

        def canary_loaded() -> bool:
            placement = Deployment.objects.get(pk=ensemble.pk).placements.get()
            return placement.canary_version is not None and placement.canary_version.number == 2

        try:
            wait_for(canary_loaded, 240, "the ensemble's canary v2 (and resnet50 v2 beside v1) to load")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{describe(ensemble, resnet)}\n{agent.output()[-3000:]}") from None
        assert loaded_versions(instance)["vision__resnet50"] == ["1", "2"]
        aborted = owner_client.post(
            f"/api/v1/teams/vision/deployments/{ensemble.pk}/rollouts/{started.json()['id']}/abort/"
        )
        assert aborted.status_code == 200, aborted.json()

        def rolled_back() -> bool:
            rollouts.check_rollouts()  # the beat's work: unload the ended canary, steps follow
            loaded = loaded_versions(instance)
            r = Deployment.objects.get(pk=resnet.pk)
            return (
                loaded.get("vision__classify") == ["1"]
                and loaded.get("vision__resnet50") == ["1"]
                and r.placements.get().canary_version_id is None
                and r.placements.get().is_applied()
            )

        try:
            wait_for(rolled_back, 180, "the canary and its companion step version to unload", interval=0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{describe(ensemble, resnet)}\n{agent.output()[-3000:]}") from None
        settled_at = load.sent
        wait_for(lambda: load.sent_at_least(settled_at + 10), 60, "requests after the rollback")
    assert load.failures == [], load.failures[:5]
    r = Deployment.objects.get(pk=resnet.pk)
    e = Deployment.objects.get(pk=ensemble.pk)
    assert r.state == e.state == DeploymentState.SERVING
    assert r.active_version.number == 1 and e.active_version.number == 1
    assert r.events.filter(kind="companion_unloaded").exists()
    print(
        f"step switch through the ensemble rolled back: {load.sent} requests, {len(load.failures)} failed, "
        f"the slowest answered in {load.slowest_s:.1f} s"
    )
