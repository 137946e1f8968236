"""The gateway command and its HAProxy: no HAProxy outlives a killed command, and a new command replaces one
left running from the same directory."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from apps.gateway.process import HAProxyProcess, pid_alive
from apps.gateway.state import options
from tests.conftest import wait_for
from tests.support.servers import requires_haproxy

pytestmark = [pytest.mark.servers, requires_haproxy, pytest.mark.django_db(transaction=True)]


def master_pid(gateway) -> int:
    return int((gateway.directory / "haproxy.pid").read_text().split()[0])


def test_haproxy_stops_when_the_gateway_command_is_killed(start_gateway):
    gateway = start_gateway()
    pid = master_pid(gateway)
    assert pid_alive(pid)
    os.kill(gateway.process.pid, signal.SIGKILL)
    gateway.process.wait(10)
    wait_for(lambda: not pid_alive(pid), 15, "HAProxy to stop after its command was killed")
    assert gateway.get("/v2/health/ready")[0] == 0


def test_haproxy_stops_at_once_right_after_its_start(start_gateway):
    """HAProxy's master drops a signal that comes just after a start (its new worker already answers on the
    admin socket); the stop sends it again, so a gateway stopped then does not wait out its graceful timeout
    with nothing in flight (a module's gateway stopped just after a sync reloaded it took 30 s)."""
    gateway = start_gateway()
    gateway.stop()  # frees the ports for an HAProxy driven here from the same files
    haproxy = HAProxyProcess(options())
    took = []
    for _ in range(8):  # unrepeated, about one stop in four was lost here
        haproxy.start()
        started = time.monotonic()
        haproxy.stop(timeout=10)
        took.append(round(time.monotonic() - started, 2))
        assert not haproxy.running()
    assert max(took) < 5, took


def test_a_new_gateway_replaces_an_haproxy_left_running(start_gateway):
    gateway = start_gateway()
    config = gateway.directory / "haproxy.cfg"
    gateway.stop()
    # An HAProxy from this directory that no command supervises (as after a crash of the machine's supervisor).
    orphan = subprocess.Popen(
        ["haproxy", "-W", "-db", "-f", str(config), "-p", str(gateway.directory / "haproxy.pid")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        wait_for(lambda: master_pid(gateway) == orphan.pid, 10, "the orphan's pid file")
        assert gateway.get("/v2/health/ready")[0] == 200  # the orphan holds the ports
        restarted = start_gateway()
        orphan.wait(30)  # stopped by the new command before it starts its own HAProxy
        wait_for(lambda: master_pid(restarted) != orphan.pid, 10, "the new command's HAProxy")
        assert pid_alive(master_pid(restarted)) and restarted.get("/v2/health/ready")[0] == 200
    finally:
        if orphan.poll() is None:
            orphan.kill()


def test_a_second_haproxy_on_the_gateways_ports_fails_instead_of_sharing_them(start_gateway, tmp_path):
    gateway = start_gateway()
    # The same binds in another HAProxy (a second gateway, or one whose stats port is this one's inference
    # port): with SO_REUSEPORT it started too and answered a share of the connections - its stats frontend
    # with an empty 404 for an inference request.
    config = (gateway.directory / "haproxy.cfg").read_text()
    other = tmp_path / "other.cfg"
    other.write_text(config.replace(str(gateway.directory / "admin.sock"), str(tmp_path / "other.sock")))
    second = subprocess.run(["haproxy", "-db", "-f", str(other)], capture_output=True, text=True, timeout=10)
    assert second.returncode != 0
    assert f"cannot bind socket (Address already in use) for [{gateway.url}]" in second.stdout + second.stderr
    assert [gateway.get("/v2/health/ready")[0] for _ in range(20)] == [200] * 20
