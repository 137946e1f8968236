from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from apps.teams.models import TeamScopedQuerySet


class Toolchain(models.TextChoices):
    ATC = "atc", "Ascend ATC"
    ONNX = "onnx", "ONNX preparation (CPU)"
    TORCHSCRIPT = "torchscript", "TorchScript -> ONNX"
    NONE = "none", "No conversion (.om)"


class JobState(models.TextChoices):
    QUEUED = "QUEUED", "Queued"
    RUNNING = "RUNNING", "Running"
    SUCCEEDED = "SUCCEEDED", "Succeeded"
    FAILED = "FAILED", "Failed"


class JobQuerySet(TeamScopedQuerySet):
    team_lookup = "version__model__team"


class ConversionJob(models.Model):
    """Turns an uploaded version into a servable model directory.

    State machine: QUEUED -> RUNNING -> SUCCEEDED | FAILED. A RUNNING job whose worker died goes back to
    RUNNING on redelivery while ``attempts`` < ``MAX_ATTEMPTS``, else FAILED with the reason. A re-run of a
    FAILED version is a new job row. A worker claims a job with a conditional UPDATE (QUEUED, or RUNNING with a
    stale ``heartbeat_at``) so two workers never run the same job.
    """

    MAX_ATTEMPTS = 3

    version = models.ForeignKey(
        "registry.ModelVersion", on_delete=models.CASCADE, related_name="conversion_jobs"
    )
    toolchain = models.CharField(max_length=20, choices=Toolchain.choices, blank=True)
    options = models.JSONField(default=dict, blank=True)
    command = models.JSONField(
        default=list, blank=True, help_text="argv of the external tool, when one runs."
    )
    state = models.CharField(max_length=20, choices=JobState.choices, default=JobState.QUEUED)
    stage = models.CharField(max_length=100, blank=True)
    progress = models.PositiveSmallIntegerField(default=0)
    log = models.TextField(blank=True)
    error = models.TextField(blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    attempts = models.PositiveSmallIntegerField(default=0)
    worker = models.CharField(max_length=200, blank=True)
    # Written every few seconds by the worker running the job: a RUNNING job with a stale heartbeat has lost
    # its worker and may be claimed again (redelivery or recovery), a fresh one must not.
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = JobQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"conversion #{self.pk} of {self.version}"

    @property
    def team(self):
        return self.version.model.team

    def is_finished(self) -> bool:
        return self.state in (JobState.SUCCEEDED, JobState.FAILED)

    def duration(self):
        """How long it ran (so far, while it runs); None before a worker started it."""
        if self.started_at is None:
            return None
        return (self.finished_at or timezone.now()) - self.started_at
