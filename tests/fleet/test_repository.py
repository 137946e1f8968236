"""hostagent.repository: an instance's repository holds only what is placed, with a config rebuilt by the host."""

from __future__ import annotations

import os

import pytest

from backend_ge import config as gc
from hostagent.repository import RepositoryError, file_manifest, materialize_model, served_config_text
from tests.registry.hostile_configs import CASES

CONFIG = """
name: "team--m"
backend: "ge"
max_batch_size: 8
input [{ name: "input" data_type: TYPE_FP32 dims: [4] }]
output [{ name: "output" data_type: TYPE_FP32 dims: [2] }]
instance_group { count: 1 kind: KIND_CPU }
dynamic_batching { max_queue_delay_microseconds: 100 }
"""


@pytest.fixture
def servable(tmp_path):
    """A servable dir as a conversion publishes it, plus what a hostile upload might have left beside it."""
    root = tmp_path / "artifacts" / "v1"
    (root / "1" / "bin").mkdir(parents=True)
    (root / "config.pbtxt").write_text(CONFIG)
    (root / "1" / "model.onnx").write_bytes(b"\x08onnx")
    (root / "1" / "bin" / "activate").write_text("#!/bin/sh\nid\n")
    (root / "1" / "libevil.so").write_bytes(b"\x7fELF")
    (root / "source").mkdir()
    (root / "source" / "model.onnx").write_bytes(b"\x08other")
    return root


def tree(path) -> list[str]:
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*"))


def test_materialize_writes_only_the_model_file_and_the_rebuilt_config(tmp_path, servable):
    repository = tmp_path / "repository"
    model_dir = materialize_model(repository, "team--m", {3: servable}, CONFIG, device_ids=[4, 5])
    assert tree(model_dir) == ["3", "3/model.onnx", "config.pbtxt"]
    assert not (model_dir / "3" / "model.onnx").is_symlink()
    cfg = gc.parse_config((model_dir / "config.pbtxt").read_text())
    assert list(cfg.version_policy.specific.versions) == [3]
    # The placing instance's devices, whatever the stored config said.
    assert cfg.parameters["DEVICE_ID"].string_value == "4"
    assert cfg.parameters["device_ids"].string_value == "4,5"


@pytest.mark.parametrize("case", sorted(CASES))
def test_materialize_refuses_a_hostile_config_and_writes_nothing(tmp_path, servable, case):
    change, field = CASES[case]
    repository = tmp_path / "repository"
    with pytest.raises(RepositoryError) as exc:
        materialize_model(repository, "team--m", {1: servable}, change(CONFIG))
    assert field in str(exc.value)
    assert not repository.exists() or tree(repository) == []


def test_stored_device_parameters_are_refused_on_the_host():
    text = CONFIG + 'parameters { key: "device_ids" value { string_value: "0,1,2,3" } }\n'
    with pytest.raises(RepositoryError, match="parameters.device_ids"):
        served_config_text(text, "team--m", [1])


def test_instance_count_beyond_the_hosts_limit_is_refused():
    text = CONFIG.replace("count: 1", "count: 3")
    assert "count: 3" in served_config_text(text, "team--m", [1], max_instance_count=4)
    with pytest.raises(RepositoryError, match=r"instance_group\[0\]\.count.*this host's limit"):
        served_config_text(
            text,
            "team--m",
            [1],
            max_instance_count=2,
            instance_limit="this host's limit (FLEET_MAX_MODEL_INSTANCES)",
        )


def test_materialize_refuses_more_instances_than_the_host_allows_and_writes_nothing(tmp_path, servable):
    (servable / "config.pbtxt").write_text(CONFIG.replace("count: 1", "count: 3"))
    repository = tmp_path / "repo"
    text = CONFIG.replace("count: 1", "count: 3")
    with pytest.raises(RepositoryError, match=r"instance_group\[0\]\.count: 3 instances in all"):
        materialize_model(repository, "team--m", {1: servable}, text, max_instance_count=2)
    assert not repository.exists() or tree(repository) == []
    materialize_model(repository, "team--m", {1: servable}, text, max_instance_count=3)
    assert "count: 3" in (repository / "team--m" / "config.pbtxt").read_text()


@pytest.mark.django_db
def test_model_instance_limit_is_the_smaller_of_the_teams_quota_and_the_hosts():
    from apps.teams.models import Team
    from backend_ge.served_config import host_instance_limit as model_instance_limit

    team = Team.objects.create(name="T", slug="t", quota_model_instances=4)
    assert model_instance_limit(team.model_instance_limit(), host_limit=2) == (
        2,
        "this host's limit (FLEET_MAX_MODEL_INSTANCES)",
    )
    assert model_instance_limit(team.model_instance_limit(), host_limit=8) == (
        4,
        "the team's limit (quota_model_instances)",
    )


@pytest.mark.parametrize("where", ["model", "version dir", "servable"])
def test_materialize_never_follows_a_symlink(tmp_path, servable, where):
    victim = tmp_path / "other-team" / "1"
    victim.mkdir(parents=True)
    (victim / "model.onnx").write_bytes(b"\x08victim")
    if where == "model":
        (servable / "1" / "model.onnx").unlink()
        os.symlink(victim / "model.onnx", servable / "1" / "model.onnx")
        target = servable
    elif where == "version dir":
        (servable / "1" / "model.onnx").unlink()
        link_root = tmp_path / "linked"
        link_root.mkdir()
        (link_root / "config.pbtxt").write_text(CONFIG)
        os.symlink(victim, link_root / "1")
        target = link_root
    else:
        target = tmp_path / "servable-link"
        os.symlink(victim.parent, target)
    repository = tmp_path / "repository"
    with pytest.raises(RepositoryError, match="symbolic link"):
        materialize_model(repository, "team--m", {1: target}, CONFIG)
    assert not repository.exists() or tree(repository) == []


def test_materialize_refuses_a_servable_without_a_model_file(tmp_path, servable):
    (servable / "1" / "model.onnx").unlink()
    with pytest.raises(RepositoryError, match="model.om or model.onnx"):
        materialize_model(tmp_path / "repository", "team--m", {1: servable}, CONFIG)


def test_manifest_lists_only_the_config_and_the_model(servable):
    assert [entry["path"] for entry in file_manifest(servable)] == ["config.pbtxt", "1/model.onnx"]
