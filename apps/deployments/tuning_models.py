"""A tuning job: one version's serving settings measured on a real instance of a pool against its model's
latency objective (``apps.deployments.tuning_jobs`` decides, the host agent measures with
``backend_ge.tuning``). Defined here, re-exported by ``apps.deployments.models``; ``apps.deployments.reserved``
counts the memory an active job's scratch replica holds."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from apps.teams.models import TeamScopedQuerySet
from backend_ge import naming


class TuningState(models.TextChoices):
    QUEUED = "QUEUED", "Queued (waiting for room on an instance)"
    RUNNING = "RUNNING", "Running"
    SUCCEEDED = "SUCCEEDED", "Succeeded"
    FAILED = "FAILED", "Failed"
    CANCELLED = "CANCELLED", "Cancelled"
    TIMED_OUT = "TIMED_OUT", "Timed out"


ACTIVE_TUNING_STATES = (TuningState.QUEUED, TuningState.RUNNING)
# Every point kept for the curve, bounded: a search measures at most max candidates x concurrencies.
MAX_POINTS = 600


class TuningJob(models.Model):
    """State machine: QUEUED -> RUNNING (placed: ``instance`` set, ``reserved_mb`` held on it) -> SUCCEEDED |
    FAILED | CANCELLED | TIMED_OUT; QUEUED -> CANCELLED | TIMED_OUT (never placed). ``points`` are every
    measurement the agent reported; ``result`` is ``backend_ge.tuning.Result.as_dict()`` once it finished."""

    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="tunings")
    version = models.ForeignKey("registry.ModelVersion", on_delete=models.CASCADE, related_name="tunings")
    pool = models.ForeignKey(
        "fleet.Pool",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="tunings",
        help_text="Empty: any pool the team may use.",
    )
    instance = models.ForeignKey(
        "fleet.TritonInstance", null=True, blank=True, on_delete=models.SET_NULL, related_name="tunings"
    )
    state = models.CharField(max_length=20, choices=TuningState.choices, default=TuningState.QUEUED)
    reason = models.TextField(blank=True, help_text="Why it waits, or why it ended as it did.")
    log = models.TextField(blank=True)
    objective = models.JSONField(
        default=dict, help_text="{p99_ms, rate_rps} as the model had it at the start."
    )
    budget_s = models.PositiveIntegerField()
    max_candidates = models.PositiveSmallIntegerField()
    max_instances = models.PositiveSmallIntegerField(default=1)
    gears = models.JSONField(default=list, blank=True, help_text="An NPU version's compiled batch gears.")
    reserved_mb = models.PositiveIntegerField(default=0)
    points = models.JSONField(default=list, blank=True)
    result = models.JSONField(null=True, blank=True)
    cancel_requested = models.BooleanField(default=False)
    derived_version = models.ForeignKey(
        "registry.ModelVersion",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="tuned_by",
        help_text="The version created with its recommendation: live traffic on it is compared with the points.",
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True, help_text="Placed on its instance.")
    reported_at = models.DateTimeField(null=True, blank=True, help_text="The agent's last report.")
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = TeamScopedQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["version"],
                condition=models.Q(state__in=["QUEUED", "RUNNING"]),
                name="one_active_tuning_per_version",
            )
        ]
        indexes = [models.Index(fields=["state", "instance"], name="tuning_state_instance")]

    def __str__(self) -> str:
        return f"tuning {self.pk} of {self.version} ({self.state})"

    def is_active(self) -> bool:
        return self.state in ACTIVE_TUNING_STATES

    def scratch_name(self) -> str:
        """The Triton model name its candidates are loaded under: no model's name, no candidate's."""
        return naming.tuning_name(self.version.model.triton_model_name(), self.pk)

    def progress(self) -> int:
        """Percent of the time budget used (a search may end earlier: finished is 100)."""
        if not self.is_active():
            return 100
        if self.started_at is None or not self.points:
            return 0
        last = max((p.get("at_s") or 0) for p in self.points)
        return min(99, int(100 * last / max(self.budget_s, 1)))
