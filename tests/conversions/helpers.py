"""Conversions run in the test process (no worker) and the URL of a version's config."""

from __future__ import annotations

from unittest import mock

from apps.conversions import runner, services
from apps.registry.models import VersionState


def config_url(version) -> str:
    return f"/api/v1/teams/vision/models/{version.model.slug}/versions/{version.number}/config/"


def converted(make_version, files, owner, *, fail=False):
    version = make_version(files)
    with mock.patch("apps.conversions.services.enqueue_conversion"):
        job = services.start_conversion(actor=owner, version=version)
    runner.execute_job(job.pk)
    job.refresh_from_db()
    version.refresh_from_db()
    assert version.state == (VersionState.FAILED if fail else VersionState.READY)
    return version, job
