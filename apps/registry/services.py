"""Business actions on registered models, versions and uploads.

Uploads follow a small resumable protocol (the tus idea): ``start_upload`` creates a version (UPLOADING) and
an upload session; the client sends the bytes in chunks with the offset it believes the server has
(``receive_chunk``); a dropped connection keeps what arrived, and ``upload_offset`` says where to resume;
``complete_upload`` verifies size and sha256, installs the file (archives extracted safely) into the
version's ``source/`` and queues the conversion.

A rejected upload (bad checksum, unsafe archive, not a model) leaves nothing on disk; its version stays
as FAILED with the reason, so the user sees in the versions table what happened to it. ``abort_upload``
(the user cancelling) deletes the version instead.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import BinaryIO

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone
from django.utils.text import slugify

from apps.audit.services import record
from apps.registry.archives import ArchiveRejected, Limits
from apps.registry.ensembles import prepare_ensemble, store_ensemble, upload_kind
from apps.registry.formats import claimed_format, install_source
from apps.registry.models import (
    ModelKind,
    ModelVersion,
    RegisteredModel,
    SourceFormat,
    TaskType,
    UploadSession,
    UploadState,
    VersionState,
    artifact_root,
)
from apps.registry.options import check_conversion_options, check_om_config, check_serving_options
from apps.registry.signals import VersionUse, model_deleting, model_retiring, version_uploaded

logger = logging.getLogger(__name__)

PIECE = 1024 * 1024


class UploadTooLarge(Exception):
    """The declared or received size is over the limit (HTTP 413)."""

    def __init__(self, message: str, limit: int) -> None:
        self.limit = limit
        super().__init__(message)


class UploadConflict(Exception):
    """The client's offset is not the server's, or another request is writing (HTTP 409)."""

    def __init__(self, message: str, offset: int) -> None:
        self.offset = offset
        super().__init__(message)


class IncompleteChunk(Exception):
    """The request body ended early; what arrived is kept and ``offset`` is where to resume."""

    def __init__(self, message: str, offset: int) -> None:
        self.offset = offset
        super().__init__(message)


def upload_max_bytes() -> int:
    return int(settings.UPLOAD_MAX_BYTES)


def archive_limits() -> Limits:
    return Limits(
        max_members=settings.UPLOAD_ARCHIVE_MAX_MEMBERS,
        max_unpacked_bytes=settings.UPLOAD_ARCHIVE_MAX_UNPACKED_BYTES,
    )


def _human(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:g} {unit}" if unit == "bytes" else f"{n:.1f} {unit}".replace(".0 ", " ")
        n /= 1024
    return str(n)


# --- models -------------------------------------------------------------------------------------


def check_model_slug_free(team, slug: str) -> None:
    if RegisteredModel.objects.filter(team=team, slug=slug).exists():
        raise ValidationError(
            {"slug": [f"The team already has a model with the slug '{slug}'; choose another slug."]}
        )


def create_model(
    *,
    actor,
    team,
    name: str,
    slug: str | None = None,
    task_type: str = TaskType.OTHER,
    description: str = "",
    kind: str = ModelKind.MODEL,
) -> RegisteredModel:
    name = (name or "").strip()
    if not name:
        raise ValidationError({"name": ["Give the model a name."]})
    slug = slug or slugify(name)[:50].strip("-")
    if not slug:
        raise ValidationError({"slug": ["Could not derive a slug from the name; give one explicitly."]})
    with transaction.atomic():
        check_model_slug_free(team, slug)
        model = RegisteredModel(
            team=team,
            name=name,
            slug=slug,
            task_type=task_type,
            kind=kind,
            description=description,
            created_by=actor,
        )
        model.full_clean(exclude=["created_by"], validate_unique=False)
        model.save()
        record(
            actor=actor,
            team=team,
            action="model.created",
            target=model,
            details={"name": name, "slug": slug, "kind": kind},
        )
    return model


def update_model(*, actor, model: RegisteredModel, **changes) -> RegisteredModel:
    """Change name, task type or description. The slug is fixed: Triton model names derive from it."""
    allowed = {"name", "task_type", "description"}
    unknown = set(changes) - allowed
    if unknown:
        raise ValidationError({key: ["This field cannot be changed."] for key in sorted(unknown)})
    if "name" in changes:
        changes["name"] = (changes["name"] or "").strip()
        if not changes["name"]:
            raise ValidationError({"name": ["Give the model a name."]})
    with transaction.atomic():
        before = {key: getattr(model, key) for key in changes}
        for key, value in changes.items():
            setattr(model, key, value)
        model.full_clean(exclude=["created_by", "team"], validate_unique=False)
        model.save()
        diff = {k: {"from": before[k], "to": v} for k, v in changes.items() if before[k] != v}
        record(actor=actor, team=model.team, action="model.updated", target=model, details=diff)
    return model


def model_storage_dir(model: RegisteredModel) -> Path:
    return artifact_root() / "teams" / str(model.team_id) / "models" / str(model.pk)


class ModelInUse(Exception):
    """Deleting a model something still uses (HTTP 409); ``uses`` names each user (a live deployment)."""

    def __init__(self, message: str, uses: list[VersionUse]) -> None:
        self.uses = uses
        super().__init__(message)


def delete_model(*, actor, model: RegisteredModel) -> None:
    """Delete the model, its versions and their files (the files once the rows are gone for good). Refused
    while a deployment of it is live (undeploy first); the history of its ended deployments goes with it,
    removed by the deployments app (``signals.model_deleting``), and the audit log keeps what was deleted."""
    storage = model_storage_dir(model)
    parts = [s.part_path() for s in UploadSession.objects.filter(version__model=model)]
    with transaction.atomic():
        # The versions first, then (in the receivers) the deployments, as deploying and deleting a version
        # lock them: a deploy cannot start while the model goes, and one that started is seen here.
        list(ModelVersion.objects.select_for_update().filter(model=model).order_by("pk").values_list("pk"))
        uses = [use for _, found in model_retiring.send(RegisteredModel, model=model) for use in found]
        if uses:
            them = "it" if len(uses) == 1 else "them"
            raise ModelInUse(
                f"{model.name} cannot be deleted while it is deployed: "
                f"{', '.join(use.message for use in uses)}. Undeploy {them} first.",
                uses,
            )
        removed: dict = {}
        for _, answer in model_deleting.send(RegisteredModel, model=model):
            removed.update(answer or {})
        record(
            actor=actor,
            team=model.team,
            action="model.deleted",
            target=model,
            details={"slug": model.slug, "versions": model.versions.count(), **removed},
        )
        model.delete()

        def remove_files() -> None:
            shutil.rmtree(storage, ignore_errors=True)
            for part in parts:
                part.unlink(missing_ok=True)

        transaction.on_commit(remove_files)


# --- uploads ------------------------------------------------------------------------------------


def start_upload(
    *,
    actor,
    model: RegisteredModel,
    filename: str,
    size: int,
    sha256: str = "",
    serving_options: dict | None = None,
    conversion_options: dict | None = None,
    config_text: str = "",
) -> UploadSession:
    """Open an upload: a new version (next number, UPLOADING) and an empty part file."""
    filename = os.path.basename((filename or "").replace("\\", "/")).strip()[:255]
    errors: dict[str, list[str]] = {}
    claimed = ""
    try:
        claimed = claimed_format(filename) if filename else ""
        if not filename:
            errors["filename"] = ["Give the file name of the model (it tells the format)."]
    except ValueError as exc:
        errors["filename"] = [str(exc)]
    limit = upload_max_bytes()
    if size is None or int(size) < 1:
        errors["size"] = ["The size must be at least 1 byte."]
    elif int(size) > limit:
        raise UploadTooLarge(
            f"The file is {_human(int(size))}; uploads are limited to {_human(limit)} ({limit} bytes).", limit
        )
    sha256 = (sha256 or "").strip().lower()
    if sha256 and (len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256)):
        errors["sha256"] = ["Give the sha256 as 64 hexadecimal digits, or leave it out."]
    try:
        serving = check_serving_options(serving_options, model.team.model_instance_limit())
    except ValidationError as exc:
        errors.update(exc.message_dict)
        serving = {}
    config_text = (config_text or "").strip()
    if config_text:
        if claimed != SourceFormat.OM:
            errors["config_text"] = ["A config goes with a lone .om file only; archives carry their own."]
        else:
            try:
                config_text = check_om_config(config_text, model.team.model_instance_limit())
            except ValidationError as exc:
                errors.update(exc.message_dict)
    if errors:
        raise ValidationError(errors)
    with transaction.atomic():
        # The row lock serialises concurrent uploads to one model, so version numbers never collide.
        locked = RegisteredModel.objects.select_for_update().select_related("team").get(pk=model.pk)
        number = locked.next_version_number()
        version = locked.versions.create(
            number=number,
            state=VersionState.UPLOADING,
            source_filename=filename,
            size_bytes=int(size),
            serving_options=serving,
            created_by=actor if getattr(actor, "is_authenticated", False) else None,
        )
        options = check_conversion_options(version, conversion_options)
        session = UploadSession.objects.create(
            version=version,
            filename=filename,
            expected_size=int(size),
            expected_sha256=sha256,
            conversion_options=options,
            config_text=config_text,
        )
        record(
            actor=actor,
            team=locked.team,
            action="upload.started",
            target=version,
            details={"model": locked.slug, "version": number, "filename": filename, "size": int(size)},
        )
        part = session.part_path()
        part.parent.mkdir(parents=True, exist_ok=True)
        part.touch()
    return session


@contextmanager
def _exclusive(session: UploadSession) -> Iterator[int]:
    """An exclusive lock on the part file: one writer (or completer) per upload at a time."""
    try:
        fd = os.open(session.part_path(), os.O_RDWR)
    except FileNotFoundError:
        raise UploadConflict("This upload is no longer open.", session.received_bytes) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UploadConflict(
                "Another request is writing to this upload; wait for it or resume from the reported offset.",
                session.received_bytes,
            ) from None
        yield fd
    finally:
        os.close(fd)


def _check_open(session: UploadSession) -> None:
    if session.state != UploadState.OPEN:
        raise UploadConflict(
            f"This upload is {session.state.lower()}; start a new one.", session.received_bytes
        )


def receive_chunk(*, session: UploadSession, offset: int, stream: BinaryIO, length: int) -> int:
    """Append ``length`` bytes read from ``stream`` at ``offset``; returns the new offset.

    Memory stays flat: the body is copied in 1 MiB pieces. If the body ends early (client gone), the bytes
    that arrived are kept and :class:`IncompleteChunk` says where to resume.
    """
    session.refresh_from_db()
    _check_open(session)
    if offset != session.received_bytes:
        raise UploadConflict(
            f"Offset {offset} does not match the {session.received_bytes} bytes the server has; resume from "
            f"{session.received_bytes}.",
            session.received_bytes,
        )
    if offset + length > session.expected_size:
        raise UploadTooLarge(
            f"This chunk ends at byte {offset + length}, past the declared size of {session.expected_size} bytes.",
            session.expected_size,
        )
    with _exclusive(session) as fd:
        session.refresh_from_db()  # another writer may have finished between the check and the lock
        _check_open(session)
        if offset != session.received_bytes:
            raise UploadConflict(
                f"Offset {offset} does not match the {session.received_bytes} bytes the server has.",
                session.received_bytes,
            )
        written = 0
        failure: Exception | None = None
        os.lseek(fd, offset, os.SEEK_SET)
        try:
            while written < length:
                piece = stream.read(min(PIECE, length - written))
                if not piece:
                    break
                view = memoryview(piece)
                while view:
                    view = view[os.write(fd, view) :]
                written += len(piece)
        except OSError as exc:  # client disconnects surface as OSError subclasses in WSGI servers
            failure = exc
        # The offset is only promised once the bytes are on disk: a crash must not leave a gap.
        os.fdatasync(fd)
        new_offset = offset + written
        UploadSession.objects.filter(pk=session.pk, received_bytes=offset).update(received_bytes=new_offset)
        session.received_bytes = new_offset
    if written < length:
        raise IncompleteChunk(
            f"The body ended after {written} of {length} bytes ({failure or 'connection closed'}); "
            f"resume from {new_offset}.",
            new_offset,
        )
    return new_offset


def upload_offset(session: UploadSession) -> int:
    """Where the client resumes: every byte before it is on disk."""
    session.refresh_from_db(fields=["received_bytes", "state"])
    return session.received_bytes


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while piece := fh.read(PIECE):
            digest.update(piece)
    return digest.hexdigest()


def _reject(*, actor, session: UploadSession, message: str, entry: str = "") -> None:
    """Record the rejection and mark the version FAILED; every file is already gone."""
    version = session.version
    shutil.rmtree(version.storage_dir(), ignore_errors=True)
    session.part_path().unlink(missing_ok=True)
    with transaction.atomic():
        UploadSession.objects.filter(pk=session.pk).update(state=UploadState.ABORTED)
        version.state = VersionState.FAILED
        version.error = f"Upload rejected: {message}"
        version.save(update_fields=["state", "error", "updated_at"])
        record(
            actor=actor,
            team=version.model.team,
            action="upload.rejected",
            target=version,
            details={
                "model": version.model.slug,
                "version": version.number,
                "reason": message,
                "entry": entry,
            },
        )
    session.state = UploadState.ABORTED


def complete_upload(*, actor, session: UploadSession, sha256: str = ""):
    """Verify, install and queue the conversion; returns the version (UPLOADED, then CONVERTING).

    Completing an already completed upload returns its version, so a client may retry after a lost reply.
    """
    session.refresh_from_db()
    version = session.version
    if session.state == UploadState.COMPLETE:
        return version
    _check_open(session)
    sha256 = (sha256 or "").strip().lower() or session.expected_sha256
    with _exclusive(session):
        session.refresh_from_db()
        _check_open(session)
        if session.received_bytes != session.expected_size:
            raise ValidationError(
                {
                    "size": [
                        f"The server has {session.received_bytes} of {session.expected_size} bytes; send the "
                        f"rest from offset {session.received_bytes} first."
                    ]
                }
            )
        part = session.part_path()
        actual = _sha256_of(part)
        if sha256 and actual != sha256:
            message = f"sha256 mismatch: the client said {sha256}, the server received {actual}."
            _reject(actor=actor, session=session, message=message, entry=session.filename)
            raise ValidationError({"sha256": [message + " The upload was discarded; upload the file again."]})
        source = version.source_dir()
        if source.exists():  # left by a crash between install and commit: this attempt replaces it
            shutil.rmtree(source)
        try:
            fmt = install_source(
                part,
                claimed_format(session.filename),
                source,
                session.filename,
                archive_limits(),
                version.model.team.model_instance_limit(),
            )
            if session.config_text and fmt == SourceFormat.OM:
                (source / "config.pbtxt").write_text(session.config_text, encoding="utf-8")
        except ArchiveRejected as exc:
            _reject(actor=actor, session=session, message=str(exc), entry=exc.entry)
            raise ValidationError({"file": [str(exc)]}) from None
        except BaseException:
            shutil.rmtree(version.storage_dir(), ignore_errors=True)
            raise
        prepared = None
        model = version.model
        try:
            # Checked again under the model's lock below: a concurrent first upload may decide it first.
            kind = upload_kind(model, fmt, version)
            if fmt == SourceFormat.ENSEMBLE:
                model.kind = kind  # what it becomes, for the ensemble checks (saved only with the version)
                prepared = prepare_ensemble(model, (source / "config.pbtxt").read_text("utf-8"))
            with transaction.atomic():
                _install_version(actor, session, version, fmt, actual, prepared)
        except ValidationError as exc:
            reason = "; ".join(f"{k}: {' '.join(v)}" for k, v in exc.message_dict.items())
            _reject(actor=actor, session=session, message=reason, entry="config.pbtxt")
            raise
        except BaseException:
            shutil.rmtree(version.storage_dir(), ignore_errors=True)
            raise
    session.state = UploadState.COMPLETE
    return version


def _take_kind(actor, version: ModelVersion, fmt: str) -> None:
    """Under the model row's lock (two first uploads of different kinds cannot both win): the kind the model
    has with this version in, saved and audited when its first upload gave it one."""
    model = RegisteredModel.objects.select_for_update().select_related("team").get(pk=version.model_id)
    kind = upload_kind(model, fmt, version)
    if kind != model.kind:
        RegisteredModel.objects.filter(pk=model.pk).update(kind=kind, updated_at=timezone.now())
        record(
            actor=actor,
            team=model.team,
            action="model.kind_taken",
            target=model,
            details={"model": model.slug, "from": model.kind, "to": kind, "version": version.number},
        )
    version.model.kind = kind


def _install_version(actor, session: UploadSession, version: ModelVersion, fmt: str, actual: str, prepared):
    """Complete the upload in the caller's transaction: the kind settled, the version UPLOADED (an ensemble
    READY at once), the conversion queued."""
    _take_kind(actor, version, fmt)
    UploadSession.objects.filter(pk=session.pk).update(state=UploadState.COMPLETE)
    version.state = VersionState.UPLOADED
    version.source_format = fmt
    version.sha256 = actual
    version.size_bytes = session.expected_size
    version.error = ""
    version.save(update_fields=["state", "source_format", "sha256", "size_bytes", "error", "updated_at"])
    record(
        actor=actor,
        team=version.model.team,
        action="upload.completed",
        target=version,
        details={
            "model": version.model.slug,
            "version": version.number,
            "format": fmt,
            "sha256": actual,
            "size": session.expected_size,
        },
    )
    if prepared is not None:  # nothing to convert: the ensemble is READY once it is checked
        store_ensemble(actor=actor, version=version, prepared=prepared, action="ensemble.uploaded")
    else:
        # The conversions app answers (it builds on the registry; the registry never imports it).
        version_uploaded.send(
            sender=type(version), actor=actor, version=version, options=session.conversion_options
        )


def abort_upload(*, actor, session: UploadSession) -> None:
    """Cancel an open upload: its version and bytes are deleted (a cancelled upload is not history)."""
    session.refresh_from_db()
    _check_open(session)
    with _exclusive(session):
        version = session.version
        with transaction.atomic():
            record(
                actor=actor,
                team=version.model.team,
                action="upload.aborted",
                target=version,
                details={
                    "model": version.model.slug,
                    "version": version.number,
                    "received": session.received_bytes,
                },
            )
            version.delete()
        session.part_path().unlink(missing_ok=True)
        shutil.rmtree(version.storage_dir(), ignore_errors=True)


def expire_abandoned_uploads(now=None) -> int:
    """Cancel uploads nobody touched for UPLOAD_ABANDON_AFTER_HOURS: their part files would otherwise fill
    the artifact disk. Returns how many were cancelled; one busy or vanished upload does not stop the rest."""
    cutoff = (now or timezone.now()) - timedelta(hours=settings.UPLOAD_ABANDON_AFTER_HOURS)
    cancelled = 0
    for session in UploadSession.objects.filter(state=UploadState.OPEN, updated_at__lt=cutoff).select_related(
        "version__model__team"
    ):
        try:
            abort_upload(actor=None, session=session)
        except UploadConflict:
            continue  # a client is writing to it right now, or it was completed meanwhile
        cancelled += 1
    return cancelled


def record_footprint(version_id: int, footprint_mb: int) -> bool:
    """An agent measured what one loaded copy of the version takes (first load only: a measured footprint
    is kept, so a busy instance's later, noisier figure does not replace it). The scheduler reserves it."""
    rows = ModelVersion.objects.filter(pk=version_id, footprint_mb__isnull=True)
    return rows.update(footprint_mb=footprint_mb, footprint_measured_at=timezone.now()) == 1
