"""The long poll of the desired state (``?wait=N`` with ``If-None-Match``): held until the host's generation
changes or the wait ends, over real HTTP - through the pre-Django fast path (as gunicorn serves it) and through
the Django view (as the test server and ``runserver`` serve it) - and the heartbeat that writes only what
changed."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from django.core.handlers.wsgi import WSGIHandler
from django.core.servers.basehttp import ThreadedWSGIServer, WSGIRequestHandler
from django.db import connection, connections
from django.test import Client
from django.test.utils import CaptureQueriesContext

from apps.deployments import services as deployment_services
from apps.fleet import long_poll, services
from apps.fleet.agent_fastpath import AgentPollFastPath, DatabaseSlots, database_slots
from apps.fleet.models import Device, TritonInstance
from hostagent.client import PlatformClient
from hostagent.protocol import agent_protocol_headers
from tests.fleet.helpers import DESIRED, agent_client, etag_of, joined

pytestmark = pytest.mark.django_db(transaction=True)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(params=["fast-path", "django-view"])
def platform_url(request):
    """The platform over HTTP: the WSGI application as ``serving_platform.wsgi`` builds it (fast path in
    front of Django), or the bare Django application."""
    app = WSGIHandler()
    if request.param == "fast-path":
        app = AgentPollFastPath(app)
    server = ThreadedWSGIServer(("127.0.0.1", 0), _QuietHandler, allow_reuse_address=False)
    server.set_app(app)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    database_slots().close_idle()  # the fast path's pooled connections


def poll(url: str, credential: str, etag: str, wait: str | None) -> tuple[requests.Response, float]:
    started = time.monotonic()
    response = requests.get(
        url + DESIRED,
        headers={"Authorization": f"Bearer {credential}", "If-None-Match": etag, **agent_protocol_headers()},
        params={"wait": wait} if wait is not None else None,
        timeout=60,
    )
    return response, time.monotonic() - started


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_a_held_poll_answers_304_when_the_wait_ends_without_a_change(platform_url):
    host, credential, _ = joined("lp-idle")
    etag = etag_of(host)
    response, elapsed = poll(platform_url, credential, etag, "1.5")
    assert response.status_code == 304 and response.headers["ETag"] == etag
    assert 1.4 <= elapsed < 5, elapsed
    short, elapsed = poll(platform_url, credential, etag, None)  # an agent that does not ask to wait
    assert short.status_code == 304 and elapsed < 1


def test_a_deploy_reaches_a_held_poll_within_two_seconds(platform_url, owner, make_ready_version):
    host, credential, instance = joined("lp-deploy")
    version = make_ready_version()
    etag = etag_of(host)
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(poll, platform_url, credential, etag, "25")
        wait_for(lambda: long_poll.watcher().waiting() >= 1)
        swept = long_poll.watcher().sweeps
        wait_for(lambda: long_poll.watcher().sweeps > swept)  # it has seen the old generation
        deployed_at = time.monotonic()
        deployment_services.deploy_version(
            actor=owner, model=version.model, version=version, instances=[instance]
        )
        response, _ = held.result(timeout=10)
    seen_after = time.monotonic() - deployed_at
    assert response.status_code == 200 and seen_after < 2, seen_after
    assert response.headers["ETag"] == etag_of(host) != etag
    body = response.json()
    assert body["host"] == "lp-deploy" and body["placements"][0]["target"] == version.pk


def test_a_revoked_credential_gets_401_promptly_from_a_held_poll(platform_url):
    host, credential, _ = joined("lp-revoked")
    etag = etag_of(host)
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(poll, platform_url, credential, etag, "25")
        wait_for(lambda: long_poll.watcher().waiting() >= 1)
        revoked_at = time.monotonic()
        services.revoke_host(actor=None, host=host)
        response, _ = held.result(timeout=10)
    assert response.status_code == 401 and time.monotonic() - revoked_at < 2
    assert "revoked" in response.json()["message"]


@pytest.mark.parametrize("wait", ["soon", "-1", "1e3", "25s", "", "nan"])
def test_a_bad_wait_is_400_with_what_to_send(platform_url, wait):
    host, credential, _ = joined("lp-bad")
    response, elapsed = poll(platform_url, credential, etag_of(host), wait)
    assert response.status_code == 400 and elapsed < 2
    assert "'wait' must be a number of seconds" in response.json()["message"]
    # A caller without a credential learns nothing, whatever it sends.
    anonymous, _ = poll(platform_url, "hag_not-a-credential", etag_of(host), wait)
    assert anonymous.status_code == 401


def test_a_wait_above_the_cap_is_capped(platform_url, settings):
    settings.AGENT_LONG_POLL_MAX_WAIT = 1
    host, credential, _ = joined("lp-cap")
    response, elapsed = poll(platform_url, credential, etag_of(host), "600")
    assert response.status_code == 304 and 0.9 <= elapsed < 5, elapsed


def test_another_hosts_changes_do_not_wake_or_reach_this_host(platform_url):
    mine, my_credential, _ = joined("lp-mine")
    other, _, _ = joined("lp-other", port=18200)
    my_etag = etag_of(mine)
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(poll, platform_url, my_credential, my_etag, "1.5")
        wait_for(lambda: long_poll.watcher().waiting() >= 1)
        services.notify_hosts([other.pk])
        response, elapsed = held.result(timeout=10)
    assert response.status_code == 304 and elapsed >= 1.4, "another host's change woke this host's poll"
    # Sending the other host's ETag gets this host's own state, never the other's.
    answer, _ = poll(platform_url, my_credential, etag_of(other), "1")
    if answer.status_code == 200:
        assert answer.json()["host"] == "lp-mine"
        assert {i["name"] for i in answer.json()["instances"]} == {"cpu-0"}
        assert all(i["http_port"] == 18100 for i in answer.json()["instances"])
    else:
        assert answer.status_code == 304 and etag_of(mine) == etag_of(other)


def test_a_process_holding_its_share_of_polls_answers_the_next_one_at_once(platform_url, monkeypatch):
    host, credential, _ = joined("lp-full")
    monkeypatch.setattr(long_poll.watcher(), "max_waiters", 0)
    response, elapsed = poll(platform_url, credential, etag_of(host), "25")
    assert response.status_code == 304 and elapsed < 2, elapsed


def test_the_agent_client_long_polls_with_a_timeout_longer_than_the_wait(platform_url, monkeypatch):
    host, credential, _ = joined("lp-client")
    client = PlatformClient(platform_url, credential, retries=0, timeout=0.5)
    etag, state = client.desired_state(None)
    assert state["host"] == "lp-client"
    # The client's own timeout (0.5 s) is shorter than the wait: a long poll must not time out.
    started = time.monotonic()
    assert client.desired_state(etag, wait=1.5) == (etag, None)
    assert time.monotonic() - started >= 1.4
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(client.desired_state, etag, 20)
        wait_for(lambda: long_poll.watcher().waiting() >= 1)
        services.notify_hosts([host.pk])
        new_etag, new_state = held.result(timeout=5)
    assert new_etag == etag_of(host) != etag and new_state["generation"] == host.desired_generation


# -- the heartbeat writes only what changed -------------------------------------------------------------------
CHIP = {"npu_id": 0, "chip_id": 0, "device_id": 0, "name": "910B", "health": "OK", "power_w": 90.0,
        "temperature_c": 50.0, "hugepages_used": 0, "hugepages_total": 0, "bus_id": "0000:c1:00.0",
        "aicore_percent": 0.0, "memory_used_mb": 100, "memory_total_mb": 1000, "hbm_used_mb": 3000,
        "hbm_total_mb": 65536}  # fmt: skip


def beat(agent: Client, body: dict) -> list[str]:
    with CaptureQueriesContext(connection) as queries:
        response = agent.post("/agent/v1/heartbeat", body, content_type="application/json")
    assert response.status_code == 200, response.content
    return [q["sql"] for q in queries.captured_queries if q["sql"].startswith(("UPDATE", "INSERT", "DELETE"))]


def test_an_unchanged_heartbeat_writes_only_the_hosts_last_seen_time():
    host, credential, instance = joined("hb-idle")
    other, _, foreign = joined("hb-other", port=18300)
    agent = agent_client(credential)
    chips = [CHIP, CHIP | {"npu_id": 1, "device_id": 1}]
    body = {"facts": {"cpus": 4}, "npu": {"driver_version": "23.0", "chips": chips},
            "instances": [{"id": instance.pk, "log_tail": "started"}, {"id": foreign.pk, "log_tail": "x"}]}  # fmt: skip
    first = beat(agent, body)
    assert Device.objects.filter(host=host).count() == 2 and len(first) >= 3
    TritonInstance.objects.filter(pk=foreign.pk).update(log_tail="theirs")
    host.refresh_from_db()
    seen = host.last_heartbeat_at

    writes = beat(agent, body)
    assert len(writes) == 1 and writes[0].startswith('UPDATE "fleet_host" SET "last_heartbeat_at"'), writes
    host.refresh_from_db()
    assert host.last_heartbeat_at > seen and host.is_online()
    assert host.facts == {"cpus": 4} and host.npu_driver_version == "23.0"
    assert TritonInstance.objects.get(pk=instance.pk).log_tail == "started"
    assert TritonInstance.objects.get(pk=foreign.pk).log_tail == "theirs", (
        "another host's instance was written"
    )

    # What changed is written: a chip's temperature, a new log tail, a chip gone, the facts.
    body["npu"]["chips"] = [CHIP | {"temperature_c": 61.5}]
    body["instances"] = [{"id": instance.pk, "log_tail": "started\nready"}]
    body["facts"] = {"cpus": 8}
    beat(agent, body)
    host.refresh_from_db()
    assert host.facts == {"cpus": 8}
    assert list(Device.objects.filter(host=host).values_list("npu_id", "temperature_c")) == [(0, 61.5)]
    assert TritonInstance.objects.get(pk=instance.pk).log_tail == "started\nready"


# -- a process with hundreds of threads opens a bounded number of database connections -----------------------
def test_database_slots_run_django_requests_on_a_bounded_pool_of_connections():
    slots = DatabaseSlots(2)
    lock, gate = threading.Lock(), threading.Event()
    inside = {"now": 0, "peak": 0}
    used = set()

    def django_app(environ, start_response):
        with lock:
            inside["now"] += 1
            inside["peak"] = max(inside["peak"], inside["now"])
        gate.wait(10)
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        with lock:
            used.add(id(connection.connection))
            inside["now"] -= 1
        return [b"ok"]

    def request():
        body = slots.call(django_app, {}, None)
        assert b"".join(body) == b"ok"
        body.close()
        assert not connections.all(initialized_only=True), "the thread kept the pool's connection"

    threads = [threading.Thread(target=request) for _ in range(6)]
    for thread in threads:
        thread.start()
    wait_for(lambda: inside["now"] == 2)
    gate.set()
    for thread in threads:
        thread.join(10)
    assert inside["peak"] == 2, "more requests ran in Django at once than the pool has connections"
    assert 1 <= len(used) <= 2, f"{len(used)} database connections for a pool of 2"
    slots.close_idle()


def test_the_agent_long_polls_back_to_back_and_does_not_spin_on_a_platform_that_answers_at_once(tmp_path):
    from hostagent.config import AgentConfig
    from hostagent.supervisor import HostAgent

    class Platform:
        """Answers at once, as an older platform does; the third poll brings a new generation."""

        def __init__(self) -> None:
            self.calls: list[tuple[str | None, float, float]] = []

        def desired_state(self, etag, wait=0):
            self.calls.append((etag, wait, time.monotonic()))
            if len(self.calls) == 3:
                return '"5"', {"generation": 5, "instances": [], "placements": [], "versions": {}}
            return etag, None

    platform = Platform()
    config = AgentConfig(
        platform="http://127.0.0.1:1", root=tmp_path, poll_interval_ms=200, long_poll_wait=25
    )
    agent = HostAgent(platform, "lp-agent", config, full_fetch_every=3600)
    agent._etag, agent._fetched_at = '"4"', time.monotonic()
    thread = threading.Thread(target=agent._poll_loop, daemon=True)
    thread.start()
    try:
        wait_for(lambda: len(platform.calls) >= 5)
    finally:
        agent._stop.set()
        thread.join(5)
    etags = [etag for etag, _, _ in platform.calls[:5]]
    assert etags == ['"4"', '"4"', '"4"', '"5"', '"5"']
    assert all(wait == 25 for _, wait, _ in platform.calls[:5]), "every poll asks the platform to hold it"
    assert agent.desired.generation == 5
    # A 304 that came at once is followed by the next poll after poll_every, not at once.
    assert platform.calls[1][2] - platform.calls[0][2] >= 0.18
