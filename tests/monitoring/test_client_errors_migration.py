"""Migration 0003: rows written while the GE backend's INVALID_ARG answers (reason INVALID_REQUEST) counted as
failures move them to ``client_errors``, so old minutes judge and chart like new ones."""

from __future__ import annotations

import importlib

import pytest
from django.apps import apps

from apps.monitoring.models import ModelMetrics

pytestmark = pytest.mark.django_db

migration = importlib.import_module("apps.monitoring.migrations.0003_client_errors")


def test_invalid_requests_counted_as_failures_move_to_client_errors(metrics_setup):
    write, (v1, _) = metrics_setup["write"], metrics_setup["versions"]
    mixed = write(v1, 3, 100, 7)
    ModelMetrics.objects.filter(pk=mixed.pk).update(failure_reasons={"BACKEND": 2, "INVALID_REQUEST": 5})
    server_only = write(v1, 2, 50, 3)  # failure_reasons {"BACKEND": 3}
    clean = write(v1, 1, 10)

    migration.move_client_errors(apps, None)

    rows = {row.pk: row for row in ModelMetrics.objects.all()}
    assert (rows[mixed.pk].failure, rows[mixed.pk].client_errors, rows[mixed.pk].failure_reasons) == (
        2,
        5,
        {"BACKEND": 2},
    )
    assert (rows[server_only.pk].failure, rows[server_only.pk].client_errors) == (3, 0)
    assert (rows[clean.pk].failure, rows[clean.pk].client_errors) == (0, 0)
    # And back, for a rollback of the migration.
    migration.move_back(apps, None)
    back = ModelMetrics.objects.get(pk=mixed.pk)
    assert (back.failure, back.failure_reasons) == (7, {"BACKEND": 2, "INVALID_REQUEST": 5})
