"""Registered models and their versions. Artifact paths are derived by the platform from ids, never from
user input (an uploaded file name is kept for display only)."""

from __future__ import annotations

import math
import stat
import uuid
from pathlib import Path

from django.conf import settings
from django.db import models

from apps.teams.models import TeamScopedQuerySet, slug_validator
from backend_ge import naming, tuning


def artifact_root() -> Path:
    """ARTIFACT_ROOT, made 0700 (and created so) whenever a path under it is asked for.

    Every team's uploads and models live below it. Instance repositories hard-link model files from here,
    so those files are readable by mode; only this directory keeps a Triton server's user (or anyone but
    the platform) from reaching them through the store.
    """
    root = Path(settings.ARTIFACT_ROOT)
    try:
        mode = root.stat().st_mode
    except FileNotFoundError:
        root.parent.mkdir(parents=True, exist_ok=True)
        root.mkdir(mode=0o700, exist_ok=True)
        mode = root.stat().st_mode
    if stat.S_IMODE(mode) & 0o077:
        root.chmod(0o700)
    return root


class TaskType(models.TextChoices):
    CLASSIFICATION = "classification", "Image classification"
    DETECTION = "detection", "Object detection"
    SEGMENTATION = "segmentation", "Segmentation"
    NLP = "nlp", "Natural language"
    EMBEDDING = "embedding", "Embedding"
    OTHER = "other", "Other"


class ModelKind(models.TextChoices):
    MODEL = "model", "Model"
    # A pipeline of the team's own models that Triton runs inside one server (platform "ensemble"); its
    # versions carry a config and pinned steps (EnsembleStep), no model file.
    ENSEMBLE = "ensemble", "Ensemble"


class RegisteredModel(models.Model):
    """A model a team serves; its versions carry the files (or, for an ensemble, the pipeline)."""

    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="models")
    name = models.CharField(max_length=100)
    # Part of the Triton model name and of artifact paths, so restricted to a safe alphabet.
    slug = models.CharField(max_length=naming.SLUG_MAX_LENGTH, validators=[slug_validator])
    task_type = models.CharField(max_length=20, choices=TaskType.choices, default=TaskType.OTHER)
    kind = models.CharField(max_length=20, choices=ModelKind.choices, default=ModelKind.MODEL)
    description = models.TextField(blank=True)
    # The team's latency objective (backend_ge.tuning.Objective): p99 within objective_p99_ms at
    # objective_rate_rps requests/s, or without a rate the most throughput with p99 within it. Tuning
    # measures candidate configs against it; null: none set.
    objective_p99_ms = models.FloatField(null=True, blank=True)
    objective_rate_rps = models.FloatField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = TeamScopedQuerySet.as_manager()

    class Meta:
        ordering = ["team", "name"]
        constraints = [models.UniqueConstraint(fields=["team", "slug"], name="unique_model_slug_per_team")]

    def __str__(self) -> str:
        return self.name

    def triton_model_name(self) -> str:
        """The model's name inside Triton: unique across teams, derived only from validated slugs
        (backend_ge.naming)."""
        return naming.triton_model_name(self.team.slug, self.slug)

    def is_ensemble(self) -> bool:
        return self.kind == ModelKind.ENSEMBLE

    def latency_objective(self) -> tuning.Objective | None:
        if self.objective_p99_ms is None:
            return None
        return tuning.Objective(p99_ms=self.objective_p99_ms, rate_rps=self.objective_rate_rps)

    def has_versions_besides(self, version: ModelVersion | None = None) -> bool:
        """Whether a version other than ``version`` holds an upload or a composition (an open or rejected
        upload holds nothing: its format is blank). A model without one takes its kind from its first
        upload (``apps.registry.ensembles.upload_kind``)."""
        others = self.versions.exclude(source_format="")
        if version is not None:
            others = others.exclude(pk=version.pk)
        return others.exists()

    def next_version_number(self) -> int:
        """The number a new version takes. The caller holds this model's row lock (``select_for_update``),
        which serialises concurrent uploads, compositions and derivations: numbers never collide."""
        return (self.versions.aggregate(n=models.Max("number"))["n"] or 0) + 1

    def latest_version(self) -> ModelVersion | None:
        """The latest READY version: what "latest" means wherever it is shown (a failed or still converting
        upload with a higher number is not the latest)."""
        return self.versions.ready().order_by("-number").first()


class SourceFormat(models.TextChoices):
    ONNX = "onnx", "ONNX"
    ONNX_ARCHIVE = "onnx_archive", "ONNX with external data (archive)"
    TENSORFLOW = "tensorflow", "TensorFlow frozen graph (.pb)"
    TORCHSCRIPT = "torchscript", "TorchScript (.pt)"
    OM = "om", "Ascend offline model (.om)"
    TRITON_REPOSITORY = "triton_repository", "Triton model directory (archive)"
    ENSEMBLE = "ensemble", "Triton ensemble (config.pbtxt, archive or composed)"


MAX_NOTE_LENGTH = 2000


class VersionState(models.TextChoices):
    UPLOADING = "UPLOADING", "Uploading"
    UPLOADED = "UPLOADED", "Uploaded"
    CONVERTING = "CONVERTING", "Converting"
    READY = "READY", "Ready"
    FAILED = "FAILED", "Failed"


class VersionQuerySet(TeamScopedQuerySet):
    team_lookup = "model__team"

    def ready(self):
        """READY and not archived: what "latest" and every deploy or switch choice is made of."""
        return self.filter(state=VersionState.READY, archived_at__isnull=True)

    def latest_ready_by_model(self, model_ids) -> dict[int, ModelVersion]:
        """``RegisteredModel.latest_version`` for many models in one query: {model id: version}."""
        latest: dict[int, ModelVersion] = {}
        for version in self.ready().filter(model_id__in=list(model_ids)).order_by("model_id", "number"):
            latest[version.model_id] = version
        return latest


# The estimate until measured: a stub and its runtime (base), and the weights with room for work buffers.
FOOTPRINT_BASE_MB = 64
FOOTPRINT_MARGIN = 1.5


class ModelVersion(models.Model):
    """One uploaded revision of a model.

    State machine: UPLOADING -> UPLOADED -> CONVERTING -> READY | FAILED. A FAILED conversion can be re-run
    (FAILED -> CONVERTING). Only READY versions can be deployed. Archiving (``archived_at``) is orthogonal to
    the state: an archived version keeps its files and history but is never "latest" nor offered to deploy.
    """

    model = models.ForeignKey(RegisteredModel, on_delete=models.CASCADE, related_name="versions")
    number = models.PositiveIntegerField()
    state = models.CharField(max_length=20, choices=VersionState.choices, default=VersionState.UPLOADING)
    source_format = models.CharField(max_length=30, choices=SourceFormat.choices, blank=True)
    source_filename = models.CharField(max_length=255, blank=True, help_text="As uploaded; display only.")
    sha256 = models.CharField(max_length=64, blank=True)
    size_bytes = models.BigIntegerField(default=0)
    signature = models.JSONField(default=dict, blank=True)
    serving_options = models.JSONField(default=dict, blank=True)
    config_text = models.TextField(blank=True)
    toolchain = models.CharField(max_length=20, blank=True)
    error = models.TextField(blank=True)
    note = models.TextField(blank=True, max_length=MAX_NOTE_LENGTH)
    tags = models.JSONField(default=list, blank=True, help_text="Short labels, see apps.registry.services.")
    archived_at = models.DateTimeField(null=True, blank=True)
    footprint_mb = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Memory one loaded copy uses, as an agent measured it when it first loaded it.",
    )
    footprint_measured_at = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = VersionQuerySet.as_manager()

    class Meta:
        ordering = ["model", "-number"]
        constraints = [models.UniqueConstraint(fields=["model", "number"], name="unique_version_number")]

    def __str__(self) -> str:
        return f"{self.model} v{self.number}"

    @property
    def team(self):
        return self.model.team

    def is_servable(self) -> bool:
        return self.state == VersionState.READY and not self.is_archived()

    def is_archived(self) -> bool:
        return self.archived_at is not None

    def footprint_estimate_mb(self) -> int:
        """What the scheduler reserves for one loaded copy: the measured footprint, or until an agent has
        measured it, the artifact's size with a margin (weights are loaded once, the runtime's buffers and
        the python stub come on top: ~31 MiB PSS measured for a small model, see DESIGN.md)."""
        if self.footprint_mb:
            return self.footprint_mb
        return FOOTPRINT_BASE_MB + math.ceil(self.size_bytes * FOOTPRINT_MARGIN / 2**20)

    def storage_dir(self) -> Path:
        """Everything of this version lives here: source/ (as uploaded, extracted) and model/ (servable)."""
        return (
            artifact_root()
            / "teams"
            / str(self.model.team_id)
            / "models"
            / str(self.model_id)
            / "versions"
            / str(self.number)
        )

    def source_dir(self) -> Path:
        return self.storage_dir() / "source"

    def servable_dir(self) -> Path:
        """A Triton model directory for this version: config.pbtxt + 1/model.(onnx|om)."""
        return self.storage_dir() / "model"


class EnsembleStep(models.Model):
    """Step ``position`` of an ensemble version and the model version it calls, pinned when the ensemble
    version was made (its served config names that version). Deploying the ensemble needs these versions
    served on the same instances; a step version an ensemble version uses cannot be archived or deleted."""

    ensemble_version = models.ForeignKey(
        ModelVersion, on_delete=models.CASCADE, related_name="ensemble_steps"
    )
    position = models.PositiveSmallIntegerField()
    step_version = models.ForeignKey(ModelVersion, on_delete=models.PROTECT, related_name="used_by_steps")

    class Meta:
        ordering = ["ensemble_version", "position"]
        constraints = [
            models.UniqueConstraint(fields=["ensemble_version", "position"], name="unique_ensemble_step")
        ]

    def __str__(self) -> str:
        return f"{self.ensemble_version} step {self.position}: {self.step_version}"


class UploadState(models.TextChoices):
    OPEN = "OPEN", "Open"
    COMPLETE = "COMPLETE", "Complete"
    ABORTED = "ABORTED", "Aborted"


class UploadQuerySet(TeamScopedQuerySet):
    team_lookup = "version__model__team"


class UploadSession(models.Model):
    """A resumable, chunked upload of one version's source file.

    State machine: OPEN -> COMPLETE | ABORTED. Bytes go to a part file the platform names after the session id;
    ``received_bytes`` is the offset a client resumes from.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    version = models.OneToOneField(ModelVersion, on_delete=models.CASCADE, related_name="upload")
    filename = models.CharField(max_length=255, help_text="As given by the client; display and format only.")
    expected_size = models.BigIntegerField()
    expected_sha256 = models.CharField(max_length=64, blank=True)
    received_bytes = models.BigIntegerField(default=0)
    state = models.CharField(max_length=20, choices=UploadState.choices, default=UploadState.OPEN)
    # Held until the upload completes, then handed to start_conversion (soc_version, precision_mode, ...).
    conversion_options = models.JSONField(default=dict, blank=True)
    # A config.pbtxt sent with a lone .om (it carries the signature an .om cannot reveal on a CPU host).
    config_text = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = UploadQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"upload {self.id} of {self.version}"

    def part_path(self) -> Path:
        return artifact_root() / "uploads" / f"{self.id}.part"
