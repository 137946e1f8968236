"""REST API of tuning jobs (``/api/v1/teams/{team}/tunings/``): members read them with every point and the
recommendation; maintainers start one for a version and pool, cancel it, and turn its recommendation into a
new version (which then rolls out like any version)."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from drf_spectacular.utils import extend_schema, extend_schema_field, inline_serializer
from rest_framework import mixins, serializers, status
from rest_framework.decorators import action
from rest_framework.response import Response

from apps.deployments import scheduler, tuning_jobs
from apps.deployments.api import ERROR
from apps.deployments.tuning_models import TuningJob
from apps.registry.models import RegisteredModel
from apps.teams.models import Action
from apps.teams.viewsets import TeamScopedViewSet


class TuningSerializer(serializers.ModelSerializer):
    model = serializers.CharField(source="version.model.slug")
    version = serializers.IntegerField(source="version.number")
    pool = serializers.CharField(source="pool.name", allow_null=True, default=None)
    instance = serializers.SerializerMethodField()
    progress = serializers.IntegerField()
    points_measured = serializers.SerializerMethodField()
    recommended = serializers.SerializerMethodField()
    message = serializers.SerializerMethodField()
    created_by = serializers.CharField(source="created_by.username", allow_null=True, default=None)

    class Meta:
        model = TuningJob
        fields = [
            "id",
            "model",
            "version",
            "pool",
            "instance",
            "state",
            "reason",
            "progress",
            "objective",
            "budget_s",
            "max_candidates",
            "max_instances",
            "gears",
            "reserved_mb",
            "cancel_requested",
            "points_measured",
            "recommended",
            "message",
            "created_by",
            "created_at",
            "started_at",
            "reported_at",
            "finished_at",
        ]
        read_only_fields = fields

    @extend_schema_field(serializers.CharField(allow_null=True))
    def get_instance(self, job: TuningJob) -> str | None:
        return str(job.instance) if job.instance_id else None

    def get_points_measured(self, job: TuningJob) -> int:
        return len(job.points)

    @extend_schema_field(serializers.DictField(allow_null=True))
    def get_recommended(self, job: TuningJob) -> dict | None:
        return (job.result or {}).get("recommended")

    @extend_schema_field(serializers.CharField())
    def get_message(self, job: TuningJob) -> str:
        return (job.result or {}).get("message", "")


class TuningDetailSerializer(TuningSerializer):
    class Meta(TuningSerializer.Meta):
        fields = [*TuningSerializer.Meta.fields, "result", "points", "log"]
        read_only_fields = fields


class TuningStartSerializer(serializers.Serializer):
    model = serializers.CharField(max_length=50)
    version = serializers.IntegerField(min_value=1, max_value=2_147_483_647)
    pool = serializers.CharField(
        max_length=63, required=False, allow_blank=True, allow_null=True, help_text="Empty: any usable pool."
    )
    budget_s = serializers.IntegerField(
        required=False, default=tuning_jobs.DEFAULT_BUDGET_S, help_text="The time budget, 30-3600 s."
    )
    max_candidates = serializers.IntegerField(
        required=False, default=tuning_jobs.DEFAULT_MAX_CANDIDATES, help_text="1-30 configs measured."
    )
    max_instances = serializers.IntegerField(
        required=False,
        default=1,
        help_text="The most model instances a candidate may run (the team's limit).",
    )


class CreateVersionSerializer(serializers.Serializer):
    note = serializers.CharField(required=False, allow_blank=True, max_length=2000)


class TuningViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TeamScopedViewSet):
    """A team's tuning jobs, newest first (``?model=<slug>``, ``?version=<n>``, ``?state=``). POST
    (maintainer) starts one; ``cancel`` stops it; ``create-version`` makes a version with the recommended
    config."""

    queryset = TuningJob.objects.select_related("version__model", "pool", "instance__host", "created_by")
    serializer_class = TuningSerializer
    filterset_fields = ["state"]
    ordering_fields = ["created_at", "state"]
    action_requirements = {
        "cancel": Action.CHANGE,
        "create_version": Action.CHANGE,
        "reconvert": Action.CHANGE,
    }

    def get_queryset(self):
        rows = super().get_queryset()
        model = self.request.query_params.get("model")
        if model:
            rows = rows.filter(version__model__slug=model)
        number = self.request.query_params.get("version")
        if number:
            if not number.isdigit() or len(number) > 9:
                raise ValidationError({"version": ["Give a version number."]})
            rows = rows.filter(version__number=int(number))
        return rows

    def get_serializer_class(self):
        return TuningDetailSerializer if self.action == "retrieve" else TuningSerializer

    def _detail(self, job: TuningJob, code: int = status.HTTP_200_OK) -> Response:
        return Response(TuningDetailSerializer(self.get_queryset().get(pk=job.pk)).data, status=code)

    @extend_schema(request=TuningStartSerializer, responses={201: TuningDetailSerializer, 400: ERROR})
    def create(self, request, *args, **kwargs):
        serializer = TuningStartSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        model = RegisteredModel.objects.filter(team=self.team, slug=data["model"]).first()
        if model is None:
            raise ValidationError({"model": [f"Team {self.team.slug} has no model '{data['model']}'."]})
        version = model.versions.select_related("model__team").filter(number=data["version"]).first()
        if version is None:
            raise ValidationError({"version": [f"{model} has no version {data['version']}."]})
        job = tuning_jobs.start_tuning(
            actor=request.user,
            version=version,
            pool=scheduler.usable_pool(self.team, data.get("pool")),
            budget_s=data["budget_s"],
            max_candidates=data["max_candidates"],
            max_instances=data["max_instances"],
        )
        return self._detail(job, status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={200: TuningDetailSerializer, 400: ERROR})
    @action(detail=True, methods=["post"])
    def cancel(self, request, *args, **kwargs):
        return self._detail(tuning_jobs.cancel(actor=request.user, job=self.get_object()))

    @extend_schema(
        request=CreateVersionSerializer,
        responses={
            201: inline_serializer(
                "TuningVersion",
                {
                    "model": serializers.CharField(),
                    "version": serializers.IntegerField(),
                    "note": serializers.CharField(),
                    "tuning": serializers.IntegerField(),
                },
            ),
            400: ERROR,
        },
    )
    @action(detail=True, methods=["post"], url_path="create-version")
    def create_version(self, request, *args, **kwargs):
        serializer = CreateVersionSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        job = self.get_object()
        version = tuning_jobs.create_recommended_version(
            actor=request.user, job=job, note=serializer.validated_data.get("note", "")
        )
        return Response(
            {"model": version.model.slug, "version": version.number, "note": version.note, "tuning": job.pk},
            status=status.HTTP_201_CREATED,
        )

    @extend_schema(
        request=None,
        responses={
            201: inline_serializer(
                "TuningReconversion",
                {
                    "model": serializers.CharField(),
                    "version": serializers.IntegerField(),
                    "conversion_job": serializers.IntegerField(),
                    "batch_gears": serializers.CharField(),
                },
            ),
            400: ERROR,
        },
    )
    @action(detail=True, methods=["post"])
    def reconvert(self, request, *args, **kwargs):
        """The next version compiled again with the gears the tuning suggested (an NPU version's)."""
        conversion = tuning_jobs.reconvert_with_gears(actor=request.user, job=self.get_object())
        return Response(
            {
                "model": conversion.version.model.slug,
                "version": conversion.version.number,
                "conversion_job": conversion.pk,
                "batch_gears": conversion.options["batch_gears"],
            },
            status=status.HTTP_201_CREATED,
        )
