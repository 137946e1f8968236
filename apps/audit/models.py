from __future__ import annotations

from django.conf import settings
from django.db import models

from apps.core.scoping import TeamScopedQuerySet


class AuditEvent(models.Model):
    """Who did what to which object, and when. Written by ``apps.audit.services.record()`` from every
    service that changes state; never edited afterwards."""

    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # Kept as text too: the event must still say who acted after the user is deleted.
    actor_label = models.CharField(max_length=200, blank=True)
    team = models.ForeignKey(
        "teams.Team", null=True, blank=True, on_delete=models.CASCADE, related_name="audit_events"
    )
    action = models.CharField(max_length=100, db_index=True)
    target_type = models.CharField(max_length=100, blank=True)
    target_id = models.CharField(max_length=100, blank=True)
    target_label = models.CharField(max_length=200, blank=True)
    details = models.JSONField(default=dict, blank=True)

    objects = TeamScopedQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["team", "-created_at"])]

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.actor_label} {self.action} {self.target_label}"
