"""REST API of the registry: models, versions, resumable uploads and artifact downloads.

Upload protocol (see apps.registry.services): ``POST models/<slug>/uploads/`` opens an upload and returns its
``url`` and ``offset``; ``PATCH <url>`` with ``Upload-Offset: <offset>`` and the raw bytes as the body
(``Content-Type: application/offset+octet-stream``) appends a chunk; ``HEAD``/``GET <url>`` tells the offset
to resume from; ``POST <url>complete/`` verifies and queues the conversion; ``DELETE <url>`` cancels.
"""

from __future__ import annotations

from functools import cached_property

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Count
from django.http import StreamingHttpResponse
from django.shortcuts import get_object_or_404
from django_filters import rest_framework as django_filters
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_field, inline_serializer
from rest_framework import filters, mixins, serializers, status
from rest_framework.decorators import action
from rest_framework.exceptions import APIException
from rest_framework.response import Response

from apps.registry import ensembles, objectives, services, versions
from apps.registry.downloads import zip_stream
from apps.registry.models import (
    ModelKind,
    ModelVersion,
    RegisteredModel,
    SourceFormat,
    TaskType,
    UploadSession,
)
from apps.teams.models import Action
from apps.teams.viewsets import TeamScopedViewSet
from backend_ge import tuning

UUID_REGEX = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
OFFSET_HEADER = "Upload-Offset"


class VersionSummarySerializer(serializers.ModelSerializer):
    class Meta:
        model = ModelVersion
        fields = ["number", "state", "source_format", "created_at"]


class RegisteredModelSerializer(serializers.ModelSerializer):
    slug = serializers.CharField(
        max_length=50, required=False, help_text="Derived from the name when omitted."
    )
    task_type = serializers.ChoiceField(choices=TaskType.choices, required=False)
    kind = serializers.ChoiceField(
        choices=ModelKind.choices,
        required=False,
        help_text="'ensemble': a pipeline of the team's models (upload an ensemble directory or compose it).",
    )
    created_by = serializers.CharField(
        source="created_by.username", read_only=True, default=None, allow_null=True
    )
    version_count = serializers.IntegerField(read_only=True)
    triton_name = serializers.CharField(source="triton_model_name", read_only=True)
    latest_version = serializers.SerializerMethodField()
    objective_p99_ms = serializers.FloatField(
        read_only=True, allow_null=True, help_text="The latency objective: p99 in ms (null: none set)."
    )
    objective_rate_rps = serializers.FloatField(
        read_only=True,
        allow_null=True,
        help_text="The objective's request rate; null: the most throughput with p99 within objective_p99_ms.",
    )

    class Meta:
        model = RegisteredModel
        fields = [
            "slug",
            "name",
            "task_type",
            "kind",
            "description",
            "objective_p99_ms",
            "objective_rate_rps",
            "triton_name",
            "version_count",
            "latest_version",
            "created_by",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["created_at", "updated_at"]

    @extend_schema_field(VersionSummarySerializer(allow_null=True))
    def get_latest_version(self, model: RegisteredModel) -> dict | None:
        version = model.latest_version()
        return VersionSummarySerializer(version).data if version else None


class RegisteredModelUpdateSerializer(serializers.ModelSerializer):
    objective_p99_ms = serializers.FloatField(
        required=False,
        allow_null=True,
        help_text=f"p99 objective in ms, {tuning.P99_MS_RANGE[0]:g} to {tuning.P99_MS_RANGE[1]:g}; null clears the objective.",
    )
    objective_rate_rps = serializers.FloatField(
        required=False,
        allow_null=True,
        help_text=f"Requests/s the p99 holds at, {tuning.RATE_RPS_RANGE[0]:g} to {tuning.RATE_RPS_RANGE[1]:g}; "
        "null or omitted with objective_p99_ms: the most throughput within it.",
    )

    class Meta:
        model = RegisteredModel
        fields = ["name", "task_type", "description", "objective_p99_ms", "objective_rate_rps"]

    def validate(self, attrs):
        if "objective_rate_rps" in attrs and "objective_p99_ms" not in attrs:
            raise serializers.ValidationError(
                {"objective_rate_rps": "Send objective_p99_ms with it: the objective is set as a whole."}
            )
        return attrs


class ModelVersionSerializer(serializers.ModelSerializer):
    model = serializers.CharField(source="model.slug", read_only=True)
    created_by = serializers.CharField(
        source="created_by.username", read_only=True, default=None, allow_null=True
    )
    # Read-only fields lose the model's blank choice in the schema: "" until the format is known.
    source_format = serializers.ChoiceField(choices=SourceFormat.choices, allow_blank=True, read_only=True)
    latest_job = serializers.SerializerMethodField()
    upload = serializers.SerializerMethodField()
    pipeline = serializers.SerializerMethodField(help_text="An ensemble's steps and wiring; [] for a model.")

    class Meta:
        model = ModelVersion
        fields = [
            "model",
            "number",
            "state",
            "source_format",
            "source_filename",
            "sha256",
            "size_bytes",
            "signature",
            "serving_options",
            "config_text",
            "toolchain",
            "error",
            "note",
            "tags",
            "archived_at",
            "latest_job",
            "upload",
            "pipeline",
            "created_by",
            "created_at",
            "updated_at",
        ]
        read_only_fields = fields

    def get_latest_job(self, version: ModelVersion) -> dict | None:
        job = version.conversion_jobs.order_by("-created_at", "-id").first()
        if job is None:
            return None
        return {"id": job.pk, "state": job.state, "stage": job.stage, "progress": job.progress}

    @extend_schema_field(serializers.ListField(child=serializers.DictField()))
    def get_pipeline(self, version: ModelVersion) -> list[dict]:
        return ensembles.pipeline(version) if version.source_format == SourceFormat.ENSEMBLE else []

    def get_upload(self, version: ModelVersion) -> dict | None:
        session = getattr(version, "upload", None)
        if session is None:
            return None
        return {"id": str(session.pk), "state": session.state, "offset": session.received_bytes}


class VersionUpdateSerializer(serializers.Serializer):
    note = serializers.CharField(required=False, allow_blank=True, max_length=2000, trim_whitespace=False)
    tags = serializers.ListField(
        child=serializers.CharField(max_length=64), required=False, max_length=versions.MAX_TAGS * 2
    )


class ModelVersionFilter(django_filters.FilterSet):
    archived = django_filters.BooleanFilter(
        field_name="archived_at",
        lookup_expr="isnull",
        exclude=True,
        help_text="true: only archived versions.",
    )

    class Meta:
        model = ModelVersion
        fields = ["state", "source_format", "archived"]


class VersionInUseError(APIException):
    status_code = status.HTTP_409_CONFLICT
    default_code = "in_use"
    default_detail = "The version is in use."


class ModelInUseError(APIException):
    status_code = status.HTTP_409_CONFLICT
    default_code = "in_use"
    default_detail = "The model is deployed."


class UploadCreateSerializer(serializers.Serializer):
    filename = serializers.CharField(
        max_length=255, help_text="The file's name; its ending tells the format."
    )
    size = serializers.IntegerField(min_value=1, help_text="Total size in bytes.")
    sha256 = serializers.CharField(
        max_length=64, required=False, allow_blank=True, help_text="Hex digest, verified on completion."
    )
    serving_options = serializers.JSONField(
        required=False,
        help_text="max_batch_size, preferred_batch_sizes, max_queue_delay_us, instance_count (devices are chosen at placement).",
    )
    conversion_options = serializers.JSONField(
        required=False, help_text="soc_version, precision_mode, input_format, input_shape."
    )
    config_text = serializers.CharField(
        required=False, allow_blank=True, help_text="config.pbtxt for a lone .om file (gives its signature)."
    )


class UploadSerializer(serializers.ModelSerializer):
    url = serializers.SerializerMethodField()
    offset = serializers.IntegerField(source="received_bytes", read_only=True)
    size = serializers.IntegerField(source="expected_size", read_only=True)
    sha256 = serializers.CharField(source="expected_sha256", read_only=True)
    model = serializers.CharField(source="version.model.slug", read_only=True)
    version = serializers.IntegerField(source="version.number", read_only=True)

    class Meta:
        model = UploadSession
        fields = [
            "id",
            "url",
            "filename",
            "size",
            "offset",
            "sha256",
            "state",
            "model",
            "version",
            "created_at",
        ]
        read_only_fields = fields

    def get_url(self, session: UploadSession) -> str:
        team = session.version.model.team.slug
        path = f"/api/v1/teams/{team}/uploads/{session.pk}/"
        request = self.context.get("request")
        return request.build_absolute_uri(path) if request else path


class UploadCompleteSerializer(serializers.Serializer):
    sha256 = serializers.CharField(
        max_length=64, required=False, allow_blank=True, help_text="Overrides the digest given at the start."
    )


ERROR = inline_serializer(
    "UploadError",
    {
        "error": serializers.CharField(),
        "message": serializers.CharField(),
        "offset": serializers.IntegerField(required=False),
        "limit": serializers.IntegerField(required=False),
    },
)


def too_large(exc: services.UploadTooLarge) -> Response:
    return Response({"error": "too_large", "message": str(exc), "limit": exc.limit}, status=413)


def offset_response(error: str, message: str, offset: int, code: int) -> Response:
    return Response(
        {"error": error, "message": message, "offset": offset},
        status=code,
        headers={OFFSET_HEADER: str(offset), "Cache-Control": "no-store"},
    )


class RegisteredModelViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.DestroyModelMixin,
    TeamScopedViewSet,
):
    """A team's models. Members read; maintainers create, edit, delete and upload versions."""

    # An aggregate drops the default ordering, and pagination refuses an unordered queryset.
    queryset = (
        RegisteredModel.objects.select_related("created_by", "team")
        .annotate(version_count=Count("versions"))
        .order_by("name", "pk")
    )
    serializer_class = RegisteredModelSerializer
    lookup_field = "slug"
    lookup_value_regex = r"[a-z0-9-]+"
    filter_backends = [*TeamScopedViewSet.filter_backends, filters.SearchFilter]
    filterset_fields = ["task_type"]
    search_fields = ["name", "slug", "description"]
    ordering_fields = ["name", "slug", "created_at", "updated_at"]
    action_requirements = {"uploads": Action.CHANGE}

    def perform_create(self, serializer):
        data = serializer.validated_data
        created = services.create_model(
            actor=self.request.user,
            team=self.team,
            name=data["name"],
            slug=data.get("slug"),
            task_type=data.get("task_type", TaskType.OTHER),
            description=data.get("description", ""),
            kind=data.get("kind", ModelKind.MODEL),
        )
        serializer.instance = self.get_queryset().get(pk=created.pk)

    @extend_schema(request=RegisteredModelUpdateSerializer, responses=RegisteredModelSerializer)
    def partial_update(self, request, team_slug=None, slug=None):
        model = self.get_object()
        serializer = RegisteredModelUpdateSerializer(model, data=request.data, partial=True)
        serializer.is_valid(raise_exception=True)
        changes = dict(serializer.validated_data)
        objective = "objective_p99_ms" in changes
        p99_ms, rate_rps = changes.pop("objective_p99_ms", None), changes.pop("objective_rate_rps", None)
        with transaction.atomic():
            if changes:
                services.update_model(actor=request.user, model=model, **changes)
            if objective:
                objectives.set_latency_objective(
                    actor=request.user, model=model, p99_ms=p99_ms, rate_rps=rate_rps
                )
        return Response(RegisteredModelSerializer(self.get_queryset().get(pk=model.pk)).data)

    @extend_schema(
        responses={204: None, 409: ERROR},
        summary="Delete a model, its versions and files (409 while a deployment of it is live)",
    )
    def destroy(self, request, *args, **kwargs):
        return super().destroy(request, *args, **kwargs)

    def perform_destroy(self, instance):
        try:
            services.delete_model(actor=self.request.user, model=instance)
        except services.ModelInUse as exc:
            raise ModelInUseError(str(exc)) from None

    @extend_schema(
        request=UploadCreateSerializer,
        responses={201: UploadSerializer, 400: ERROR, 413: ERROR},
        summary="Open a resumable upload of a new version",
    )
    @action(detail=True, methods=["post"])
    def uploads(self, request, team_slug=None, slug=None):
        model = self.get_object()
        serializer = UploadCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        try:
            session = services.start_upload(
                actor=request.user,
                model=model,
                filename=data["filename"],
                size=data["size"],
                sha256=data.get("sha256", ""),
                serving_options=data.get("serving_options"),
                conversion_options=data.get("conversion_options"),
                config_text=data.get("config_text", ""),
            )
        except services.UploadTooLarge as exc:
            return too_large(exc)
        body = UploadSerializer(session, context={"request": request}).data
        return Response(
            body, status=status.HTTP_201_CREATED, headers={"Location": body["url"], OFFSET_HEADER: "0"}
        )


@extend_schema(
    parameters=[
        OpenApiParameter(
            "model_slug", OpenApiTypes.STR, OpenApiParameter.PATH, description="The model's slug."
        )
    ]
)
class ModelVersionViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TeamScopedViewSet):
    """Versions of one model, newest first, and their artifacts. Members read; maintainers edit the note and
    tags (PATCH), archive, restore and delete a version (refused with 409 while it is in use)."""

    queryset = ModelVersion.objects.select_related("model__team", "created_by", "upload")
    serializer_class = ModelVersionSerializer
    lookup_field = "number"
    lookup_value_regex = r"[0-9]+"
    filterset_class = ModelVersionFilter
    ordering_fields = ["number", "created_at", "state"]
    action_requirements = {"artifact": Action.VIEW, "archive": Action.CHANGE, "unarchive": Action.CHANGE}
    http_method_names = ["get", "head", "options", "post", "patch", "delete"]

    @cached_property
    def registered_model(self) -> RegisteredModel:
        return get_object_or_404(
            RegisteredModel.objects.for_user(self.request.user).filter(team=self.team),
            slug=self.kwargs["model_slug"],
        )

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return ModelVersion.objects.none()
        return self.queryset.for_user(self.request.user).filter(model=self.registered_model)

    def _fresh(self, version: ModelVersion) -> Response:
        return Response(ModelVersionSerializer(self.get_queryset().get(pk=version.pk)).data)

    @extend_schema(request=VersionUpdateSerializer, responses={200: ModelVersionSerializer, 400: ERROR})
    def partial_update(self, request, team_slug=None, model_slug=None, number=None):
        version = self.get_object()
        serializer = VersionUpdateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        versions.update_version(actor=request.user, version=version, **serializer.validated_data)
        return self._fresh(version)

    @extend_schema(responses={204: None, 409: ERROR}, summary="Delete a version and its files")
    def destroy(self, request, team_slug=None, model_slug=None, number=None):
        try:
            versions.delete_version(actor=request.user, version=self.get_object())
        except versions.VersionInUse as exc:
            raise VersionInUseError(str(exc)) from None
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(
        request=None,
        responses={200: ModelVersionSerializer, 409: ERROR},
        summary="Archive a version: hidden from 'latest' and deploy choices, files kept",
    )
    @action(detail=True, methods=["post"])
    def archive(self, request, team_slug=None, model_slug=None, number=None):
        try:
            version = versions.archive_version(actor=request.user, version=self.get_object())
        except versions.VersionInUse as exc:
            raise VersionInUseError(str(exc)) from None
        return self._fresh(version)

    @extend_schema(
        request=None, responses={200: ModelVersionSerializer}, summary="Restore an archived version"
    )
    @action(detail=True, methods=["post"])
    def unarchive(self, request, team_slug=None, model_slug=None, number=None):
        return self._fresh(versions.unarchive_version(actor=request.user, version=self.get_object()))

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "kind",
                OpenApiTypes.STR,
                enum=["model", "source"],
                description="model: the servable Triton model directory (default once READY); source: as uploaded.",
            )
        ],
        responses={(200, "application/zip"): OpenApiTypes.BINARY, 400: ERROR},
        summary="Download a version's files as a zip",
    )
    @action(detail=True, methods=["get"])
    def artifact(self, request, team_slug=None, model_slug=None, number=None):
        version = self.get_object()
        kind = request.query_params.get("kind") or ("model" if version.servable_dir().is_dir() else "source")
        if kind not in ("model", "source"):
            raise ValidationError({"kind": ["Use kind=model (servable) or kind=source (as uploaded)."]})
        root = version.servable_dir() if kind == "model" else version.source_dir()
        if not root.is_dir():
            raise ValidationError(
                {"kind": [f"Version {version.number} has no {kind} files (it is {version.state})."]}
            )
        name = f"{version.model.triton_model_name()}-v{version.number}-{kind}.zip"
        response = StreamingHttpResponse(zip_stream(root), content_type="application/zip")
        response["Content-Disposition"] = f'attachment; filename="{name}"'
        response["Cache-Control"] = "private, no-store"
        return response


class UploadViewSet(mixins.RetrieveModelMixin, TeamScopedViewSet):
    """One resumable upload: status (GET/HEAD), chunks (PATCH), complete (POST), cancel (DELETE)."""

    queryset = UploadSession.objects.select_related("version__model__team")
    serializer_class = UploadSerializer
    lookup_value_regex = UUID_REGEX
    action_requirements = {"complete": Action.CHANGE}

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return UploadSession.objects.none()
        return self.queryset.for_user(self.request.user).filter(version__model__team=self.team)

    @extend_schema(responses={200: UploadSerializer}, summary="Upload status: the offset to resume from")
    def retrieve(self, request, *args, **kwargs):
        session = self.get_object()
        services.upload_offset(session)
        headers = {
            OFFSET_HEADER: str(session.received_bytes),
            "Upload-Length": str(session.expected_size),
            "Cache-Control": "no-store",
        }
        if request.method == "HEAD":  # headers only: a HEAD answer must not carry a body
            return Response(headers=headers)
        return Response(UploadSerializer(session, context={"request": request}).data, headers=headers)

    @extend_schema(
        request={"application/offset+octet-stream": OpenApiTypes.BINARY},
        parameters=[
            OpenApiParameter(
                OFFSET_HEADER,
                OpenApiTypes.INT,
                OpenApiParameter.HEADER,
                required=True,
                description="Where this chunk starts; must equal the server's offset.",
            )
        ],
        responses={200: UploadSerializer, 400: ERROR, 409: ERROR, 411: ERROR, 413: ERROR},
        summary="Append a chunk (raw body)",
    )
    def partial_update(self, request, *args, **kwargs):
        session = self.get_object()
        try:
            offset = int(request.headers.get(OFFSET_HEADER, ""))
            if offset < 0:
                raise ValueError
        except ValueError:
            return offset_response(
                "invalid",
                f"Send the {OFFSET_HEADER} header: the byte offset this chunk starts at.",
                session.received_bytes,
                400,
            )
        try:
            length = int(request.META.get("CONTENT_LENGTH") or "")
        except ValueError:
            return Response(
                {
                    "error": "length_required",
                    "message": "Send a Content-Length header (chunked bodies are not accepted).",
                },
                status=411,
            )
        try:
            # The raw WSGI stream, read piece by piece: request.data or request.body would buffer the chunk.
            services.receive_chunk(session=session, offset=offset, stream=request._request, length=length)
        except services.UploadConflict as exc:
            return offset_response("offset_mismatch", str(exc), exc.offset, 409)
        except services.UploadTooLarge as exc:
            return too_large(exc)
        except services.IncompleteChunk as exc:
            return offset_response("incomplete", str(exc), exc.offset, 400)
        body = UploadSerializer(session, context={"request": request}).data
        return Response(
            body, headers={OFFSET_HEADER: str(session.received_bytes), "Cache-Control": "no-store"}
        )

    @extend_schema(
        request=UploadCompleteSerializer,
        responses={200: ModelVersionSerializer, 400: ERROR, 409: ERROR},
        summary="Verify the upload, install it and queue the conversion",
    )
    @action(detail=True, methods=["post"])
    def complete(self, request, *args, **kwargs):
        session = self.get_object()
        serializer = UploadCompleteSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        try:
            version = services.complete_upload(
                actor=request.user, session=session, sha256=serializer.validated_data.get("sha256", "")
            )
        except services.UploadConflict as exc:
            return offset_response("conflict", str(exc), exc.offset, 409)
        version = ModelVersion.objects.select_related("model__team", "upload").get(pk=version.pk)
        return Response(ModelVersionSerializer(version).data)

    @extend_schema(responses={204: None, 409: ERROR}, summary="Cancel the upload and delete its version")
    def destroy(self, request, *args, **kwargs):
        session = self.get_object()
        try:
            services.abort_upload(actor=request.user, session=session)
        except services.UploadConflict as exc:
            return offset_response("conflict", str(exc), exc.offset, 409)
        return Response(status=status.HTTP_204_NO_CONTENT)
