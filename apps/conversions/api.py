"""Conversion jobs (read, with their log; re-run a failed one) and a version's editable config.pbtxt."""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from django_filters import rest_framework as filters
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_field
from rest_framework import mixins, serializers, status
from rest_framework.decorators import action
from rest_framework.response import Response

from apps.conversions import services
from apps.conversions.models import ConversionJob, JobState, Toolchain
from apps.core.filters import IdFilter
from apps.registry.models import ModelVersion
from apps.teams.models import Action
from apps.teams.viewsets import TeamScopedViewSet
from backend_ge import config as gc
from backend_ge import tuning
from backend_ge.served_config import MAX_BATCH_SIZE, MAX_INSTANCE_COUNT, MAX_QUEUE_DELAY_US


class ConversionJobSerializer(serializers.ModelSerializer):
    model = serializers.CharField(source="version.model.slug", read_only=True)
    version_number = serializers.IntegerField(source="version.number", read_only=True)
    version_state = serializers.CharField(source="version.state", read_only=True)
    created_by = serializers.CharField(
        source="created_by.username", read_only=True, default=None, allow_null=True
    )
    finished = serializers.BooleanField(source="is_finished", read_only=True)
    # Empty until the job has picked its toolchain: the schema must allow "" as well.
    toolchain = serializers.ChoiceField(choices=Toolchain.choices, allow_blank=True, read_only=True)

    class Meta:
        model = ConversionJob
        fields = [
            "id",
            "model",
            "version",
            "version_number",
            "version_state",
            "state",
            "finished",
            "stage",
            "progress",
            "toolchain",
            "options",
            "command",
            "exit_code",
            "error",
            "attempts",
            "worker",
            "created_by",
            "created_at",
            "started_at",
            "finished_at",
        ]
        read_only_fields = fields


class ConversionJobDetailSerializer(ConversionJobSerializer):
    class Meta(ConversionJobSerializer.Meta):
        fields = [*ConversionJobSerializer.Meta.fields, "log"]
        read_only_fields = fields


class ConversionOptionsSerializer(serializers.Serializer):
    soc_version = serializers.CharField(required=False, help_text="e.g. Ascend310P3; default: the team's.")
    precision_mode = serializers.CharField(required=False, help_text="e.g. force_fp16.")
    input_format = serializers.CharField(required=False, help_text="NCHW, NHWC, ND, NCDHW or NDHWC.")
    input_shape = serializers.CharField(required=False, help_text="ATC style: name:-1,3,224,224;name2:...")


class ConversionJobFilter(filters.FilterSet):
    state = filters.ChoiceFilter(choices=JobState.choices)
    version = IdFilter(field_name="version_id", help_text="The version's id.")
    model = filters.CharFilter(field_name="version__model__slug", help_text="The model's slug.")

    class Meta:
        model = ConversionJob
        fields = ["state", "version", "model"]


class ConversionJobViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TeamScopedViewSet):
    """A team's conversion jobs, newest first. The detail carries the log; POST rerun (maintainer) starts a
    new job for a FAILED version, optionally with new conversion options (the last job's otherwise)."""

    queryset = ConversionJob.objects.select_related("version__model", "created_by")
    serializer_class = ConversionJobSerializer
    filterset_class = ConversionJobFilter
    ordering_fields = ["created_at", "state", "finished_at"]
    action_requirements = {"rerun": Action.CHANGE}

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return self.queryset.none()
        return self.queryset.for_user(self.request.user, Action.VIEW).filter(version__model__team=self.team)

    def get_serializer_class(self):
        return ConversionJobDetailSerializer if self.action == "retrieve" else ConversionJobSerializer

    @extend_schema(request=ConversionOptionsSerializer, responses={201: ConversionJobDetailSerializer})
    @action(detail=True, methods=["post"])
    def rerun(self, request, team_slug=None, pk=None):
        job = self.get_object()
        serializer = ConversionOptionsSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        new_job = services.rerun_conversion(
            actor=request.user, version=job.version, options=serializer.validated_data or None
        )
        return Response(ConversionJobDetailSerializer(new_job).data, status=status.HTTP_201_CREATED)


class ServingSettingsSerializer(serializers.Serializer):
    """The settings a tuning candidate changes (backend_ge.tuning.Candidate); the rest is the version's."""

    dynamic_batching = serializers.BooleanField()
    max_batch_size = serializers.IntegerField(min_value=0, max_value=MAX_BATCH_SIZE)
    max_queue_delay_us = serializers.IntegerField(min_value=0, max_value=MAX_QUEUE_DELAY_US, required=False)
    preferred = serializers.ListField(
        child=serializers.IntegerField(min_value=1, max_value=MAX_BATCH_SIZE), max_length=16, required=False
    )
    instance_count = serializers.IntegerField(min_value=1, max_value=MAX_INSTANCE_COUNT)


class VersionConfigSerializer(serializers.Serializer):
    model = serializers.CharField(read_only=True, source="model.slug")
    version = serializers.IntegerField(read_only=True, source="number")
    state = serializers.CharField(read_only=True)
    triton_model_name = serializers.CharField(read_only=True, source="model.triton_model_name")
    signature = serializers.JSONField(read_only=True)
    config_text = serializers.CharField(
        trim_whitespace=False, help_text="config.pbtxt in protobuf text format (Triton's on-disk format)."
    )
    serving = serializers.SerializerMethodField(
        help_text="The serving settings of the config (what derive takes); null for an ensemble."
    )

    @extend_schema_field(ServingSettingsSerializer(allow_null=True))
    def get_serving(self, version: ModelVersion) -> dict | None:
        if version.model.is_ensemble() or not version.config_text:
            return None
        try:
            return tuning.Candidate.from_config(gc.parse_config(version.config_text)).as_dict()
        except gc.ConfigError:
            return None


class DeriveVersionSerializer(serializers.Serializer):
    config_text = serializers.CharField(
        trim_whitespace=False, required=False, help_text="The new version's config.pbtxt (or give serving)."
    )
    serving = ServingSettingsSerializer(
        required=False, help_text="Serving settings applied to this version's config (or give config_text)."
    )
    note = serializers.CharField(required=False, allow_blank=True, max_length=2000)

    def validate(self, attrs):
        if ("config_text" in attrs) == ("serving" in attrs):
            raise serializers.ValidationError(
                {"config_text": "Give either config_text or serving, not both."}
            )
        return attrs


@extend_schema(
    parameters=[
        OpenApiParameter(
            "model_slug", OpenApiTypes.STR, OpenApiParameter.PATH, description="The model's slug."
        ),
        OpenApiParameter(
            "number", OpenApiTypes.INT, OpenApiParameter.PATH, description="The version number."
        ),
    ]
)
class VersionConfigViewSet(TeamScopedViewSet):
    """The generated config.pbtxt of a version. PUT (maintainer) validates it against the model's signature
    with Triton's own protobuf: a 400 lists the problems per field path (``input[0].dims``)."""

    queryset = ModelVersion.objects.select_related("model__team")
    serializer_class = VersionConfigSerializer
    action_requirements = {"retrieve": Action.VIEW, "update": Action.CHANGE, "derive": Action.CHANGE}
    pagination_class = None
    filter_backends: list = []

    def get_object(self) -> ModelVersion:
        versions = self.queryset.for_user(self.request.user, Action.VIEW).filter(model__team=self.team)
        return get_object_or_404(
            versions, model__slug=self.kwargs["model_slug"], number=self.kwargs["number"]
        )

    def retrieve(self, request, *args, **kwargs):
        return Response(VersionConfigSerializer(self.get_object()).data)

    def update(self, request, *args, **kwargs):
        version = self.get_object()
        serializer = VersionConfigSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        services.update_config(
            actor=request.user, version=version, text=serializer.validated_data["config_text"]
        )
        return Response(VersionConfigSerializer(version).data)

    @extend_schema(
        request=DeriveVersionSerializer,
        responses={201: VersionConfigSerializer},
        summary="Create a version serving the same files with other serving settings (READY at once)",
    )
    def derive(self, request, *args, **kwargs):
        version = self.get_object()
        serializer = DeriveVersionSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        text = data.get("config_text")
        if text is None:
            serving = data["serving"]
            try:
                base = gc.parse_config(version.config_text)
            except gc.ConfigError:
                raise serializers.ValidationError(
                    {"version": "This version's config cannot be read."}
                ) from None
            candidate = tuning.Candidate(
                dynamic_batching=serving["dynamic_batching"],
                max_batch_size=serving["max_batch_size"],
                max_queue_delay_us=serving.get("max_queue_delay_us", 0),
                preferred=tuple(serving.get("preferred", ())),
                instance_count=serving["instance_count"],
            )
            text = gc.render_config(candidate.apply(base))
        derived = services.derive_version(
            actor=request.user, version=version, text=text, note=data.get("note", "")
        )
        return Response(VersionConfigSerializer(derived).data, status=status.HTTP_201_CREATED)
