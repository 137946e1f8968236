"""Conversions on real Celery worker processes (the configured broker: Redis in CI), each consuming a queue of
its own: the ONNX path end to end, and workers killed with SIGKILL in the middle of a conversion."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from django.db import transaction

from apps.conversions import services, tasks
from apps.conversions.models import ConversionJob, JobState
from apps.registry.models import VersionState
from backend_ge import config as gc
from tests.conftest import wait_for

pytestmark = [pytest.mark.servers, pytest.mark.django_db(transaction=True)]


def job_row(job_id: int) -> ConversionJob:
    return ConversionJob.objects.select_related("version").get(pk=job_id)


def test_onnx_conversion_on_a_real_worker_makes_the_version_ready(
    start_worker, make_version, mlp_bytes, owner, monkeypatch
):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no atc: the ONNX path
    worker = start_worker()
    version = make_version({"model.onnx": mlp_bytes})
    with transaction.atomic():  # as the upload does: enqueued only once this commits
        job = services.start_conversion(actor=owner, version=version)
    row = wait_for(
        lambda: (r := job_row(job.pk)).is_finished() and r,
        90,
        f"job to finish\n{worker.output()}",
        interval=0.2,
    )
    assert row.state == JobState.SUCCEEDED, row.error + worker.output()
    version.refresh_from_db()
    assert version.state == VersionState.READY and version.toolchain == "onnx"
    assert [t["name"] for t in version.signature["inputs"]] == ["input"]
    cfg = gc.load_config(version.config_text, expected_name=version.model.triton_model_name())
    assert gc.validate_config(cfg, signature=gc.ModelSignature.from_dict(version.signature)) == []
    assert (version.servable_dir() / "1" / "model.onnx").is_file()
    assert row.worker.startswith(worker.queue) and row.attempts == 1


def _pids(fake_atc) -> list[tuple[int, int]]:
    path = Path(str(fake_atc.argv_file) + ".pids")
    if not path.exists():
        return []
    return [tuple(int(x) for x in line.split()) for line in path.read_text().splitlines() if line.strip()]


def test_worker_killed_mid_conversion_is_recovered_and_completes(
    start_worker, make_version, mlp_bytes, owner, fake_atc, settings
):
    """The whole worker dies (SIGKILL, as an OOM kill): its heartbeat stops, the recovery sweep (celery beat)
    re-enqueues the job and a second worker finishes it as attempt 2; still one job row."""
    settings.CONVERSION_HEARTBEAT_TIMEOUT = 2
    fake_atc("success_yolox", FAKE_ATC_SLEEP_ONCE=120)
    first = start_worker(CONVERSION_HEARTBEAT_TIMEOUT=2)
    version = make_version({"model.onnx": mlp_bytes})
    with transaction.atomic():
        job = services.start_conversion(actor=owner, version=version)
    wait_for(lambda: _pids(fake_atc), 60, f"atc to start\n{first.output()}", interval=0.2)
    wait_for(
        lambda: "ATC start working" in job_row(job.pk).log, 10, "the first line on the row", interval=0.1
    )
    os.kill(first.process.pid, signal.SIGKILL)
    first.process.wait(10)
    assert job_row(job.pk).state == JobState.RUNNING
    second = start_worker(CONVERSION_HEARTBEAT_TIMEOUT=2)
    # What celery beat does every minute; the first sweeps find the dead worker's heartbeat still fresh.
    wait_for(lambda: tasks.recover_stale_conversions(), 15, "the heartbeat to go stale", interval=0.5)
    row = wait_for(
        lambda: (r := job_row(job.pk)).is_finished() and r,
        90,
        f"the retried job\n{second.output()}",
        interval=0.2,
    )
    assert row.state == JobState.SUCCEEDED and row.attempts == 2, row.error
    assert "Attempt 2 of 3" in row.log and row.worker.startswith(second.queue)
    version.refresh_from_db()
    assert version.state == VersionState.READY
    assert ConversionJob.objects.filter(version=version).count() == 1
    assert sorted(p.name for p in version.storage_dir().iterdir()) == ["model", "source"]


def test_pool_process_killed_mid_conversion_is_redelivered_and_completes(
    start_worker, make_version, mlp_bytes, owner, fake_atc, settings
):
    """The pool process running the task dies: reject_on_worker_lost gives the message back at once, the
    redelivered copy waits for the heartbeat to go stale, then claims the job as attempt 2."""
    fake_atc("success_yolox", FAKE_ATC_SLEEP_ONCE=120)
    worker = start_worker(pool="prefork", CONVERSION_HEARTBEAT_TIMEOUT=2)
    version = make_version({"model.onnx": mlp_bytes})
    with transaction.atomic():
        job = services.start_conversion(actor=owner, version=version)
    pids = wait_for(lambda: _pids(fake_atc), 60, f"atc to start\n{worker.output()}", interval=0.2)
    pool_process = pids[0][1]  # atc's parent: the pool process executing the task
    assert pool_process != worker.process.pid
    os.kill(pool_process, signal.SIGKILL)
    row = wait_for(
        lambda: (r := job_row(job.pk)).is_finished() and r,
        120,
        f"the redelivered job\n{worker.output()}",
        interval=0.3,
    )
    assert row.state == JobState.SUCCEEDED and row.attempts == 2, row.error + worker.output()
    assert "Attempt 2 of 3" in row.log
    assert ConversionJob.objects.filter(version=version).count() == 1
    version.refresh_from_db()
    assert version.state == VersionState.READY and (version.servable_dir() / "1" / "model.om").is_file()
