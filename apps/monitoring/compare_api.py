"""``GET /api/v1/teams/<team>/models/<model>/compare/?a=<n>&b=<n>&range=1h``: two versions side by side."""

from __future__ import annotations

from django.http import Http404
from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response

from apps.monitoring import rollups
from apps.monitoring.comparison import CompareError, check_numbers, compare_versions
from apps.registry.models import ModelVersion, RegisteredModel
from apps.teams.viewsets import TeamScopedViewSet


class CompareQuerySerializer(serializers.Serializer):
    a = serializers.IntegerField(min_value=1, max_value=10**9, help_text="A version number of the model.")
    b = serializers.IntegerField(min_value=1, max_value=10**9, help_text="Another version number.")
    range = serializers.ChoiceField(choices=list(rollups.RANGES), default="1h")

    def validate(self, attrs):
        try:
            check_numbers(attrs["a"], attrs["b"])
        except CompareError as exc:
            raise ValidationError({"b": [str(exc)]}) from None
        return attrs


class TensorSerializer(serializers.Serializer):
    dtype = serializers.CharField()
    shape = serializers.ListField(child=serializers.IntegerField(), help_text="-1: the batch dimension.")
    format = serializers.CharField()


class TensorRowSerializer(serializers.Serializer):
    kind = serializers.ChoiceField(choices=["input", "output"])
    name = serializers.CharField()
    a = TensorSerializer(allow_null=True, help_text="Null: version a has no such tensor.")
    b = TensorSerializer(allow_null=True)
    changed = serializers.ListField(child=serializers.CharField(), help_text="The fields that differ.")


class SignatureDiffSerializer(serializers.Serializer):
    batched = serializers.DictField(child=serializers.BooleanField())
    tensors = TensorRowSerializer(many=True)
    identical = serializers.BooleanField()
    known = serializers.BooleanField(help_text="False while a version's signature is not read yet.")


class DiffLineSerializer(serializers.Serializer):
    op = serializers.ChoiceField(
        choices=["+", "-", " ", "@"], help_text="Added, removed, context, hunk header."
    )
    text = serializers.CharField(allow_blank=True)


class ConfigDiffSerializer(serializers.Serializer):
    identical = serializers.BooleanField()
    lines = DiffLineSerializer(many=True)
    truncated = serializers.BooleanField()
    added = serializers.IntegerField()
    removed = serializers.IntegerField()


class ConversionSerializer(serializers.Serializer):
    job = serializers.IntegerField()
    state = serializers.CharField()
    toolchain = serializers.CharField(allow_blank=True)
    options = serializers.DictField(child=serializers.JSONField(), help_text="The conversion parameters.")
    command = serializers.ListField(child=serializers.CharField(allow_blank=True), help_text="ATC argv.")
    started_at = serializers.DateTimeField(allow_null=True)
    finished_at = serializers.DateTimeField(allow_null=True)
    duration_seconds = serializers.FloatField(allow_null=True)


class ServingSerializer(serializers.Serializer):
    requests = serializers.IntegerField()
    success = serializers.IntegerField()
    failure = serializers.IntegerField()
    error_rate = serializers.FloatField(allow_null=True)
    requests_per_second = serializers.FloatField()
    mean_ms = serializers.FloatField(allow_null=True)
    queue_ms = serializers.FloatField(allow_null=True)
    p50_ms = serializers.FloatField(allow_null=True, help_text="Null without Triton latency summaries.")
    p99_ms = serializers.FloatField(allow_null=True)


class ComparedVersionSerializer(serializers.Serializer):
    number = serializers.IntegerField()
    state = serializers.CharField()
    archived = serializers.BooleanField()
    source_format = serializers.CharField(allow_blank=True)
    source_format_label = serializers.CharField(allow_blank=True)
    source_filename = serializers.CharField(allow_blank=True)
    size_bytes = serializers.IntegerField()
    servable_bytes = serializers.IntegerField(allow_null=True)
    sha256 = serializers.CharField(allow_blank=True)
    toolchain = serializers.CharField(allow_blank=True)
    created_at = serializers.DateTimeField()
    tags = serializers.ListField(child=serializers.CharField())
    conversion = ConversionSerializer(allow_null=True)
    serving = ServingSerializer()


class OptionRowSerializer(serializers.Serializer):
    key = serializers.CharField()
    a = serializers.JSONField(allow_null=True)
    b = serializers.JSONField(allow_null=True)
    changed = serializers.BooleanField()


class VersionComparisonSerializer(serializers.Serializer):
    team = serializers.CharField()
    model = serializers.CharField()
    range = serializers.CharField()
    start = serializers.DateTimeField()
    end = serializers.DateTimeField()
    a = ComparedVersionSerializer()
    b = ComparedVersionSerializer()
    signature = SignatureDiffSerializer()
    config = ConfigDiffSerializer()
    options = OptionRowSerializer(many=True)
    differences = serializers.DictField(
        child=serializers.JSONField(allow_null=True),
        help_text="true/false, or b relative to a (0.25: b is 25% higher; null when unknown).",
    )


@extend_schema(
    parameters=[
        OpenApiParameter(
            "model_slug", OpenApiTypes.STR, OpenApiParameter.PATH, description="The model's slug."
        ),
        OpenApiParameter(
            "a", OpenApiTypes.INT, OpenApiParameter.QUERY, required=True, description="Version a."
        ),
        OpenApiParameter(
            "b", OpenApiTypes.INT, OpenApiParameter.QUERY, required=True, description="Version b."
        ),
        OpenApiParameter(
            "range",
            OpenApiTypes.STR,
            OpenApiParameter.QUERY,
            enum=list(rollups.RANGES),
            default="1h",
            description="The span of the serving figures.",
        ),
    ]
)
class VersionComparisonViewSet(TeamScopedViewSet):
    """Two versions of one model side by side: signature, config.pbtxt diff, files, conversion, serving."""

    queryset = RegisteredModel.objects.all()
    serializer_class = VersionComparisonSerializer
    pagination_class = None
    filter_backends: list = []

    @extend_schema(responses=VersionComparisonSerializer, operation_id="team_model_compare")
    def retrieve(self, request, *args, **kwargs):
        model = get_object_or_404(self.get_queryset().select_related("team"), slug=kwargs["model_slug"])
        query = CompareQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        data = query.validated_data
        try:
            payload = compare_versions(model, data["a"], data["b"], data["range"])
        except ModelVersion.DoesNotExist as exc:
            raise Http404(str(exc)) from None
        return Response(VersionComparisonSerializer(payload).data)
