"""REST API of rollouts, under their deployment: members read them with every analysis; maintainers start,
pause, resume, promote and abort (each audited)."""

from __future__ import annotations

from functools import cached_property

from django.core.exceptions import ValidationError
from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_field, extend_schema_view
from rest_framework import mixins, serializers, status
from rest_framework.decorators import action
from rest_framework.response import Response

from apps.deployments import rollouts
from apps.deployments.api import ERROR
from apps.deployments.models import Deployment, Rollout, RolloutAnalysis
from apps.registry.models import ModelVersion
from apps.teams.models import Action
from apps.teams.viewsets import TeamScopedViewSet

ANALYSES_SHOWN = 500


class RolloutAnalysisSerializer(serializers.ModelSerializer):
    class Meta:
        model = RolloutAnalysis
        fields = [
            "id",
            "checked_at",
            "window_start",
            "weight",
            "passed",
            "waiting",
            "figures",
            "failed_gates",
        ]
        read_only_fields = fields


class RolloutSerializer(serializers.ModelSerializer):
    deployment = serializers.IntegerField(source="deployment_id")
    stable_version = serializers.IntegerField(
        source="stable_version.number",
        allow_null=True,
        default=None,
        help_text="null once the version was deleted",
    )
    canary_version = serializers.IntegerField(
        source="canary_version.number",
        allow_null=True,
        default=None,
        help_text="null once the version was deleted",
    )
    steps = serializers.ListField(child=serializers.IntegerField())
    created_by = serializers.CharField(source="created_by.username", allow_null=True, default=None)

    class Meta:
        model = Rollout
        fields = [
            "id",
            "deployment",
            "stable_version",
            "canary_version",
            "state",
            "steps",
            "current_step",
            "current_weight",
            "step_interval_s",
            "min_success_rate",
            "max_p99_ms",
            "max_p99_ratio",
            "min_requests",
            "max_failed_checks",
            "traffic_deadline_s",
            "consecutive_failures",
            "step_started_at",
            "next_check_at",
            "reason",
            "created_by",
            "created_at",
            "updated_at",
            "finished_at",
        ]
        read_only_fields = fields


class RolloutDetailSerializer(RolloutSerializer):
    analyses = serializers.SerializerMethodField()

    class Meta(RolloutSerializer.Meta):
        fields = [*RolloutSerializer.Meta.fields, "analyses"]
        read_only_fields = fields

    @extend_schema_field(RolloutAnalysisSerializer(many=True))
    def get_analyses(self, rollout: Rollout) -> list[dict]:
        rows = rollout.analyses.order_by("-checked_at", "-id")[:ANALYSES_SHOWN]
        return RolloutAnalysisSerializer(reversed(list(rows)), many=True).data


class RolloutStartSerializer(serializers.Serializer):
    version = serializers.IntegerField(min_value=1, max_value=2_147_483_647, help_text="The canary version.")
    steps = serializers.ListField(
        child=serializers.IntegerField(min_value=1, max_value=100),
        required=False,
        min_length=1,
        max_length=rollouts.MAX_STEPS,
        help_text="Canary weights in percent, increasing, ending at 100 (default 10, 25, 50, 100).",
    )
    step_interval_s = serializers.IntegerField(required=False, default=60, min_value=1, max_value=86_400)
    min_success_rate = serializers.FloatField(required=False, default=0.99, min_value=0, max_value=1)
    max_p99_ms = serializers.FloatField(required=False, allow_null=True, default=None, min_value=0)
    max_p99_ratio = serializers.FloatField(required=False, allow_null=True, default=None, min_value=0)
    min_requests = serializers.IntegerField(required=False, default=50, min_value=1, max_value=1_000_000)
    max_failed_checks = serializers.IntegerField(required=False, default=3, min_value=1, max_value=100)
    traffic_deadline_s = serializers.IntegerField(required=False, default=600, min_value=1, max_value=86_400)


@extend_schema(
    parameters=[
        OpenApiParameter(
            "deployment_pk", OpenApiTypes.INT, OpenApiParameter.PATH, description="The deployment's id."
        )
    ]
)
@extend_schema_view(
    list=extend_schema(responses={200: RolloutSerializer(many=True)}),
    retrieve=extend_schema(responses={200: RolloutDetailSerializer}),
)
class RolloutViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TeamScopedViewSet):
    """The rollouts of one deployment, newest first; the detail carries every analysis (the latest 500).
    POST (maintainer) starts one; ``pause``, ``resume``, ``promote`` (now) and ``abort`` (roll back now)."""

    queryset = Rollout.objects.select_related("stable_version", "canary_version", "created_by")
    serializer_class = RolloutSerializer
    filterset_fields = ["state"]
    ordering_fields = ["created_at", "state"]
    action_requirements = {
        "pause": Action.CHANGE,
        "resume": Action.CHANGE,
        "promote": Action.CHANGE,
        "abort": Action.CHANGE,
    }

    @cached_property
    def deployment(self) -> Deployment:
        return get_object_or_404(
            Deployment.objects.for_user(self.request.user, Action.VIEW).filter(team=self.team),
            pk=self.kwargs["deployment_pk"],
        )

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return Rollout.objects.none()
        return self.queryset.for_user(self.request.user, Action.VIEW).filter(deployment=self.deployment)

    def get_serializer_class(self):
        return RolloutDetailSerializer if self.action == "retrieve" else RolloutSerializer

    def _detail(self, rollout: Rollout, code: int = status.HTTP_200_OK) -> Response:
        return Response(RolloutDetailSerializer(self.get_queryset().get(pk=rollout.pk)).data, status=code)

    @extend_schema(request=RolloutStartSerializer, responses={201: RolloutDetailSerializer, 400: ERROR})
    def create(self, request, *args, **kwargs):
        serializer = RolloutStartSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = dict(serializer.validated_data)
        number = data.pop("version")
        deployment = self.deployment
        canary = ModelVersion.objects.filter(model_id=deployment.model_id, number=number).first()
        if canary is None:
            raise ValidationError({"version": [f"{deployment.model} has no version {number}."]})
        rollout = rollouts.start_rollout(actor=request.user, deployment=deployment, canary=canary, **data)
        return self._detail(rollout, status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={200: RolloutDetailSerializer, 400: ERROR})
    @action(detail=True, methods=["post"])
    def pause(self, request, *args, **kwargs):
        return self._detail(rollouts.pause(actor=request.user, rollout=self.get_object()))

    @extend_schema(request=None, responses={200: RolloutDetailSerializer, 400: ERROR})
    @action(detail=True, methods=["post"])
    def resume(self, request, *args, **kwargs):
        return self._detail(rollouts.resume(actor=request.user, rollout=self.get_object()))

    @extend_schema(request=None, responses={200: RolloutDetailSerializer, 400: ERROR})
    @action(detail=True, methods=["post"])
    def promote(self, request, *args, **kwargs):
        return self._detail(rollouts.promote_now(actor=request.user, rollout=self.get_object()))

    @extend_schema(request=None, responses={200: RolloutDetailSerializer, 400: ERROR})
    @action(detail=True, methods=["post"])
    def abort(self, request, *args, **kwargs):
        return self._detail(rollouts.abort(actor=request.user, rollout=self.get_object()))
