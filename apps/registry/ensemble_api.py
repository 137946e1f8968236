"""REST API for composing an ensemble version from the team's own models.

``POST teams/<team>/models/<ensemble slug>/ensemble-versions/`` with ``steps`` (each ``model`` slug,
``version`` or null for the version serving, ``input_map`` {step input: tensor}, ``output_map`` {step
output: tensor}), ``inputs``/``outputs`` (tensor names; ``data_type``/``dims`` optional) and
``max_batch_size``. Answers the new READY version, or 400 with every wiring mistake by field path.
"""

from __future__ import annotations

from functools import cached_property

from django.core.exceptions import ValidationError
from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.decorators import action
from rest_framework.response import Response

from apps.registry import ensembles
from apps.registry.api import ModelVersionSerializer
from apps.registry.models import ModelVersion, RegisteredModel
from apps.teams.viewsets import TeamScopedViewSet


class TensorSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=128)
    data_type = serializers.CharField(max_length=16, required=False, help_text="FP32, UINT8, ...")
    dims = serializers.ListField(child=serializers.IntegerField(), required=False, max_length=8)


class StepSerializer(serializers.Serializer):
    model = serializers.CharField(max_length=120, help_text="The slug of one of the team's models.")
    version = serializers.IntegerField(
        required=False, allow_null=True, min_value=1, help_text="Omit or null: the version serving."
    )
    input_map = serializers.DictField(child=serializers.CharField(max_length=128))
    output_map = serializers.DictField(child=serializers.CharField(max_length=128))


class UpdateStepSerializer(serializers.Serializer):
    from_version = serializers.IntegerField(
        required=False,
        min_value=1,
        help_text="The ensemble version to start from; omit for the latest READY.",
    )
    step = serializers.CharField(
        max_length=120, help_text="The step's position (0, 1, ...) or its model's slug."
    )
    version = serializers.IntegerField(min_value=1, help_text="The version of the step's model to call.")
    note = serializers.CharField(required=False, allow_blank=True, max_length=2000)


class ComposeSerializer(serializers.Serializer):
    steps = StepSerializer(many=True)
    inputs = TensorSerializer(many=True)
    outputs = TensorSerializer(many=True)
    max_batch_size = serializers.IntegerField(required=False, default=0, min_value=0)
    note = serializers.CharField(required=False, allow_blank=True, max_length=2000)


@extend_schema(
    parameters=[
        OpenApiParameter(
            "model_slug", OpenApiTypes.STR, OpenApiParameter.PATH, description="The ensemble's slug."
        )
    ]
)
class EnsembleVersionViewSet(TeamScopedViewSet):
    """Compose a new version of an ensemble (maintainers)."""

    queryset = ModelVersion.objects.all()
    serializer_class = ComposeSerializer

    @cached_property
    def registered_model(self) -> RegisteredModel:
        return get_object_or_404(
            RegisteredModel.objects.for_user(self.request.user, "view").filter(team=self.team),
            slug=self.kwargs["model_slug"],
        )

    @extend_schema(request=ComposeSerializer, responses={201: ModelVersionSerializer})
    def create(self, request, team_slug=None, model_slug=None):
        model = self.registered_model
        serializer = ComposeSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        spec = dict(serializer.validated_data)
        version = ensembles.compose_ensemble(
            actor=request.user, model=model, spec=_plain(spec), note=spec.get("note", "")
        )
        version = ModelVersion.objects.select_related("model__team").get(pk=version.pk)
        return Response(ModelVersionSerializer(version).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=UpdateStepSerializer, responses={201: ModelVersionSerializer})
    @action(detail=False, methods=["post"], url_path="update-step")
    def update_step(self, request, team_slug=None, model_slug=None):
        """A new ensemble version with one step pinned to another version (roll it out like any version)."""
        model = self.registered_model
        serializer = UpdateStepSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        versions = model.versions.ready()
        base = (
            versions.filter(number=data["from_version"]).first()
            if "from_version" in data
            else versions.order_by("-number").first()
        )
        if base is None:
            raise ValidationError({"from_version": [f"{model.slug} has no such READY version."]})
        step = data["step"]
        version = ensembles.update_step(
            actor=request.user,
            version=base,
            step=int(step) if step.isdigit() else step,
            step_version=data["version"],
            note=data.get("note", ""),
        )
        version = ModelVersion.objects.select_related("model__team").get(pk=version.pk)
        return Response(ModelVersionSerializer(version).data, status=status.HTTP_201_CREATED)


def _plain(value):
    """DRF's OrderedDicts and ReturnLists as plain dicts and lists (the service checks types exactly)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
