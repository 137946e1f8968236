"""Business actions on one version once it exists: its note and tags, archive and restore, delete.

(The registry's services, kept apart from ``services.py``'s models and uploads for size.) Archiving and
deleting ask the apps that use versions (``signals.version_retiring``) and are refused while anything does.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from apps.audit.services import record
from apps.registry.models import MAX_NOTE_LENGTH, ModelVersion, VersionState
from apps.registry.signals import VersionUse, version_deleting, version_retiring


class VersionInUse(Exception):
    """Archiving or deleting a version something still uses (HTTP 409); ``uses`` names each user."""

    def __init__(self, message: str, uses: list[VersionUse]) -> None:
        self.uses = uses
        super().__init__(message)


MAX_TAGS = 10
TAG_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,31}$")
BUSY_STATES = (VersionState.UPLOADING, VersionState.CONVERTING)


def check_tags(tags) -> list[str]:
    """Tags are short lowercase labels (letters, digits, ``. _ -``), at most MAX_TAGS, kept in order without
    repeats."""
    if not isinstance(tags, list) or not all(isinstance(tag, str) for tag in tags):
        raise ValidationError({"tags": ["Send the tags as a list of strings."]})
    cleaned: list[str] = []
    for tag in (t.strip().lower() for t in tags):
        if not TAG_RE.match(tag):
            raise ValidationError(
                {"tags": [f"'{tag[:40]}' is not a tag: use 1-32 lowercase letters, digits, '.', '_' or '-'."]}
            )
        if tag not in cleaned:
            cleaned.append(tag)
    if len(cleaned) > MAX_TAGS:
        raise ValidationError({"tags": [f"At most {MAX_TAGS} tags per version."]})
    return cleaned


def update_version(*, actor, version: ModelVersion, note: str | None = None, tags=None) -> ModelVersion:
    """Change a version's free-text note and its tags (neither changes what is served)."""
    changes: dict = {}
    if note is not None:
        if not isinstance(note, str) or len(note) > MAX_NOTE_LENGTH:
            raise ValidationError({"note": [f"The note is text of at most {MAX_NOTE_LENGTH} characters."]})
        changes["note"] = note.strip()
    if tags is not None:
        changes["tags"] = check_tags(tags)
    with transaction.atomic():
        locked = (
            ModelVersion.objects.select_for_update(of=("self",))
            .select_related("model__team")
            .get(pk=version.pk)
        )
        diff = {
            k: {"from": getattr(locked, k), "to": v} for k, v in changes.items() if getattr(locked, k) != v
        }
        if diff:
            for key, value in changes.items():
                setattr(locked, key, value)
            locked.save(update_fields=[*changes, "updated_at"])
            record(
                actor=actor,
                team=locked.model.team,
                action="version.updated",
                target=locked,
                details={"model": locked.model.slug, "version": locked.number, **diff},
            )
    return locked


def _check_not_in_use(version: ModelVersion, action: str) -> None:
    """Refuse while the version is being written or something (a deployment, an instance) uses it."""
    if version.state in BUSY_STATES:
        what = (
            "its upload is open; cancel it" if version.state == VersionState.UPLOADING else "it is converting"
        )
        raise VersionInUse(f"{version} cannot be {action}d while {what}.", [])
    uses = [
        use
        for _, found in version_retiring.send(ModelVersion, version=version, action=action)
        for use in found
    ]
    # An ensemble version pins it as a step: its served config names this version.
    for step in version.used_by_steps.select_related("ensemble_version__model").order_by("pk")[:5]:
        ensemble = step.ensemble_version
        uses.append(
            VersionUse(f"ensemble {ensemble} calls it in step {step.position}", "version", ensemble.pk)
        )
    if uses:
        raise VersionInUse(
            f"{version} cannot be {action}d while it is in use: {'; '.join(u.message for u in uses)}. "
            "Switch or undeploy first.",
            uses,
        )


def archive_version(*, actor, version: ModelVersion) -> ModelVersion:
    """Hide a version from "latest" and every deploy choice; its files and history stay."""
    with transaction.atomic():
        locked = (
            ModelVersion.objects.select_for_update(of=("self",))
            .select_related("model__team")
            .get(pk=version.pk)
        )
        if locked.is_archived():
            return locked
        _check_not_in_use(locked, "archive")
        locked.archived_at = timezone.now()
        locked.save(update_fields=["archived_at", "updated_at"])
        record(
            actor=actor,
            team=locked.model.team,
            action="version.archived",
            target=locked,
            details={"model": locked.model.slug, "version": locked.number},
        )
    return locked


def unarchive_version(*, actor, version: ModelVersion) -> ModelVersion:
    with transaction.atomic():
        locked = (
            ModelVersion.objects.select_for_update(of=("self",))
            .select_related("model__team")
            .get(pk=version.pk)
        )
        if not locked.is_archived():
            return locked
        locked.archived_at = None
        locked.save(update_fields=["archived_at", "updated_at"])
        record(
            actor=actor,
            team=locked.model.team,
            action="version.unarchived",
            target=locked,
            details={"model": locked.model.slug, "version": locked.number},
        )
    return locked


def _remove_tree(path: Path) -> None:
    """Take a directory out of the store in one rename (nobody sees it half deleted), then delete it."""
    if not path.exists():
        return
    graveyard = path.with_name(f".deleted-{path.name}-{uuid.uuid4().hex}")
    os.rename(path, graveyard)
    shutil.rmtree(graveyard, ignore_errors=True)


def delete_version(*, actor, version: ModelVersion) -> None:
    """Delete a version and its files. Refused while it is uploading, converting or in use; the files go only
    once the row's deletion has committed, so a refused or failed delete loses nothing."""
    with transaction.atomic():
        locked = (
            ModelVersion.objects.select_for_update(of=("self",))
            .select_related("model__team")
            .get(pk=version.pk)
        )
        _check_not_in_use(locked, "delete")
        storage = locked.storage_dir()
        record(
            actor=actor,
            team=locked.model.team,
            action="version.deleted",
            target=locked,
            details={
                "model": locked.model.slug,
                "version": locked.number,
                "state": locked.state,
                "sha256": locked.sha256,
                "size": locked.size_bytes,
            },
        )
        version_deleting.send(ModelVersion, version=locked)
        locked.delete()
        transaction.on_commit(lambda: _remove_tree(storage))
