"""Migration 0003: configs generated before devices became the platform's lose DEVICE_ID/device_ids, so the
host agent (which refuses them) keeps serving those versions."""

from __future__ import annotations

import importlib

import pytest
from django.apps import apps

from apps.registry import services
from apps.registry.models import ModelVersion, VersionState
from backend_ge import config as gc
from hostagent.repository import RepositoryError, served_config_text

pytestmark = pytest.mark.django_db

migration = importlib.import_module("apps.registry.migrations.0003_configs_without_device_parameters")

LEGACY = """
name: "vision__resnet50"
backend: "ge"
max_batch_size: 8
input { name: "input" data_type: TYPE_FP32 dims: 4 }
output { name: "output" data_type: TYPE_FP32 dims: 2 }
instance_group { count: 1 kind: KIND_CPU }
parameters { key: "DEVICE_ID" value { string_value: "3" } }
parameters { key: "EXECUTOR" value { string_value: "acl" } }
parameters { key: "device_ids" value { string_value: "3,4" } }
"""


def test_legacy_device_parameters_are_dropped_and_the_config_serves_again(owner, team):
    model = services.create_model(actor=owner, team=team, name="ResNet 50", slug="resnet50")
    version = ModelVersion.objects.create(
        model=model,
        number=1,
        state=VersionState.READY,
        config_text=LEGACY,
        serving_options={"max_batch_size": 8, "device_ids": [3, 4]},
    )
    untouched = ModelVersion.objects.create(model=model, number=2, state=VersionState.FAILED, config_text="")
    with pytest.raises(RepositoryError, match="parameters.DEVICE_ID"):
        served_config_text(LEGACY, "vision__resnet50", [1])
    migration.strip_device_parameters(apps, None)
    version.refresh_from_db()
    cfg = gc.parse_config(version.config_text)
    assert set(cfg.parameters) == {"EXECUTOR"}
    assert version.serving_options == {"max_batch_size": 8}
    assert "device_ids" in served_config_text(version.config_text, "vision__resnet50", [1], device_ids=[0])
    untouched.refresh_from_db()
    assert untouched.config_text == ""
