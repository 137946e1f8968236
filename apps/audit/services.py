from __future__ import annotations

from datetime import timedelta

from django.db import models
from django.utils import timezone

from apps.audit.models import AuditEvent


def actor_label(actor) -> str:
    if actor is None or not getattr(actor, "is_authenticated", False):
        return "system"
    token = getattr(actor, "api_token", None)
    if token is not None:
        return f"{actor.get_username()} (token {token.display_prefix})"
    return actor.get_username()


def record(
    *,
    actor,
    team,
    action: str,
    target: models.Model | None = None,
    details: dict | None = None,
) -> AuditEvent:
    """Write one audit event. Call it inside the service's transaction so the event and the change it
    describes commit (or roll back) together."""
    return AuditEvent.objects.create(
        actor=actor if getattr(actor, "is_authenticated", False) else None,
        actor_label=actor_label(actor),
        team=team,
        action=action,
        target_type=target._meta.label_lower if target is not None else "",
        target_id=str(target.pk) if target is not None else "",
        target_label=str(target)[:200] if target is not None else "",
        details=details or {},
    )


def prune_audit_events(retention_days: int) -> int:
    """Delete events older than the retention window; returns how many were deleted."""
    cutoff = timezone.now() - timedelta(days=retention_days)
    deleted, _ = AuditEvent.objects.filter(created_at__lt=cutoff).delete()
    return deleted
