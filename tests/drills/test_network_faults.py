"""Network drills: hosts in their own network namespaces (real agents, tritonservers), the gateway (HAProxy)
and the platform in the root namespace, faults made with iptables and the fault proxy - each under gateway
load from bounded real clients. The beat's scheduler tick (``healing.tick``) is driven by the tests as beat
would run it. Each drill records its figures (``record_figures``; ``benchmarks/drills.py`` prints them).
See ``docs/operators/network-faults.md`` for what the platform does in each case."""

from __future__ import annotations

import time

import pytest

from apps.alerts import services as alert_services
from apps.alerts.models import Alert, AlertKind, AlertRule
from apps.deployments.models import Deployment, DeploymentInstance, PlacementState
from apps.registry.models import RegisteredModel
from tests.conftest import wait_for
from tests.drills.conftest import GRACE_S, Stopwatch, record_figures
from tests.drills.helpers import Beat, counted_on, deploy_models, duplicate_placements
from tests.support.servers import Load, request_pool_deployment, requires_haproxy, server_status

pytestmark = [
    pytest.mark.triton,
    pytest.mark.servers,
    requires_haproxy,
    pytest.mark.django_db(transaction=True),
]


def test_host_cut_from_platform_serves_until_replaced_then_unloads_what_moved_on_heal(
    owner_client, owner, team, pool_of_net_hosts, network, make_scaler_version, start_gateway, make_token
):
    hosts = pool_of_net_hosts(["host-a", "host-b"])
    deployment_id = deploy_models(owner_client, owner, team, make_scaler_version, {"alpha": 1})["alpha"]
    (cut,) = counted_on(deployment_id)
    other = next(name for name in hosts if name != cut)
    old = DeploymentInstance.objects.get(deployment_id=deployment_id, instance=hosts[cut][1])
    gateway = start_gateway()
    _, secret = make_token(name="load")
    wait_for(lambda: gateway.infer("vision__alpha", secret)[0] == 200, 15, "the model to answer")
    beat = Beat()

    with Load(gateway, "vision__alpha", secret, threads=2, rate=40, max_seconds=150) as load:
        load.wait_for_requests(40)
        clock = Stopwatch()
        network.partition(cut, platform=True)
        # Past the grace, the replica is retired (it stays loaded and in rotation) and placed again.
        wait_for(
            beat.until(lambda: DeploymentInstance.objects.get(pk=old.pk).retiring_reason != ""),
            GRACE_S + 20,
            f"{cut}'s replica to be retired",
        )
        detect_s = clock.lap()
        wait_for(
            beat.until(lambda: counted_on(deployment_id).get(other) == PlacementState.READY),
            90,
            f"the replica to be placed again on {other}\n{hosts[other][0].output()}",
        )
        # With its replacement READY, the cut host's replica leaves the rotation; its agent cannot hear yet.
        wait_for(
            beat.until(lambda: DeploymentInstance.objects.get(pk=old.pk).unload),
            30,
            "the old one told to unload",
        )
        load.wait_for_requests(40)
        assert DeploymentInstance.objects.get(pk=old.pk).state != PlacementState.UNLOADED
        reports_before = network.proxy.count(f"/placements/{old.pk}/report")

        network.heal(cut)
        wait_for(
            beat.until(lambda: DeploymentInstance.objects.get(pk=old.pk).state == PlacementState.UNLOADED),
            60,
            f"{cut}'s agent to unload what moved\n{hosts[cut][0].output()}",
        )
        converge_s = clock.lap()
        load.wait_for_requests(40)

    unload_reports = network.proxy.count(f"/placements/{old.pk}/report") - reports_before
    duplicates = duplicate_placements()
    row = record_figures(
        "agent-platform partition", sent=load.total, failed=load.total - load.statuses[200],
        detect_s=detect_s, converge_s=converge_s, duplicate_placements=duplicates,
        rows_lost=beat.counts["reserved_repaired"],
    )  # fmt: skip
    assert load.failures == [], load.failures[:5]
    assert row["duplicate_placements"] == 0
    assert counted_on(deployment_id) == {other: PlacementState.READY}
    # The agent reported the unload once (a report the platform accepted is not sent again).
    assert unload_reports == 1, network.proxy.requests
    # Reserved memory equals the placements: no writer left it for the beat to repair, none drifted since.
    assert beat.counts["reserved_repaired"] == 0
    from apps.deployments.reserved import reserved_drift

    assert reserved_drift() == {}
    # Out of the gateway's rotation (kept in maintenance or removed).
    assert server_status(gateway, f"d{deployment_id}", hosts[cut][1].api_key) in ("MAINT", "absent")


def test_host_cut_from_gateway_leaves_rotation_is_shown_unreachable_and_one_replica_models_answer_503(
    owner_client, owner, team, pool_of_net_hosts, network, make_scaler_version, start_gateway, make_token
):
    hosts = pool_of_net_hosts(["host-a", "host-b"])
    ids = deploy_models(owner_client, owner, team, make_scaler_version, {"pair": 2, "solo": 1})
    assert len(counted_on(ids["pair"])) == 2  # one replica per host
    (cut,) = counted_on(ids["solo"])
    key = hosts[cut][1].api_key
    gateway = start_gateway()
    _, secret = make_token(name="load")
    for slug in ("pair", "solo"):
        wait_for(lambda s=slug: gateway.infer(f"vision__{s}", secret)[0] == 200, 15, f"{slug} to answer")
    rule = AlertRule.objects.create(team=team, kind=AlertKind.HOST_OFFLINE, name="hosts")
    beat = Beat()

    with Load(gateway, "vision__pair", secret, threads=2, rate=40, max_seconds=120) as load:
        load.wait_for_requests(40)
        clock = Stopwatch()
        network.partition(cut, platform=False, gateway=True)
        # HAProxy's health checks (GATEWAY_CHECK_INTERVAL_MS, fall 2) take the host out of rotation.
        wait_for(
            lambda: server_status(gateway, f"d{ids['pair']}", key).startswith("DOWN"), 15, "the host DOWN"
        )
        detect_s = clock.lap()
        detected_at = time.monotonic()
        # The operator sees it: the API, the host page, the host-offline alert (the agent is still heard).
        entries = wait_for(
            lambda: owner_client.get(f"/api/v1/hosts/{cut}/").json()["gateway_unreachable"], 15,
            "the gateway to report the host unreachable",
        )  # fmt: skip
        reported_s = clock.lap()
        assert entries[0]["instance"] == hosts[cut][1].name and "L4TOUT" in entries[0]["reason"], entries
        assert owner_client.get(f"/api/v1/hosts/{cut}/").json()["status"] == "online"
        load.wait_for_requests(200, timeout=60)
        alert_services.evaluate_rules()
        alert = Alert.objects.get(rule=rule, subject=f"host-gateway:{hosts[cut][1].host_id}")
        assert f"Host {cut} is unreachable from gateway" in alert.summary
        # The platform does not re-place: the host is heard, the gateway alone cannot reach it.
        beat.tick()
        assert DeploymentInstance.objects.filter(deployment_id=ids["solo"], retiring_reason="").count() == 1
        # The model whose one replica is there answers 503, saying why.
        status, body = gateway.infer("vision__solo", secret)
        assert status == 503 and "reachable from the gateway" in body["error"], (status, body)

        network.heal(cut)
        wait_for(
            lambda: server_status(gateway, f"d{ids['pair']}", key) == "UP", 15, "the host back in rotation"
        )
        wait_for(
            lambda: not owner_client.get(f"/api/v1/hosts/{cut}/").json()["gateway_unreachable"], 15, "clear"
        )
        converge_s = clock.lap()
        wait_for(lambda: gateway.infer("vision__solo", secret)[0] == 200, 15, "solo to answer again")
        load.wait_for_requests(40)

    failed_after = [t for t in load.failed_sent_at if t > detected_at]
    row = record_figures(
        "gateway-host partition", sent=load.total, failed=load.total - load.statuses[200], detect_s=detect_s,
        converge_s=converge_s, reported_s=reported_s, failed_after_detection=len(failed_after),
        duplicate_placements=duplicate_placements(), rows_lost=beat.counts["reserved_repaired"],
    )  # fmt: skip
    assert failed_after == [], load.failures[-5:]
    assert row["duplicate_placements"] == 0 and row["rows_lost"] == 0


def test_slow_lossy_link_deploys_complete_without_poll_storm_or_host_flapping(
    owner_client, owner, team, pool_of_net_hosts, network, make_scaler_version, start_gateway, make_token,
    settings,
):  # fmt: skip
    """200 ms each way on every chunk between agents and platform and 5 % of new connections reset: deploys
    still complete, polls keep their pace, and no host is taken for lost (``GRACE_S``; heartbeats every
    0.5 s, each call retried with backoff)."""
    settings.AGENT_LONG_POLL_MAX_WAITERS = 8  # the live server holds polls, as a production web process does
    hosts = pool_of_net_hosts(["host-a", "host-b"])
    first = deploy_models(owner_client, owner, team, make_scaler_version, {"steady": 2})
    gateway = start_gateway()
    _, secret = make_token(name="load")
    wait_for(lambda: gateway.infer("vision__steady", secret)[0] == 200, 15, "the model to answer")
    beat = Beat()
    network.proxy.set(delay_s=0.2, drop_rate=0.05)
    polls_before = network.proxy.count("/desired-state")

    with Load(gateway, "vision__steady", secret, threads=2, rate=20, max_seconds=150) as load:
        clock = Stopwatch()
        slugs = [f"slow-{n}" for n in range(4)]
        ids = {}
        for slug in slugs:
            model = RegisteredModel.objects.create(team=team, name=slug, slug=slug, created_by=owner)
            make_scaler_version(model, 2.0)
            ids[slug] = request_pool_deployment(owner_client, team.slug, slug, 1)

        def all_serving() -> bool:
            return Deployment.objects.filter(pk__in=ids.values(), state="SERVING").count() == len(ids)

        wait_for(beat.until(all_serving), 120, f"deploys over the slow link\n{hosts['host-a'][0].output()}")
        converge_s = clock.lap()
        # Keep ticking a while longer: a heartbeat lost on the link must not make a host lost.
        deadline = time.monotonic() + 3 * GRACE_S
        while time.monotonic() < deadline:
            beat.tick()
            time.sleep(0.25)
        load.wait_for_requests(40)
        elapsed = clock.lap()

    polls = network.proxy.count("/desired-state") - polls_before
    retired = DeploymentInstance.objects.exclude(retiring_reason="").count()
    row = record_figures(
        "slow lossy agent link", sent=load.total, failed=load.total - load.statuses[200], detect_s=None,
        converge_s=converge_s, duplicate_placements=duplicate_placements(), rows_lost=0,
        hosts_flapped=retired, polls_per_host_s=round(polls / len(hosts) / elapsed, 2),
        connections_dropped=network.proxy.dropped,
    )  # fmt: skip
    assert load.failures == [], load.failures[:5]
    assert network.proxy.dropped >= 2  # the link did lose calls
    assert retired == 0, list(DeploymentInstance.objects.values_list("retiring_reason", flat=True))
    assert beat.counts["retired"] == 0 and row["duplicate_placements"] == 0
    assert (
        not Deployment.objects.filter(pk__in=[*ids.values(), *first.values()])
        .exclude(state="SERVING")
        .exists()
    )
    # Polls keep their pace: at most a few a second per host (a storm would be tens).
    assert row["polls_per_host_s"] <= 4, (polls, network.proxy.requests)
