"""Business actions on conversions. Each runs in one transaction with its audit event; work is enqueued
with ``transaction.on_commit`` so a worker never sees a job row that was rolled back."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from django.core.exceptions import ValidationError
from django.db import transaction

from apps.audit.services import record
from apps.conversions.models import ConversionJob, JobState
from apps.conversions.tasks import run_conversion
from apps.registry.models import MAX_NOTE_LENGTH, ModelVersion, RegisteredModel, VersionState
from apps.registry.options import check_conversion_options
from backend_ge import config as gc
from backend_ge.files import atomic_write
from backend_ge.served_config import TEAM_INSTANCE_LIMIT, build_served_config


def enqueue_conversion(job_id: int) -> None:
    """Send the job to the conversions queue (CELERY_TASK_ROUTES routes it there)."""
    run_conversion.delay(job_id)


def _create_job(*, actor, version: ModelVersion, options: dict, allowed: tuple[str, ...], action: str):
    locked = ModelVersion.objects.select_for_update().select_related("model__team").get(pk=version.pk)
    if locked.state not in allowed:
        raise ValidationError(
            {
                "state": [
                    f"Version {locked.number} is {locked.state}; a conversion can start only when it is "
                    f"{' or '.join(allowed)}."
                ]
            }
        )
    if locked.conversion_jobs.filter(state__in=(JobState.QUEUED, JobState.RUNNING)).exists():
        raise ValidationError({"state": ["A conversion of this version is already queued or running."]})
    job = ConversionJob.objects.create(
        version=locked,
        options=options,
        created_by=actor if getattr(actor, "is_authenticated", False) else None,
    )
    locked.state = VersionState.CONVERTING
    locked.error = ""
    locked.save(update_fields=["state", "error", "updated_at"])
    version.state, version.error = locked.state, locked.error
    record(
        actor=actor,
        team=locked.model.team,
        action=action,
        target=job,
        details={"version": locked.number, "model": locked.model.slug, "options": options},
    )
    transaction.on_commit(lambda: enqueue_conversion(job.pk))
    return job


def start_conversion(*, actor, version: ModelVersion, options: dict | None = None) -> ConversionJob:
    """Queue the conversion of an UPLOADED version: job QUEUED, version CONVERTING, enqueued on commit.

    ``options``: soc_version (default: the team's), precision_mode, input_format, input_shape (ATC style).
    Safe to call inside the caller's transaction (the upload's): the task is sent only once it commits.
    """
    options = check_conversion_options(version, options)
    with transaction.atomic():
        return _create_job(
            actor=actor,
            version=version,
            options=options,
            allowed=(VersionState.UPLOADED,),
            action="conversion.started",
        )


def rerun_conversion(*, actor, version: ModelVersion, options: dict | None = None) -> ConversionJob:
    """Convert a FAILED version again, as a new job row (the failed job and its log stay for reference).

    Without ``options`` the last job's options are reused.
    """
    if options is None:
        last = version.conversion_jobs.order_by("-created_at", "-id").first()
        options = dict(last.options) if last else {}
    options = check_conversion_options(version, options)
    with transaction.atomic():
        return _create_job(
            actor=actor,
            version=version,
            options=options,
            allowed=(VersionState.FAILED,),
            action="conversion.rerun",
        )


def check_config_text(version: ModelVersion, text: str):
    """The config this version would be served with, or ConfigError listing every refused field path.

    Built from only the fields a tenant may set (backend_ge.served_config): the name is the version's Triton
    model name whatever the text says, and the tensors must match the stored signature.
    """
    signature = gc.ModelSignature.from_dict(version.signature) if version.signature else None
    return build_served_config(
        text,
        name=version.model.triton_model_name(),
        max_instance_count=version.model.team.model_instance_limit(),
        instance_limit=TEAM_INSTANCE_LIMIT,
        signature=signature,
    )


def update_config(*, actor, version: ModelVersion, text: str) -> ModelVersion:
    """Replace a READY version's config.pbtxt. Raises ValidationError whose dict maps field paths
    (``input[0].dims``) to messages; on success the row and the servable dir's file change together."""
    if version.state != VersionState.READY:
        raise ValidationError(
            {"state": [f"Version {version.number} is {version.state}; edit its config once it is READY."]}
        )
    try:
        cfg = check_config_text(version, text)
    except gc.ConfigError as exc:
        raise ValidationError(exc.as_dict()) from None
    rendered = gc.render_config(cfg)
    with transaction.atomic():
        locked = ModelVersion.objects.select_for_update().get(pk=version.pk)
        old = locked.config_text
        locked.config_text = rendered
        locked.save(update_fields=["config_text", "updated_at"])
        record(
            actor=actor,
            team=version.model.team,
            action="version.config_updated",
            target=locked,
            details={"version": locked.number, "model": version.model.slug, "changed": old != rendered},
        )
        # Written last inside the transaction: if the write fails the row rolls back with it, and a
        # rename means Triton never reads half a file.
        atomic_write(version.servable_dir() / "config.pbtxt", rendered)
    version.config_text = rendered
    return version


def link_tree(source: Path, target: Path, skip: frozenset[str] = frozenset()) -> None:
    """``target`` as a copy of ``source`` made of hard links (a version's files are never written in place:
    the config is replaced by a rename), copied where the filesystem refuses links."""
    for path in sorted(source.rglob("*")):
        relative = path.relative_to(source)
        if relative.parts[0] in skip or path.is_symlink():
            continue
        destination = target / relative
        if path.is_dir():
            destination.mkdir(parents=True, exist_ok=True)
            continue
        destination.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, destination)
        except OSError:
            shutil.copy2(path, destination)


def _next_version_from(version: ModelVersion, *, actor, **fields) -> ModelVersion:
    """The model's next version, made from ``version``'s upload (its source file's name, format, size and
    sha256, its serving options) with ``fields``. The caller's transaction holds the model's row lock."""
    model = RegisteredModel.objects.select_for_update().select_related("team").get(pk=version.model_id)
    return model.versions.create(
        number=model.next_version_number(),
        source_format=version.source_format,
        source_filename=version.source_filename,
        sha256=version.sha256,
        size_bytes=version.size_bytes,
        serving_options=version.serving_options,
        created_by=actor if getattr(actor, "is_authenticated", False) else None,
        **fields,
    )


def derive_version(*, actor, version: ModelVersion, text: str, note: str = "") -> ModelVersion:
    """A new version of the same model serving the same files with config ``text`` (READY at once: nothing
    is converted), for a change of serving settings that then rolls out like any version. The config is
    checked like an edit of ``version``'s; raises ValidationError naming the field."""
    if version.state != VersionState.READY:
        raise ValidationError(
            {
                "version": [
                    f"Version {version.number} is {version.state}; a version is derived from a READY one."
                ]
            }
        )
    if version.model.is_ensemble():
        raise ValidationError(
            {"version": ["An ensemble's serving settings are its steps'; derive a step's version."]}
        )
    try:
        cfg = check_config_text(version, text)
    except gc.ConfigError as exc:
        raise ValidationError(exc.as_dict()) from None
    rendered = gc.render_config(cfg)
    note = (note or f"Derived from version {version.number} with new serving settings.").strip()
    if len(note) > MAX_NOTE_LENGTH:
        raise ValidationError({"note": [f"Keep the note within {MAX_NOTE_LENGTH} characters."]})
    with transaction.atomic():
        derived = _next_version_from(
            version,
            actor=actor,
            state=VersionState.READY,
            signature=version.signature,
            config_text=rendered,
            toolchain=version.toolchain,
            note=note,
        )
        model, number = derived.model, derived.number
        storage = derived.storage_dir()
        work = storage.with_name(f".{storage.name}.derive-{os.getpid()}")
        shutil.rmtree(work, ignore_errors=True)
        try:
            link_tree(version.storage_dir(), work)
            for leftover in work.glob(".model.*"):
                shutil.rmtree(leftover, ignore_errors=True)
            (work / "model" / "config.pbtxt").unlink(missing_ok=True)
            atomic_write(work / "model" / "config.pbtxt", rendered)
            if storage.exists():  # left by a version of this number that was deleted half-way
                shutil.rmtree(storage)
            os.rename(work, storage)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        record(
            actor=actor,
            team=model.team,
            action="version.derived",
            target=derived,
            details={"model": model.slug, "version": number, "from": version.number},
        )
    return derived


def reconvert_version(*, actor, version: ModelVersion, options: dict, note: str = "") -> ConversionJob:
    """The next version of the model converted again from ``version``'s source with its last conversion's
    options changed by ``options`` (e.g. ``batch_gears`` a tuning suggested); it converts like an upload and
    then rolls out like any version. Raises ValidationError naming the field."""
    last = version.conversion_jobs.filter(state=JobState.SUCCEEDED).order_by("-created_at", "-id").first()
    if version.state != VersionState.READY or last is None or not version.source_dir().is_dir():
        raise ValidationError(
            {"version": [f"Version {version.number} was not converted here: nothing to convert again."]}
        )
    merged = check_conversion_options(version, {**last.options, **options})
    note = (note or f"Converted again from version {version.number}'s source.").strip()[:MAX_NOTE_LENGTH]
    with transaction.atomic():
        fresh = _next_version_from(version, actor=actor, state=VersionState.UPLOADED, note=note)
        model, number = fresh.model, fresh.number
        storage = fresh.storage_dir()
        if storage.exists():  # left by a version of this number that was deleted half-way
            shutil.rmtree(storage)
        link_tree(version.source_dir(), fresh.source_dir())
        record(
            actor=actor,
            team=model.team,
            action="version.reconverted",
            target=fresh,
            details={"model": model.slug, "version": number, "from": version.number, "options": options},
        )
        return _create_job(
            actor=actor,
            version=fresh,
            options=merged,
            allowed=(VersionState.UPLOADED,),
            action="conversion.started",
        )
