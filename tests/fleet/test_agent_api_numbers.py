"""Every number a host agent sends is checked against the range of the column it goes to: a value out of range,
negative where it cannot be, NaN or Infinity is the agent's 400 naming the field - never a database error (a
500, and on PostgreSQL an aborted transaction) - and nothing of that call is written."""

from __future__ import annotations

import json

import pytest

from apps.fleet.models import Device, TritonInstance
from hostagent.protocol import MAX_INT
from tests.fleet.helpers import joined_client

pytestmark = pytest.mark.django_db

CHIP = {"npu_id": 0, "chip_id": 0, "device_id": 0, "name": "910B3", "health": "OK", "bus_id": "0000:01:00.0",
        "memory_used_mb": 1, "memory_total_mb": 2}  # fmt: skip
INT_FIELDS = ["npu_id", "chip_id", "device_id", "memory_used_mb", "memory_total_mb", "hbm_used_mb",
              "hbm_total_mb", "hugepages_used", "hugepages_total"]  # fmt: skip
FLOAT_FIELDS = ["power_w", "temperature_c", "aicore_percent"]
TOO_BIG = [MAX_INT + 1, 2**63, 10**30]


def heartbeat_cases():
    for value in TOO_BIG:
        for field in INT_FIELDS:
            yield {"npu": {"chips": [CHIP | {field: value}]}}, f"npu.chips[0].{field}"
        for field in ("cpus", "memory_mb"):
            yield {"facts": {field: value}}, f"facts.{field}"
    for field in INT_FIELDS:
        yield {"npu": {"chips": [CHIP | {field: -1}]}}, f"npu.chips[0].{field}"
    for field in FLOAT_FIELDS:
        yield {"npu": {"chips": [CHIP | {field: 1e300}]}}, f"npu.chips[0].{field}"


@pytest.mark.parametrize(("body", "field"), list(heartbeat_cases()))
def test_a_heartbeat_number_out_of_range_is_a_400_naming_it_and_writes_nothing(body, field):
    host, agent, _ = joined_client("npu-host")
    answer = agent.post("/agent/v1/heartbeat", body, content_type="application/json")
    assert answer.status_code == 400 and field in answer.json()["message"], answer.content
    assert not Device.objects.filter(host=host).exists()
    host.refresh_from_db()
    assert host.facts == {} and host.last_heartbeat_at is None


@pytest.mark.parametrize("field", ["pid", "restarts"])
@pytest.mark.parametrize("value", [*TOO_BIG, -1])
def test_an_instance_state_number_out_of_range_is_a_400_naming_it(field, value):
    _, agent, instance = joined_client("npu-host")
    answer = agent.post(
        f"/agent/v1/instances/{instance.pk}/state", {field: value}, content_type="application/json"
    )
    assert answer.status_code == 400 and f"'{field}'" in answer.json()["message"], answer.content
    fresh = TritonInstance.objects.get(pk=instance.pk)
    assert (fresh.pid, fresh.restarts) == (instance.pid, instance.restarts)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_json_numbers(constant):
    host, agent, instance = joined_client("npu-host")
    bodies = {
        "/agent/v1/heartbeat": f'{{"npu": {{"chips": [{json.dumps(CHIP)[:-1]}, "power_w": {constant}}}]}}}}',
        f"/agent/v1/instances/{instance.pk}/state": f'{{"restarts": {constant}}}',
    }
    for path, raw in bodies.items():
        answer = agent.post(path, raw, content_type="application/json")
        assert answer.status_code == 400, (path, answer.content)
        assert f"{constant} is not a number in JSON" in answer.json()["message"]
    assert not Device.objects.filter(host=host).exists()


def test_the_largest_values_in_range_are_taken():
    host, agent, instance = joined_client("npu-host")
    chip = CHIP | {"memory_total_mb": MAX_INT, "power_w": 1e9, "temperature_c": -40.5}
    answer = agent.post(
        "/agent/v1/heartbeat",
        {"npu": {"chips": [chip]}, "facts": {"cpus": MAX_INT}},
        content_type="application/json",
    )
    assert answer.status_code == 200, answer.content
    device = Device.objects.get(host=host)
    assert device.memory_total_mb == MAX_INT and device.power_w == 1e9 and device.temperature_c == -40.5
    state = agent.post(
        f"/agent/v1/instances/{instance.pk}/state",
        {"pid": MAX_INT, "restarts": MAX_INT},
        content_type="application/json",
    )
    assert state.status_code == 200 and TritonInstance.objects.get(pk=instance.pk).pid == MAX_INT
