"""Scale to zero when things go wrong, with a real host agent, tritonserver and the gateway:

* a sleeping model whose version can no longer load (its model file broken on the platform's store) answers
  the held request 503 with Retry-After and Triton's reason well within the activation timeout, while the
  other model on the same instance keeps answering 200 throughout;
* restarts keep the autoscaling state: after the gateway command is restarted and the autoscaler's beat
  runs in a fresh process (as after a platform restart), a sleeping model stays asleep with its settings,
  and the next request wakes it and is answered.

The autoscaler's evaluations are driven by the test (the first model would otherwise sleep on its own while
the test waits); the scheduler's tick runs while a request waits, as beat runs it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import unquote

import pytest

from apps.deployments.models import Deployment
from apps.gateway.state import wake_failure_value
from tests.conftest import wait_for
from tests.support.servers import (
    asleep_and_unloaded,
    requires_haproxy,
    serve_in_pool,
    ticking,
    timed_infer,
    while_the_scheduler_ticks,
)

pytestmark = [pytest.mark.triton, requires_haproxy, pytest.mark.django_db(transaction=True)]

URL = "/api/v1/teams/vision/deployments/"
ROOT = Path(__file__).resolve().parents[2]
POLICY = {
    "min_replicas": 0,
    "max_replicas": 1,
    "target_in_flight": 3,
    "scale_down_window_s": 0,
    "idle_period_s": 2,
}


@pytest.fixture(autouse=True)
def _no_rate_limit(team):
    team.quota_requests_per_second = 1_000_000
    team.save()


def serve_two(owner_client, owner, team, start_agent, make_scaler_version, artifact_root):
    """``steady`` and ``sleepy`` SERVING on one instance, ``sleepy`` set to scale to zero."""
    _, agent, deployments = serve_in_pool(
        owner_client, owner, team, start_agent, make_scaler_version, artifact_root, 8192,
        {"steady": 2.0, "sleepy": 3.0},
    )  # fmt: skip
    response = owner_client.post(f"{URL}{deployments['sleepy']}/autoscaling/", POLICY, format="json")
    assert response.status_code == 200, response.json()
    return agent, deployments


def test_a_model_that_cannot_load_answers_503_with_the_reason_and_the_other_keeps_answering(
    owner_client, owner, team, start_agent, make_scaler_version, start_gateway, make_token, artifact_root,
    gateway_env, settings,
):  # fmt: skip
    agent, deployments = serve_two(owner_client, owner, team, start_agent, make_scaler_version, artifact_root)
    gateway = start_gateway()
    settings.GATEWAY_METRICS_URL = f"http://{gateway_env['GATEWAY_STATS_BIND']}/metrics"
    _, secret = make_token(name="wake-failure")
    wait_for(ticking(lambda: asleep_and_unloaded(deployments["sleepy"])), 90, "sleepy to sleep and unload")
    # Its model file breaks on the platform's store while it sleeps: the agent downloads it again on waking.
    sleepy = Deployment.objects.get(pk=deployments["sleepy"])
    (sleepy.active_version.servable_dir() / "1" / "model.onnx").write_bytes(b"this is not an onnx model")

    steady_results: list[int] = []
    stop = threading.Event()

    def keep_calling_steady() -> None:
        while not stop.is_set() and len(steady_results) < 2000:
            steady_results.append(timed_infer(gateway, "vision__steady", secret, timeout=30)[0])
            time.sleep(0.05)

    caller = threading.Thread(target=keep_calling_steady, daemon=True)
    caller.start()
    try:
        # The scheduler's beat places the woken replica.
        answered = while_the_scheduler_ticks(lambda: timed_infer(gateway, "vision__sleepy", secret))
        assert answered, f"no answer\n{agent.output()[-3000:]}\n{gateway.output()}"
        status, headers, seconds, body = answered[0]
        assert status == 503, (answered, agent.output()[-3000:])
        assert "could not be woken" in body["error"], body
        # Triton's own reason for the failed load, not only "timed out".
        # Triton's reason as the platform recorded it (a placement's error, which a later reconcile may
        # overwrite, or the deployment's events), as the gateway may write it: plain characters only.
        sleepy = Deployment.objects.get(pk=deployments["sleepy"])
        recorded = [e for e in sleepy.placements.values_list("last_error", flat=True) if e]
        recorded += [m for m in sleepy.events.values_list("message", flat=True) if "INVALID_PROTOBUF" in m]
        given = body["error"].split("could not be woken: ", 1)[1][:40]
        assert any(given in unquote(wake_failure_value(text)) for text in recorded), (body, recorded)
        assert headers.get("retry-after"), headers
        assert seconds < settings.GATEWAY_ACTIVATION_TIMEOUT_S, seconds
        # The next request is answered at once with the same reason (no second wait for the timeout).
        again = timed_infer(gateway, "vision__sleepy", secret)
        assert again[0] == 503 and again[2] < 5 and "could not be woken" in again[3]["error"], again
    finally:
        stop.set()
        caller.join(30)
    assert len(steady_results) > 10 and set(steady_results) == {200}, steady_results[-20:]
    print(
        f"wake failure: 503 with the reason after {seconds:.2f} s; steady answered {len(steady_results)} x 200"
    )


def beat_in_a_fresh_process(gateway_env: dict, metrics_url: str) -> str:
    """One autoscaler tick in a new Python process (a restarted beat/worker), against the same database."""
    code = (
        "import django; django.setup(); from apps.gateway import autoscaling; print(autoscaling.autoscale())"
    )
    env = {
        **gateway_env,
        "DJANGO_SETTINGS_MODULE": "serving_platform.settings",
        "GATEWAY_METRICS_URL": metrics_url,
    }
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_restarts_of_the_gateway_and_the_platform_keep_a_sleeping_model_asleep_until_its_next_request(
    owner_client, owner, team, start_agent, make_scaler_version, start_gateway, make_token, artifact_root,
    gateway_env, settings,
):  # fmt: skip
    agent, deployments = serve_two(owner_client, owner, team, start_agent, make_scaler_version, artifact_root)
    gateway = start_gateway()
    metrics_url = f"http://{gateway_env['GATEWAY_STATS_BIND']}/metrics"
    settings.GATEWAY_METRICS_URL = metrics_url
    _, secret = make_token(name="restarts")
    pk = deployments["sleepy"]
    wait_for(ticking(lambda: asleep_and_unloaded(pk)), 90, "sleepy to sleep and unload")
    before = Deployment.objects.get(pk=pk)

    gateway = start_gateway()  # the gateway command restarted, from its directory
    # The beat restarted too: fresh processes evaluate, with the new gateway's counters started at zero.
    for _ in range(3):
        beat_in_a_fresh_process(gateway_env, metrics_url)  # each a new process: seconds apart
    after = Deployment.objects.get(pk=pk)
    assert after.replicas == 0 and after.asleep_since == before.asleep_since
    assert (after.min_replicas, after.max_replicas, after.target_in_flight, after.idle_period_s) == (
        0, 1, 3.0, 2,
    )  # fmt: skip
    assert not after.events.filter(kind="woken").exists()
    assert asleep_and_unloaded(pk)
    # The steady model was never asleep and still answers through the restarted gateway.
    assert timed_infer(gateway, "vision__steady", secret)[0] == 200

    answered = while_the_scheduler_ticks(lambda: timed_infer(gateway, "vision__sleepy", secret))
    assert answered and answered[0][0] == 200, (answered, agent.output()[-3000:], gateway.output())
    assert answered[0][3]["outputs"][0]["data"][:4] == [3.0, 6.0, 9.0, 12.0], answered[0][3]
    woken = Deployment.objects.get(pk=pk)
    assert woken.replicas == 1 and woken.asleep_since is None
    assert woken.events.filter(kind="woken").count() == 1
    print(f"after restarts: the sleeping model woke on its next request in {answered[0][2]:.2f} s")
