"""The gateway command and its HAProxy: no HAProxy outlives a killed command, and a new command replaces one
left running from the same directory."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from apps.gateway.process import pid_alive
from tests.conftest import wait_for
from tests.gateway.conftest import requires_haproxy

pytestmark = [requires_haproxy, pytest.mark.django_db(transaction=True)]


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


def test_a_new_gateway_replaces_an_haproxy_left_running(start_gateway):
    gateway = start_gateway()
    config = gateway.directory / "haproxy.cfg"
    # An HAProxy from this directory that no command supervises (as after a crash of the machine's supervisor).
    orphan = subprocess.Popen(
        ["haproxy", "-W", "-db", "-f", str(config), "-p", str(gateway.directory / "haproxy.pid")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        wait_for(lambda: master_pid(gateway) == orphan.pid, 10, "the orphan's pid file")
        gateway.stop()
        restarted = start_gateway()
        orphan.wait(30)  # stopped by the new command before it starts its own HAProxy
        wait_for(lambda: master_pid(restarted) != orphan.pid, 10, "the new command's HAProxy")
        assert pid_alive(master_pid(restarted)) and restarted.get("/v2/health/ready")[0] == 200
    finally:
        if orphan.poll() is None:
            orphan.kill()
