"""Running one ConversionJob inside a worker: claim, live log, toolchain, atomic publish, final state.

The job row is the source of truth (not Celery's result backend). A worker owns a job from the moment its
conditional UPDATE claims it (``attempts`` goes up by one) and proves it is alive by writing ``heartbeat_at``
every few seconds together with the buffered log lines. Every later write is fenced on ``attempts``, so a
worker that lost its claim (presumed dead, job taken over) cannot overwrite the new owner's work.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from datetime import timedelta
from pathlib import Path

from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, Q, TextField, Value
from django.db.models.functions import Coalesce, Concat
from django.utils import timezone

from apps.audit.services import record
from apps.conversions.models import ConversionJob, JobState
from apps.conversions.toolchains import ConversionContext, ConversionResult, run_toolchain
from apps.registry.models import ModelVersion, VersionState
from backend_ge import config as gc
from backend_ge.convert import AtcError, ConversionError

logger = logging.getLogger(__name__)

FLUSH_INTERVAL = 0.5  # seconds between writes of buffered log lines: live enough for a 2 s poll
MAX_LOG_CHARS = 1_000_000  # a runaway tool must not grow a row without bound


def heartbeat_timeout() -> timedelta:
    return timedelta(seconds=settings.CONVERSION_HEARTBEAT_TIMEOUT)


def stale_running() -> Q:
    """RUNNING jobs whose worker stopped writing its heartbeat: presumed dead."""
    return Q(state=JobState.RUNNING) & (
        Q(heartbeat_at__isnull=True) | Q(heartbeat_at__lt=timezone.now() - heartbeat_timeout())
    )


class JobRecorder:
    """Buffers log lines, stage and progress of a running job and writes them to its row from one thread.

    Lines arrive from any thread (ATC's output reader, the task); one writer thread with its own database
    connection appends them every :data:`FLUSH_INTERVAL` and refreshes the heartbeat, so the page sees the log
    grow while ATC runs and a slow tool never blocks on the database.
    """

    def __init__(self, job_id: int, attempt: int):
        self.job_id, self.attempt = job_id, attempt
        self._lines: list[str] = []
        self._fields: dict = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._written = 0
        self._thread = threading.Thread(target=self._run, name=f"conversion-{job_id}-log", daemon=True)

    def append(self, line: str) -> None:
        with self._lock:
            self._lines.append(line)

    def update(self, **fields) -> None:
        with self._lock:
            self._fields.update(fields)

    def start(self) -> JobRecorder:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        try:
            while not self._stop.wait(FLUSH_INTERVAL):
                self._flush_logged()
            self._flush_logged()
        finally:
            connection.close()

    def _flush_logged(self) -> None:
        try:
            self.flush()
        except Exception:  # a database hiccup must not kill the writer; the next flush retries the lines
            logger.exception("Could not write the log of conversion job %s", self.job_id)

    def flush(self) -> None:
        with self._lock:
            lines, fields = self._lines, self._fields
            self._lines, self._fields = [], {}
        text = "".join(f"{line}\n" for line in lines)
        if self._written + len(text) > MAX_LOG_CHARS:
            text = text[: max(0, MAX_LOG_CHARS - self._written)]
            if self._written < MAX_LOG_CHARS:
                text += "[log truncated]\n"
        changes = dict(fields, heartbeat_at=timezone.now())
        if text:
            changes["log"] = Concat(F("log"), Value(text), output_field=TextField())
        try:
            ConversionJob.objects.filter(
                pk=self.job_id, attempts=self.attempt, state=JobState.RUNNING
            ).update(**changes)
        except Exception:
            with self._lock:  # keep them for the next flush
                self._lines[:0], self._fields = lines, {**fields, **self._fields}
            raise
        self._written += len(text)


class JobLogHandler(logging.Handler):
    """Sends a job logger's records to the job row (NetBox's JobLogHandler, buffered through the recorder)."""

    def __init__(self, recorder: JobRecorder):
        super().__init__(logging.INFO)
        self.recorder = recorder
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(message)s", "%H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.recorder.append(self.format(record))
        except Exception:
            self.handleError(record)


def claim_job(job: ConversionJob, worker: str) -> bool:
    """Take the job: one conditional UPDATE, so of two workers (or a duplicate delivery) only one wins.

    Claimable: QUEUED, or RUNNING with a stale heartbeat (its worker died), and fewer than MAX_ATTEMPTS tries.
    The ``attempts`` value read before is part of the condition (optimistic locking).
    """
    now = timezone.now()
    claimed = (
        ConversionJob.objects.filter(Q(state=JobState.QUEUED) | stale_running())
        .filter(pk=job.pk, attempts=job.attempts, attempts__lt=ConversionJob.MAX_ATTEMPTS)
        .update(
            state=JobState.RUNNING,
            attempts=F("attempts") + 1,
            worker=worker[:200],
            heartbeat_at=now,
            started_at=Coalesce(F("started_at"), Value(now)),
            stage="starting",
            progress=5,
        )
    )
    return claimed == 1


def fail_lost_job(job_id: int) -> bool:
    """A job whose worker died on its last attempt ends FAILED with the reason (no further tries)."""
    with transaction.atomic():
        job = (
            ConversionJob.objects.select_for_update()
            .filter(stale_running(), pk=job_id, attempts__gte=ConversionJob.MAX_ATTEMPTS)
            .first()
        )
        if job is None:
            return False
        reason = (
            f"The worker running this conversion was lost {job.attempts} times (killed, out of memory or "
            f"restarted; last: {job.worker or 'unknown'}); not retrying. Re-run it when the cause is fixed."
        )
        _finish_failed(job, job.attempts, reason, exit_code=None, log_line=reason)
    return True


def _finish_failed(
    job: ConversionJob, attempt: int, error: str, *, exit_code: int | None, log_line: str = ""
):
    now = timezone.now()
    changes = dict(state=JobState.FAILED, error=error, exit_code=exit_code, finished_at=now, stage="failed")
    if log_line:
        changes["log"] = Concat(F("log"), Value(f"{log_line}\n"), output_field=TextField())
    if not ConversionJob.objects.filter(pk=job.pk, attempts=attempt, state=JobState.RUNNING).update(
        **changes
    ):
        return False
    ModelVersion.objects.filter(pk=job.version_id, state=VersionState.CONVERTING).update(
        state=VersionState.FAILED, error=error, updated_at=now
    )
    version = job.version
    record(
        actor=None,
        team=version.model.team,
        action="conversion.failed",
        target=job,
        details={"version": version.number, "model": version.model.slug, "error": error[:500]},
    )
    return True


def _finish_succeeded(job: ConversionJob, attempt: int, result: ConversionResult) -> bool:
    now = timezone.now()
    with transaction.atomic():
        done = ConversionJob.objects.filter(pk=job.pk, attempts=attempt, state=JobState.RUNNING).update(
            state=JobState.SUCCEEDED,
            toolchain=result.toolchain,
            exit_code=result.exit_code,
            error="",
            stage="done",
            progress=100,
            finished_at=now,
            heartbeat_at=now,
        )
        if not done:
            return False
        ModelVersion.objects.filter(pk=job.version_id).update(
            state=VersionState.READY,
            signature=result.signature.to_dict(),
            config_text=gc.render_config(result.config),
            toolchain=result.toolchain,
            error="",
            updated_at=now,
        )
        version = job.version
        record(
            actor=None,
            team=version.model.team,
            action="conversion.succeeded",
            target=job,
            details={"version": version.number, "model": version.model.slug, "toolchain": result.toolchain},
        )
    return True


def _workdir(version: ModelVersion, job: ConversionJob, attempt: int) -> Path:
    # Next to the servable dir, so the final rename stays on one filesystem (atomic).
    return version.storage_dir() / f".model.tmp-{job.pk}-{attempt}"


def _clean_leftovers(version: ModelVersion) -> None:
    """Remove temp dirs of earlier attempts: their worker is gone (or this job would not be claimable)."""
    for path in version.storage_dir().glob(".model.*"):
        shutil.rmtree(path, ignore_errors=True)


def publish(workdir: Path, servable: Path) -> None:
    """Replace the servable dir with the finished workdir. Nobody serves the version before it is READY, so
    the instant between the two renames is harmless; a re-run leaves exactly the same layout."""
    config = workdir / "config.pbtxt"
    if not config.is_file():
        raise ConversionError("internal error: the conversion produced no config.pbtxt")
    old = servable.with_name(f".model.old-{os.getpid()}")
    if servable.exists():
        os.rename(servable, old)
    os.rename(workdir, servable)
    shutil.rmtree(old, ignore_errors=True)


def execute_job(job_id: int, *, worker: str = "") -> str:
    """Run one conversion job; returns what happened ("gone", "finished", "busy", "failed-lost", "succeeded",
    "failed"). Transient database errors propagate so the task's ``autoretry_for`` retries them."""
    job = ConversionJob.objects.select_related("version__model__team").filter(pk=job_id).first()
    if job is None:
        logger.info("Conversion job %s no longer exists; nothing to do", job_id)
        return "gone"
    if job.is_finished():
        return "finished"
    if not claim_job(job, worker):
        if fail_lost_job(job_id):
            return "failed-lost"
        # Another live worker holds it (a duplicate or an early redelivery): leave it to that worker.
        logger.info("Conversion job %s is held by a live worker or out of attempts; skipping", job_id)
        return "busy"
    attempt = job.attempts + 1
    version = job.version
    recorder = JobRecorder(job.pk, attempt).start()
    job_log = logging.getLogger(f"apps.conversions.job.{job.pk}")
    job_log.propagate = False
    job_log.setLevel(logging.INFO)
    handler = JobLogHandler(recorder)
    job_log.addHandler(handler)
    workdir = _workdir(version, job, attempt)
    atc_progress = [20]

    def stage(name: str, progress: int) -> None:
        recorder.update(stage=name[:100], progress=progress)
        job_log.info("Stage: %s", name)

    def on_atc_line(line: str) -> None:
        recorder.append(line)
        # ATC prints no percentage; each line of output moves the bar a little, never past the config stage.
        atc_progress[0] = min(atc_progress[0] + 2, 80)
        recorder.update(progress=atc_progress[0])

    def on_command(command: list[str]) -> None:
        ConversionJob.objects.filter(pk=job.pk, attempts=attempt).update(command=command)

    try:
        if attempt > 1:
            job_log.warning(
                "Attempt %d of %d: the previous worker (%s) was lost", attempt, job.MAX_ATTEMPTS, job.worker
            )
        job_log.info(
            "Converting %s (%s) on %s", version, version.get_source_format_display(), worker or "worker"
        )
        _clean_leftovers(version)
        workdir.mkdir(parents=True)
        ctx = ConversionContext(
            version=version,
            options=job.options,
            workdir=workdir,
            log=job_log,
            stage=stage,
            atc_timeout=max(settings.CONVERSION_TIME_LIMIT * 0.9, 1.0),
            on_atc_line=on_atc_line,
            on_command=on_command,
            serving=dict(version.serving_options or {}),
        )
        stage("preparing", 10)
        result = run_toolchain(ctx)
        stage("publishing", 95)
        (workdir / "config.pbtxt").write_text(gc.render_config(result.config))
        publish(workdir, version.servable_dir())
        job_log.info("Version is READY (%s)", result.toolchain)
        recorder.stop()
        return "succeeded" if _finish_succeeded(job, attempt, result) else "lost-claim"
    except (ConversionError, SoftTimeLimitExceeded, OSError) as exc:
        error = _readable_error(exc)
        exit_code = exc.exit_code if isinstance(exc, AtcError) else None
        job_log.error("Conversion failed: %s", error)
        recorder.stop()
        with transaction.atomic():
            _finish_failed(job, attempt, error, exit_code=exit_code)
        return "failed"
    except Exception as exc:
        if _is_transient(exc):
            job_log.warning("Transient error, the task will retry: %s", exc)
            recorder.stop()
            if attempt < job.MAX_ATTEMPTS:
                _release(job.pk, attempt)
            raise
        job_log.exception("Internal error")
        recorder.stop()
        with transaction.atomic():
            _finish_failed(job, attempt, f"Internal error in the conversion worker: {exc}", exit_code=None)
        return "failed"
    finally:
        recorder.stop()
        job_log.removeHandler(handler)
        shutil.rmtree(workdir, ignore_errors=True)


def _readable_error(exc: BaseException) -> str:
    if isinstance(exc, SoftTimeLimitExceeded):
        return (
            f"The conversion exceeded its time limit of {settings.CONVERSION_TIME_LIMIT} s and was stopped "
            "(CONVERSION_TIME_LIMIT)."
        )
    if isinstance(exc, OSError) and not isinstance(exc, ConversionError):
        return f"Could not write the converted model: {exc.strerror or exc} ({exc.filename or 'artifact storage'})"
    return str(exc)


def _is_transient(exc: BaseException) -> bool:
    from django.db import InterfaceError, OperationalError

    return isinstance(exc, OperationalError | InterfaceError)


def _release(job_id: int, attempt: int) -> None:
    """Hand a job back to the queue state before a retry, so the retried task can claim it at once.
    Best effort: if the database is down, the heartbeat goes stale and the job is claimable anyway."""
    try:
        ConversionJob.objects.filter(pk=job_id, attempts=attempt, state=JobState.RUNNING).update(
            state=JobState.QUEUED, heartbeat_at=None
        )
    except Exception:
        logger.warning("Could not release conversion job %s before its retry", job_id)


def recover_stale_jobs() -> list[int]:
    """Ids of RUNNING jobs whose worker died: the last attempt is failed here, the rest are re-enqueued
    (the claim's heartbeat condition keeps a still-running worker's job from being taken)."""
    requeued = []
    for job_id, attempts in ConversionJob.objects.filter(stale_running()).values_list("id", "attempts"):
        if attempts >= ConversionJob.MAX_ATTEMPTS:
            fail_lost_job(job_id)
        else:
            requeued.append(job_id)
    return requeued
