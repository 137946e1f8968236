from datetime import timedelta

import pytest
from django.utils import timezone

from apps.audit.models import AuditEvent
from apps.registry import services
from apps.registry.models import ModelVersion, UploadSession
from tests.registry.uploads import files_under

pytestmark = pytest.mark.django_db


def test_abandoned_uploads_are_cancelled_and_their_bytes_deleted(owner, model, artifact_root):
    stale = services.start_upload(actor=owner, model=model, filename="old.onnx", size=100)
    fresh = services.start_upload(actor=owner, model=model, filename="new.onnx", size=100)
    stale.part_path().write_bytes(b"x" * 40)
    UploadSession.objects.filter(pk=stale.pk).update(updated_at=timezone.now() - timedelta(hours=49))

    assert services.expire_abandoned_uploads() == 1

    assert not UploadSession.objects.filter(pk=stale.pk).exists()
    assert not ModelVersion.objects.filter(pk=stale.version_id).exists()
    assert not stale.part_path().exists()
    assert UploadSession.objects.filter(pk=fresh.pk).exists() and fresh.part_path().exists()
    assert AuditEvent.objects.filter(action="upload.aborted", actor_label="system").count() == 1
    assert not any("old.onnx" in name for name in files_under(artifact_root))


def test_an_upload_being_written_is_left_alone(owner, model):
    import fcntl
    import os

    busy = services.start_upload(actor=owner, model=model, filename="busy.onnx", size=100)
    UploadSession.objects.filter(pk=busy.pk).update(updated_at=timezone.now() - timedelta(days=3))
    fd = os.open(busy.part_path(), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # what a request writing a chunk holds
        assert services.expire_abandoned_uploads() == 0
    finally:
        os.close(fd)
    assert UploadSession.objects.filter(pk=busy.pk).exists()
