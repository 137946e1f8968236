"""The agent's copy of its desired state: a fetch replaces it, except where a report answered after the fetch
was read says more (a decision applied meanwhile is not applied twice)."""

from __future__ import annotations

from hostagent.client import DesiredState

VERSION = {"id": 7, "number": 1, "label": "M v1", "model_name": "t__m", "config_text": "", "signature": {},
           "instance_limit": 1, "files": []}  # fmt: skip


def placement(**fields) -> dict:
    entry = {"id": 1, "instance": 3, "label": "h/cpu-0", "deployment": 5, "model_name": "t__m", "generation": 2,
             "applied_generation": 1, "state": "PENDING", "undeploy": False, "target": 7, "active": None,
             "target_version": 7, "canary_target": None, "served": None, "canary": None, "keep_model": False}  # fmt: skip
    return entry | fields


def state(*placements) -> dict:
    return {"generation": 4, "instances": [], "placements": list(placements), "versions": {"7": VERSION}}


def test_a_fetch_read_before_a_report_does_not_undo_it():
    desired = DesiredState()
    desired.replace(state(placement()))
    assert not desired.placement(1).is_applied()
    desired.update_placement(placement(applied_generation=2, state="READY", served=7), 1)
    desired.replace(state(placement(state="LOADING")))  # read before the report was answered
    kept = desired.placement(1)
    assert kept.is_applied() and kept.served_version.number == 1 and kept.state == "READY"


def test_a_newer_decision_replaces_the_reported_one_and_a_gone_placement_leaves():
    desired = DesiredState()
    desired.replace(state(placement()))
    desired.update_placement(placement(applied_generation=2, state="READY", served=7), 1)
    desired.replace(state(placement(generation=3, applied_generation=2, undeploy=True)))
    assert desired.placement(1).generation == 3 and desired.placement(1).undeploy
    desired.update_placement(None, 1)
    assert desired.placement(1) is None and desired.placements_on(3) == []


def test_an_answer_naming_a_version_not_fetched_yet_waits_for_the_next_fetch():
    desired = DesiredState()
    desired.replace(state(placement()))
    desired.update_placement(placement(generation=3, target=99, target_version=99), 1)
    assert desired.placement(1).generation == 2
