"""What the agent's heartbeat says about its host (``hostagent.host_facts``), read on a host with the fake
``npu-smi`` (a recorded real table of 8 x 910B3) and on a CPU-only host, and taken by the agent API as sent."""

from __future__ import annotations

import pytest

from apps.fleet.models import TritonInstance
from backend_ge import fakes
from hostagent.host_facts import host_facts, npu_inventory
from tests.fleet.helpers import joined_client


@pytest.fixture
def npu_host(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    fakes.install_tools(bindir, ("npu-smi",))
    monkeypatch.setenv("PATH", str(bindir))
    monkeypatch.setenv(fakes.ENV_FLAG, "1")


def test_an_npu_hosts_inventory_and_facts_are_taken_by_the_heartbeat(npu_host, db):
    inventory = npu_inventory()
    assert inventory["npu_smi_version"] and inventory["driver_version"]
    assert len(inventory["chips"]) == 8 and {c["name"] for c in inventory["chips"]} == {"910B3"}
    facts = host_facts()
    assert facts["cpus"] >= 1 and facts["memory_mb"] > 0 and facts["python"].count(".") == 2
    host, agent, instance = joined_client("npu-host")
    body = {"facts": facts, "npu": inventory, "instances": [{"id": instance.pk, "log_tail": ""}]}
    answer = agent.post("/agent/v1/heartbeat", body, content_type="application/json")
    assert answer.status_code == 200, answer.content
    host.refresh_from_db()
    assert host.facts["memory_mb"] == facts["memory_mb"]
    assert host.npu_driver_version == inventory["driver_version"] and host.devices.count() == 8
    assert TritonInstance.objects.filter(host=host).count() == 1


def test_a_cpu_only_host_has_no_inventory_and_a_failing_npu_smi_is_none(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no npu-smi
    assert npu_inventory() is None
    broken = tmp_path / "npu-smi"
    broken.write_text("#!/bin/sh\necho 'dcmi module initialize failed' >&2\nexit 8\n")
    broken.chmod(0o755)
    assert npu_inventory() is None  # logged; the heartbeat still goes out with the facts
