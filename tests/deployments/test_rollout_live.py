"""Progressive rollouts end to end: a real host agent with a real tritonserver, the real HAProxy gateway splitting
unversioned requests by the rollout's weight, a bounded keep-alive client (no retry) counting every answer, and
the beat task run in a thread of the test process (``Beat``) the way celery beat runs it."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connections
from django.utils import timezone

from apps.audit.models import AuditEvent
from apps.deployments import rollouts
from apps.deployments.models import Deployment, DeploymentState, Rollout, RolloutState
from apps.fleet.models import TritonInstance
from apps.registry.models import ModelVersion, RegisteredModel
from tests.conftest import wait_for
from tests.deployments.rollout_models import flaky_scaler_onnx, slow_scaler_onnx
from tests.factories import ready_onnx_version
from tests.support.models import scaler_onnx
from tests.support.servers import Load, deploy, ready_instance, requires_haproxy

pytestmark = [pytest.mark.triton, requires_haproxy, pytest.mark.django_db(transaction=True)]
INTERVAL = 2
BEAT_TICK = 0.25  # seconds between two runs of the rollout checks in ``Beat``


class Beat:
    """``rollouts.check_rollouts`` every ``tick`` seconds in a thread, as the beat task runs it."""

    def __init__(self, tick: float = BEAT_TICK) -> None:
        self.tick, self.errors = tick, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Beat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self.errors, self.errors

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.tick):
                try:
                    rollouts.check_rollouts()
                except Exception as exc:  # noqa: BLE001 - reported by stop()
                    self.errors.append(repr(exc))
        finally:
            connections.close_all()


@pytest.fixture(autouse=True)
def _no_rate_limit(team):
    team.quota_requests_per_second = 1_000_000
    team.save()


@pytest.fixture
def make_onnx_version(artifact_root, tmp_path):
    """A READY version of ``model`` from ONNX bytes, through the real ONNX preparation."""

    def _make(model: RegisteredModel, onnx_bytes: bytes) -> ModelVersion:
        return ready_onnx_version(
            model, onnx_bytes, tmp_path, preferred_batch_sizes=(4, 8), max_queue_delay_us=100
        )

    return _make


@pytest.fixture
def scaler(owner_client, owner, team, start_agent, make_onnx_version, start_gateway, make_token):
    """v1 (x2) SERVING on one instance behind the gateway, and a token; the test adds canaries."""

    def _setup(summaries: bool = False):
        agent = start_agent("host-a")
        if summaries:  # before the agent starts its server (it reads the instance when it joins)
            TritonInstance.objects.filter(host__name="host-a").update(latency_summaries=True)
        _, instance = ready_instance(lambda name: agent, "host-a")
        model = RegisteredModel.objects.create(team=team, name="Scaler", slug="scaler", created_by=owner)
        make_onnx_version(model, scaler_onnx(2.0))
        deployment = deploy(owner_client, "vision", "scaler", 1, [instance])
        gateway = start_gateway()
        _, secret = make_token(name="load")
        wait_for(lambda: gateway.infer("vision__scaler", secret)[0] == 200, 15, "the first request")
        return model, deployment, gateway, secret, agent

    return _setup


def past(moment, what: str) -> None:
    """Wait (bounded) until ``moment`` - a time something is due - has passed."""
    assert moment is not None, f"no time for {what}"
    bound = (moment - timezone.now()).total_seconds() + 5
    wait_for(lambda: timezone.now() > moment, max(bound, 1), what, interval=0.05)


def start(client, deployment, version: int, **options):
    body = {
        "version": version,
        "step_interval_s": INTERVAL,
        "min_requests": 10,
        "traffic_deadline_s": 60,  # also the bound on loading the canary
        **options,
    }
    response = client.post(f"/api/v1/teams/vision/deployments/{deployment.pk}/rollouts/", body, format="json")
    assert response.status_code == 201, response.json()
    return Rollout.objects.get(pk=response.json()["id"])


def ended(rollout: Rollout, state: RolloutState, timeout: float, agent) -> Rollout:
    return wait_for(
        lambda: Rollout.objects.filter(pk=rollout.pk, state=state).first(),
        timeout,
        f"the rollout to be {state} ({Rollout.objects.get(pk=rollout.pk).state})\n{agent.output()}",
        interval=0.2,
    )


def serving(deployment: Deployment, version: ModelVersion, agent, timeout: float = 60) -> Deployment:
    return wait_for(
        lambda: Deployment.objects.filter(pk=deployment.pk, state=DeploymentState.SERVING, active_version=version)
        .first(),
        timeout,
        f"{version} to serve alone\n{agent.output()}",
    )  # fmt: skip


def test_a_good_canary_is_promoted_step_by_step_with_no_failed_request(
    scaler, owner_client, make_onnx_version
):
    model, deployment, gateway, secret, agent = scaler()
    v2 = make_onnx_version(model, scaler_onnx(3.0))
    with (
        Beat(),
        Load(gateway, "vision__scaler", secret, threads=3, max_seconds=150) as load,
    ):
        load.wait_for_requests(50)
        rollout = start(owner_client, deployment, 2, steps=[25, 50, 100])
        ended(rollout, RolloutState.PROMOTED, 90, agent)
        serving(deployment, v2, agent)
        load.wait_for_requests(100)
    print(f"good canary: {load.total} requests, statuses {dict(load.statuses)}, outputs {dict(load.outputs)}")
    assert load.failures == [], load.failures[:5]
    assert load.outputs[2.0] > 0 and load.outputs[3.0] > 0
    checks = list(rollout.analyses.filter(waiting=False).order_by("checked_at"))
    assert [c.weight for c in checks if c.passed] == [25, 50, 100]
    assert all(c.passed for c in checks)
    assert all(c.figures["canary"]["requests"] >= 10 for c in checks)
    assert all(c.figures["canary"]["success_rate"] == 1.0 for c in checks)
    # The weights the gateway applied are what the clients saw: the canary's share grew with the steps.
    weights = [
        e.details["weight"] for e in deployment.events.filter(kind="rollout_step").order_by("created_at")
    ]
    assert weights == [25, 50, 100]
    status, answer = gateway.infer("vision__scaler", secret)
    assert status == 200 and answer["model_version"] == "2"
    assert gateway.infer("vision__scaler", secret, version=1)[0] != 200  # v1 unloaded


def test_a_canary_failing_30_percent_is_rolled_back_within_the_gates_while_stable_answers(
    scaler, owner_client, make_onnx_version, settings
):
    model, deployment, gateway, secret, agent = scaler()
    v1 = deployment.active_version
    make_onnx_version(model, flaky_scaler_onnx(3.0))
    stable_answers = []
    with (
        Beat(),
        Load(gateway, "vision__scaler", secret, threads=3, max_seconds=120) as load,
    ):
        load.wait_for_requests(50)
        rollout = start(owner_client, deployment, 2, steps=[20, 50, 100], max_failed_checks=3)
        rollout = ended(rollout, RolloutState.ROLLED_BACK, 60, agent)
        # Versioned calls to the stable version throughout the rollout and after.
        stable_answers += [gateway.infer("vision__scaler", secret, version=1)[0] for _ in range(20)]
        wait_for(
            lambda: not deployment.placements.filter(canary_version__isnull=False).exists(),
            30,
            "the canary unloaded",
        )
        failed_before = len(load.failures)
        load.wait_for_requests(200)
    print(f"bad canary: {load.total} requests, statuses {dict(load.statuses)}, outputs {dict(load.outputs)}")
    # Rolled back within max_failed_checks x interval of the canary getting traffic (slack for a loaded machine).
    took = (rollout.finished_at - rollout.step_started_at).total_seconds()
    assert took <= 3 * INTERVAL + 2.0, took
    assert rollout.current_weight == 0 and "3 failed checks in a row at 20 %" in rollout.reason
    assert "success rate" in rollout.reason
    checks = list(rollout.analyses.filter(waiting=False))
    assert len(checks) == 3 and not any(c.passed for c in checks)
    assert all(c.figures["canary"]["success_rate"] < 0.95 for c in checks)
    assert all(c.figures["stable"]["success_rate"] == 1.0 for c in checks)
    audit = AuditEvent.objects.get(action="rollout.rolled_back")
    assert audit.details["figures"]["failed_gates"][0]["gate"] == "success_rate"
    # Clients saw only the canary's failures (its error, never the stable version's), and none after.
    assert load.failures and all("Gather" in failure for failure in load.failures), load.failures[:3]
    assert len(load.failures) == failed_before
    assert len(load.failures) < 0.2 * load.total
    assert stable_answers == [200] * 20
    deployment.refresh_from_db()
    assert deployment.active_version == v1 and deployment.state == DeploymentState.SERVING
    assert gateway.infer("vision__scaler", secret, version=2)[0] != 200  # the canary is unloaded


def test_a_slow_canary_is_rolled_back_by_the_latency_gate(scaler, owner_client, make_onnx_version):
    model, deployment, gateway, secret, agent = scaler(summaries=True)
    # Eight products: a p99 several times the 15 ms gate on any machine (three came within 1 ms of it on some).
    make_onnx_version(model, slow_scaler_onnx(3.0, rounds=8))
    with (
        Beat(),
        Load(gateway, "vision__scaler", secret, threads=3, max_seconds=120) as load,
    ):
        load.wait_for_requests(50)
        rollout = start(owner_client, deployment, 2, steps=[30, 100], max_p99_ms=15, max_p99_ratio=4)
        rollout = ended(rollout, RolloutState.ROLLED_BACK, 60, agent)
    print(f"slow canary: {load.total} requests, statuses {dict(load.statuses)}")
    assert load.failures == [], load.failures[:5]
    checks = list(rollout.analyses.filter(waiting=False))
    gates = {gate["gate"] for check in checks for gate in check.failed_gates}
    assert "p99_ms" in gates, [c.failed_gates for c in checks]
    for check in checks:
        canary, stable = check.figures["canary"], check.figures["stable"]
        assert canary["success_rate"] == 1.0
        assert canary["p99_ms"] > 15 and canary["p99_ms"] > stable["p99_ms"], check.figures
        assert canary["p50_ms"] <= canary["p99_ms"]
    assert "p99" in rollout.reason


def test_pause_resume_promote_and_abort_through_the_api(scaler, owner_client, make_onnx_version):
    model, deployment, gateway, secret, agent = scaler()
    v2 = make_onnx_version(model, scaler_onnx(3.0))
    make_onnx_version(model, scaler_onnx(4.0))
    url = f"/api/v1/teams/vision/deployments/{deployment.pk}/rollouts/"
    with (
        Beat(),
        Load(gateway, "vision__scaler", secret, threads=2, max_seconds=150) as load,
    ):
        rollout = start(owner_client, deployment, 2, steps=[40, 100])
        wait_for(
            lambda: Rollout.objects.get(pk=rollout.pk).current_weight == 40, 60, "weight 40", interval=0.2
        )
        due = Rollout.objects.get(pk=rollout.pk).next_check_at
        assert owner_client.post(f"{url}{rollout.pk}/pause/").json()["state"] == "PAUSED"
        checks = rollout.analyses.count()
        # Nothing may happen while paused: wait past the check the running rollout was due for, and two beat
        # ticks more (the beat would have run it by then).
        past(due + timedelta(seconds=2 * BEAT_TICK), "the check the paused rollout was due for")
        paused = Rollout.objects.get(pk=rollout.pk)
        assert paused.state == RolloutState.PAUSED and paused.current_weight == 40
        assert rollout.analyses.count() == checks  # no check while paused
        wait_for(lambda: load.outputs[3.0] > 20, 20, "the canary answering at 40 % while paused")
        assert owner_client.post(f"{url}{rollout.pk}/resume/").json()["state"] == "RUNNING"
        wait_for(lambda: rollout.analyses.count() > checks, 20, "checks again after resume")
        assert owner_client.post(f"{url}{rollout.pk}/promote/").json()["state"] == "PROMOTED"
        serving(deployment, v2, agent)

        third = start(owner_client, deployment, 3, steps=[50, 100], step_interval_s=30)
        wait_for(lambda: Rollout.objects.get(pk=third.pk).current_weight == 50, 60, "weight 50", interval=0.2)
        wait_for(lambda: load.outputs[4.0] > 20, 20, "answers from v3")
        aborted = owner_client.post(f"{url}{third.pk}/abort/").json()
        assert aborted["state"] == "ABORTED" and aborted["current_weight"] == 0
        wait_for(
            lambda: not deployment.placements.filter(canary_version__isnull=False).exists(), 30, "v3 unloaded"
        )
        seen = load.outputs[4.0]
        load.wait_for_requests(200)
        assert load.outputs[4.0] == seen  # nothing reaches the aborted canary
    print(f"pause/resume/promote/abort: {load.total} requests, statuses {dict(load.statuses)}")
    assert load.failures == [], load.failures[:5]
    actions = set(AuditEvent.objects.filter(action__startswith="rollout.").values_list("action", flat=True))
    assert actions == {
        "rollout.started",
        "rollout.paused",
        "rollout.resumed",
        "rollout.promoted",
        "rollout.aborted",
    }


def test_a_platform_restart_mid_rollout_resumes_it_and_the_gateway_restores_the_split(
    scaler, owner_client, make_onnx_version, start_gateway
):
    model, deployment, gateway, secret, agent = scaler()
    v2 = make_onnx_version(model, scaler_onnx(3.0))
    beat = Beat().__enter__()
    rollout = start(owner_client, deployment, 2, steps=[50, 100], step_interval_s=4)
    wait_for(lambda: Rollout.objects.get(pk=rollout.pk).current_weight == 50, 60, "weight 50", interval=0.2)
    # The platform goes down: beat and gateway stop; the agents keep serving.
    beat.stop()
    gateway.stop()
    # Down until the step's check is overdue (and a beat tick more): it must run after the restart.
    due = Rollout.objects.get(pk=rollout.pk).next_check_at
    past(
        due + timedelta(seconds=BEAT_TICK), "the rollout's next check to fall due while the platform is down"
    )
    assert Rollout.objects.get(pk=rollout.pk).state == RolloutState.RUNNING
    gateway = start_gateway()
    wait_for(lambda: gateway.infer("vision__scaler", secret)[0] == 200, 15, "the restarted gateway")
    with Load(gateway, "vision__scaler", secret, threads=2, max_seconds=90) as load:
        load.wait_for_requests(200)
        # The split comes back from the database: both versions answer unversioned requests.
        assert load.outputs[2.0] > 0 and load.outputs[3.0] > 0, load.outputs
        with Beat():
            ended(rollout, RolloutState.PROMOTED, 60, agent)
            serving(deployment, v2, agent)
    print(f"restart: {load.total} requests, statuses {dict(load.statuses)}, outputs {dict(load.outputs)}")
    assert load.failures == [], load.failures[:5]
    # The overdue check ran after the restart, judging the traffic since the last judged one.
    assert rollout.analyses.filter(passed=True, weight=50).exists()
