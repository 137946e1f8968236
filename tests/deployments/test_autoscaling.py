"""Autoscaling without agents or a gateway: the API's settings with their bounds, the page, and each
evaluation's decision applied to the rows (placements by the scheduler, events with the figures), sleep and
wake. The decision function itself is tested in ``test_scaling_policy.py``."""

from __future__ import annotations

import time

import pytest
from django.utils import timezone

from apps.deployments import autoscaling, services
from apps.deployments.models import Deployment, DeploymentState, PlacementState
from apps.fleet.models import Host, Pool
from apps.gateway import signals
from apps.gateway.autoscaling import parse_load, parse_map
from apps.registry.models import RegisteredModel
from tests.support.models import add_instance, make_version

BASE = "/api/v1/teams/vision/deployments/"


@pytest.fixture
def scheduled(owner, team):
    pool = Pool.objects.create(name="cpu", memory_budget_mb=1000)
    for i in range(3):
        host = Host.objects.create(
            name=f"h{i}", address="127.0.0.1", last_heartbeat_at=timezone.now(), pool=pool
        )
        add_instance(host, "cpu-0", 18100 + i)
    model = RegisteredModel.objects.create(team=team, name="M", slug="m", created_by=owner)
    version = make_version(model)
    version.footprint_mb = 100
    version.save(update_fields=["footprint_mb"])
    return services.deploy_version(actor=owner, model=model, version=version, replicas=1, pool=pool)


def live(deployment) -> int:
    return deployment.placements.filter(retiring_reason="").exclude(state=PlacementState.UNLOADED).count()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"min_replicas": -1, "max_replicas": 2}, "min_replicas"),
        ({"min_replicas": 1, "max_replicas": 0}, "max_replicas"),
        ({"min_replicas": 3, "max_replicas": 2}, "max_replicas"),
        ({"min_replicas": 1, "max_replicas": 500}, "max_replicas"),
        ({"min_replicas": 1, "max_replicas": 2, "target_in_flight": 0}, "target_in_flight"),
        ({"min_replicas": 1, "max_replicas": 2, "scale_down_window_s": -5}, "scale_down_window_s"),
        ({"min_replicas": 0, "max_replicas": 2, "idle_period_s": 0}, "idle_period_s"),
        ({"min_replicas": "x"}, "min_replicas"),
    ],
)
def test_bad_settings_are_a_400_naming_the_field(maintainer_client, scheduled, body, field):
    response = maintainer_client.post(f"{BASE}{scheduled.pk}/autoscaling/", body, format="json")
    assert response.status_code == 400, response.json()
    assert field in response.json()["fields"], response.json()


def test_max_replicas_is_bounded_by_the_quota(maintainer_client, scheduled, team):
    team.quota_instances = 3
    team.save()
    response = maintainer_client.post(
        f"{BASE}{scheduled.pk}/autoscaling/", {"min_replicas": 1, "max_replicas": 4}, format="json"
    )
    assert response.status_code == 400 and "Team quota" in response.json()["fields"]["max_replicas"][0]


def test_settings_are_shown_in_the_api_and_on_the_page(maintainer_client, client, owner, scheduled):
    body = {"min_replicas": 0, "max_replicas": 3, "target_in_flight": 2.5, "idle_period_s": 600}
    response = maintainer_client.post(f"{BASE}{scheduled.pk}/autoscaling/", body, format="json")
    assert response.status_code == 200, response.json()
    data = response.json()
    assert (data["min_replicas"], data["max_replicas"], data["target_in_flight"]) == (0, 3, 2.5)
    assert data["scale_down_window_s"] == 300 and data["idle_period_s"] == 600
    assert scheduled.events.filter(kind="autoscaling", message__contains="0..3 replicas").exists()
    client.force_login(owner)
    html = client.get(f"/teams/vision/deployments/{scheduled.pk}/").content.decode()
    assert "Autoscaling: 0..3 replicas, target 2.5 in flight per replica" in html
    assert "asleep after 600 s idle" in html


def test_a_pinned_deployment_is_not_autoscaled(maintainer_client, owner, team):
    host = Host.objects.create(name="p", address="127.0.0.1", last_heartbeat_at=timezone.now())
    instance = add_instance(host, "cpu-0", 18200)
    model = RegisteredModel.objects.create(team=team, name="P", slug="p", created_by=owner)
    deployment = services.deploy_version(
        actor=owner, model=model, version=make_version(model), instances=[instance]
    )
    response = maintainer_client.post(
        f"{BASE}{deployment.pk}/autoscaling/", {"min_replicas": 1, "max_replicas": 2}, format="json"
    )
    assert response.status_code == 400 and "min_replicas" in response.json()["fields"]


def test_evaluations_scale_up_at_once_down_after_the_window_and_to_zero_then_wake(owner, scheduled):
    autoscaling.configure(actor=owner, deployment=scheduled, values={
        "min_replicas": 0, "max_replicas": 3, "target_in_flight": 4, "scale_down_window_s": 60, "idle_period_s": 120})  # fmt: skip
    assert autoscaling.evaluate({scheduled.pk: (19.2, 10)}, now=1000) == {
        "up": 1,
        "down": 0,
        "asleep": 0,
        "unchanged": 0,
    }
    deployment = Deployment.objects.get(pk=scheduled.pk)
    assert deployment.replicas == 3 and live(deployment) == 3  # 5 wanted, capped at max
    event = deployment.events.filter(kind="autoscaled").first()
    assert event.message == "1 -> 3 replicas: 19.2 in flight per replica, target 4"
    assert event.details["in_flight"] == 19.2 and event.details["to"] == 3
    # Missing figures (the gateway did not answer) decide nothing.
    assert autoscaling.evaluate({}, now=1010)["unchanged"] == 0
    # Quiet: held for the window, then down to 1, then asleep after the idle period.
    for at in range(1005, 1060, 5):
        autoscaling.evaluate({scheduled.pk: (0, 10)}, now=at)
    assert Deployment.objects.get(pk=scheduled.pk).replicas == 3
    autoscaling.evaluate({scheduled.pk: (0, 10)}, now=1065)
    deployment = Deployment.objects.get(pk=scheduled.pk)
    assert deployment.replicas == 1 and live(deployment) == 1
    assert deployment.placements.filter(unload=True).count() == 2
    # Not while its replica is still loading (a request that woke it would be held at the gateway, unseen).
    autoscaling.evaluate({scheduled.pk: (0, 10)}, now=1121)
    assert Deployment.objects.get(pk=scheduled.pk).replicas == 1
    deployment.placements.filter(unload=False).update(state=PlacementState.READY)
    autoscaling.evaluate({scheduled.pk: (0, 10)}, now=1122)
    assert Deployment.objects.get(pk=scheduled.pk).replicas == 1  # the idle period counts from then
    autoscaling.evaluate({scheduled.pk: (0, 10)}, now=1242)
    deployment = Deployment.objects.get(pk=scheduled.pk)
    assert deployment.replicas == 0 and live(deployment) == 0 and deployment.asleep_since is not None
    # A held request wakes it once.
    assert autoscaling.wake(deployment.pk) is True
    assert autoscaling.wake(deployment.pk) is False
    deployment = Deployment.objects.get(pk=scheduled.pk)
    assert deployment.replicas == 1 and live(deployment) == 1 and deployment.asleep_since is None
    autoscaling.record_cold_start(deployment.pk, 2046)
    assert Deployment.objects.get(pk=deployment.pk).last_cold_start_ms == 2046


def test_growth_beyond_the_quota_is_capped_and_says_why(owner, scheduled, team):
    autoscaling.configure(actor=owner, deployment=scheduled, values={"min_replicas": 1, "max_replicas": 3})
    team.quota_instances = 2
    team.save()
    autoscaling.evaluate({scheduled.pk: (40, 1)}, now=0)
    deployment = Deployment.objects.get(pk=scheduled.pk)
    assert deployment.replicas == 2
    assert deployment.events.filter(kind="autoscale_capped", message__contains="team quota leaves 2").exists()


def test_the_gateway_figures_are_read_per_deployment():
    text = "\n".join([
        'haproxy_backend_current_sessions{proxy="s0"} 3',
        'haproxy_backend_current_queue{proxy="s0"} 2',
        'haproxy_backend_current_sessions{proxy="gs0"} 1',
        'haproxy_backend_current_sessions{proxy="s1"} 4',
        'haproxy_backend_http_requests_total{proxy="s0"} 120',
        'haproxy_backend_http_requests_total{proxy="s1"} 7',
        'haproxy_backend_current_sessions{proxy="s2"} 9',
    ])  # fmt: skip
    # s1 is d7's canary slot (counted with d7); s2 is free.
    assert parse_load(text, {"s0": "d7", "s1": "d7c"}) == {7: (10.0, 127, None)}
    # HAProxy's average time per request, weighted by each backend's count.
    timed = text + "\n" + "\n".join([
        'haproxy_backend_total_time_average_seconds{proxy="s0"} 0.010',
        'haproxy_backend_total_time_average_seconds{proxy="s1"} 0.100',
    ])  # fmt: skip
    in_flight, total, avg = parse_load(timed, {"s0": "d7", "s1": "d7c"})[7]
    assert (in_flight, total) == (10.0, 127) and avg == pytest.approx((120 * 0.01 + 7 * 0.1) / 127)
    assert parse_map("0x55d1 d12 1796160737\n0x55d2 d3 2046\n") == {"d12": 1796160737, "d3": 2046}


def test_the_deploy_form_sets_autoscaling_with_its_bounds_in_one_commit(client, owner, team):
    pool = Pool.objects.create(name="cpu", memory_budget_mb=1000)
    host = Host.objects.create(name="hf", address="127.0.0.1", last_heartbeat_at=timezone.now(), pool=pool)
    add_instance(host, "cpu-0", 18500)
    model = RegisteredModel.objects.create(team=team, name="Sleepy", slug="sleepy", created_by=owner)
    make_version(model)
    client.force_login(owner)
    form = {"model": "sleepy", "version": 1, "placement": "pool", "replicas": 1, "pool": "cpu", "spread": "host",
            "autoscale": "on", "min_replicas": 3, "max_replicas": 2, "idle_period_s": 60}  # fmt: skip
    response = client.post("/teams/vision/deployments/new/", form)
    assert response.status_code == 400
    html = response.content.decode()
    assert 'data-field="max_replicas">max_replicas (2) is below min_replicas (3)' in html
    assert not Deployment.objects.filter(model=model).exists()  # the deploy is rolled back with it
    response = client.post("/teams/vision/deployments/new/", {**form, "min_replicas": 0, "idle_period_s": 0})
    assert response.status_code == 400 and 'data-field="idle_period_s">Give 1 to' in response.content.decode()
    response = client.post(
        "/teams/vision/deployments/new/",
        {**form, "min_replicas": 0, "idle_period_s": 120, "target_in_flight": 2.5},
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    deployment = Deployment.objects.get(model=model)
    assert (deployment.min_replicas, deployment.max_replicas, deployment.idle_period_s) == (0, 2, 120)
    assert deployment.target_in_flight == 2.5
    # Without the box ticked the fields are ignored: a plain deployment.
    page = client.get("/teams/vision/deployments/new/?model=sleepy").content.decode()
    assert 'id="id_autoscale"' in page and 'name="idle_period_s"' in page


def test_the_replica_chart_has_the_counts_over_time_and_the_decisions_as_markers(
    maintainer_client, owner, scheduled
):
    autoscaling.configure(actor=owner, deployment=scheduled, values={
        "min_replicas": 0, "max_replicas": 3, "target_in_flight": 4, "scale_down_window_s": 0, "idle_period_s": 60})  # fmt: skip
    now = time.time() // 60 * 60 - 20 * 60  # 20 minutes ago, on a minute
    autoscaling.evaluate({scheduled.pk: (0, 0)}, now=now)  # 1 desired, 0 ready: the first sample
    autoscaling.evaluate({scheduled.pk: (0, 0)}, now=now + 5)  # unchanged: no sample
    autoscaling.evaluate({scheduled.pk: (19.2, 10)}, now=now + 60)  # 1 -> 3
    Deployment.objects.get(pk=scheduled.pk).placements.update(state=PlacementState.READY)
    autoscaling.evaluate({scheduled.pk: (12, 20)}, now=now + 120)  # 3 ready now
    samples = list(Deployment.objects.get(pk=scheduled.pk).replica_samples.values_list("desired", "ready"))
    assert samples == [(1, 0), (3, 0), (3, 3)]

    reply = maintainer_client.get(
        f"/api/v1/teams/vision/models/m/metrics/?deployment={scheduled.pk}&range=1h"
    )
    assert reply.status_code == 200, reply.content
    replicas = reply.json()["replicas"]
    stamps = reply.json()["timestamps"]
    at = {stamp: i for i, stamp in enumerate(stamps)}
    first = at[int(now)]
    assert replicas["desired"][first - 1] is None  # before the first sample: nothing known
    assert (replicas["desired"][first], replicas["ready"][first]) == (1, 0)
    assert (replicas["desired"][first + 1], replicas["ready"][first + 1]) == (3, 0)
    assert (replicas["desired"][first + 2], replicas["ready"][first + 2]) == (3, 3)
    assert (replicas["desired"][first + 10], replicas["ready"][first + 10]) == (3, 3)  # carried on
    assert (replicas["desired_now"], replicas["ready_now"], replicas["max_replicas"]) == (3, 3, 3)
    scaled = [m for m in replicas["markers"] if m["kind"] == "autoscaled"]
    assert [m["label"] for m in scaled] == ["1→3"]
    assert scaled[0]["message"] == "1 -> 3 replicas: 19.2 in flight per replica, target 4"

    # A shorter range starting after the samples still carries the last value in.
    reply = maintainer_client.get(
        f"/api/v1/teams/vision/models/m/metrics/?deployment={scheduled.pk}&range=15m"
    )
    assert set(reply.json()["replicas"]["desired"][:5]) == {3}
    # A deployment with a fixed replica count has no replica chart.
    autoscaling.configure(actor=owner, deployment=scheduled, values={"min_replicas": None})
    reply = maintainer_client.get(f"/api/v1/teams/vision/models/m/metrics/?deployment={scheduled.pk}")
    assert reply.json()["replicas"] is None


def test_a_settled_sleeping_deployment_costs_an_evaluation_nothing_until_a_request_is_in_flight(
    owner, scheduled, django_assert_max_num_queries
):
    """Most of a dense pool's deployments sleep: once asleep with its last replica gone (charted 0 / 0), an
    evaluation without a request in flight neither locks nor writes it."""
    autoscaling.configure(actor=owner, deployment=scheduled, values={"min_replicas": 0, "idle_period_s": 60})
    autoscaling.sleep(actor=owner, deployment=scheduled, now=1000)
    scheduled.placements.update(state=PlacementState.UNLOADED)
    autoscaling.evaluate({scheduled.pk: (0, 10)}, now=1001)  # charts ready 0 now that the replica is gone
    deployment = Deployment.objects.get(pk=scheduled.pk)
    assert deployment.scaling_memory["sampled"] == [0, 0]
    saved = deployment.scaling_memory
    with django_assert_max_num_queries(2):  # the ids, the live rollouts
        assert autoscaling.evaluate({scheduled.pk: (0, 10)}, now=1002)["unchanged"] == 1
    assert Deployment.objects.get(pk=scheduled.pk).scaling_memory == saved
    # A request in flight (queued at its backend) is decided as before: it wakes.
    assert autoscaling.evaluate({scheduled.pk: (2, 12)}, now=1003)["up"] == 1
    assert Deployment.objects.get(pk=scheduled.pk).replicas == 1


def test_the_autoscalers_figures_alone_do_not_poke_the_gateway(
    scheduled, monkeypatch, django_capture_on_commit_callbacks
):
    """The autoscaler saves each deployment's figures every tick; only a change of what is routed makes the
    gateway sync at once - that deployment alone (the autoscaler saves one at every wake-up and sleep), while
    an undeploying one asks for a full sync, which follows its replicas' drain."""
    pokes = []
    monkeypatch.setattr(signals, "poke_gateway", lambda *named: pokes.append(named))
    with django_capture_on_commit_callbacks(execute=True):
        scheduled.scaling_memory = {"last_total": 3}
        scheduled.save(update_fields=["scaling_memory"])
    assert pokes == []
    with django_capture_on_commit_callbacks(execute=True):
        scheduled.replicas = 2
        scheduled.save(update_fields=["replicas", "updated_at"])
    assert pokes == [(scheduled.pk,)]
    with django_capture_on_commit_callbacks(execute=True):
        scheduled.state = DeploymentState.UNDEPLOYING
        scheduled.save(update_fields=["state", "updated_at"])
    assert pokes == [(scheduled.pk,), ()]


def test_a_woken_deployment_does_not_sleep_before_the_request_that_woke_it_went_on(owner, scheduled):
    """Under a stream a wake-up can wait for room and load for longer than the idle period: serving, but
    with the waking request still held at the gateway (its cold start not recorded), it stays awake - it
    went back to sleep the moment its replica served and the held request needed a second load."""
    autoscaling.configure(actor=owner, deployment=scheduled, values={
        "min_replicas": 0, "max_replicas": 1, "scale_down_window_s": 0, "idle_period_s": 5})  # fmt: skip
    autoscaling.sleep(actor=owner, deployment=Deployment.objects.get(pk=scheduled.pk))
    woken_at = time.time()
    assert autoscaling.wake(scheduled.pk, now=woken_at)
    deployment = Deployment.objects.get(pk=scheduled.pk)
    deployment.placements.filter(unload=False).update(state=PlacementState.READY)

    autoscaling.evaluate({scheduled.pk: (0, 10)}, now=woken_at + 20)  # idle "for 20 s", request still held
    assert Deployment.objects.get(pk=scheduled.pk).replicas == 1
    autoscaling.record_cold_start(scheduled.pk, 20_000)  # it went on
    autoscaling.evaluate({scheduled.pk: (0, 11)}, now=woken_at + 21)  # served it
    autoscaling.evaluate({scheduled.pk: (0, 11)}, now=woken_at + 27)  # then idle for its idle period
    assert Deployment.objects.get(pk=scheduled.pk).replicas == 0
