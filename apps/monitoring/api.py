"""Chart data as part of the REST API: per model (team-scoped), per instance and for the fleet (scoped like
hosts). The pages fetch these same endpoints."""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, viewsets
from rest_framework.response import Response

from apps.fleet.models import TritonInstance
from apps.monitoring import retune, rollups, services
from apps.registry.models import RegisteredModel
from apps.teams.models import Action
from apps.teams.viewsets import TeamScopedViewSet

RANGE_PARAMETER = OpenApiParameter(
    "range",
    OpenApiTypes.STR,
    OpenApiParameter.QUERY,
    enum=list(rollups.RANGES),
    default="1h",
    description="How far back: one point per minute (15m, 1h, 6h), 5 minutes (24h) or hour (7d).",
)
VERSION_PARAMETER = OpenApiParameter(
    "version", OpenApiTypes.INT, OpenApiParameter.QUERY, description="Keep one version's line."
)
DEPLOYMENT_PARAMETER = OpenApiParameter(
    "deployment",
    OpenApiTypes.INT,
    OpenApiParameter.QUERY,
    description="A deployment of this model: only its instances' traffic and its own markers.",
)


def points() -> serializers.ListField:
    """One value per timestamp; null where there is nothing to average."""
    return serializers.ListField(child=serializers.FloatField(allow_null=True))


class RangeQuerySerializer(serializers.Serializer):
    range = serializers.ChoiceField(choices=list(rollups.RANGES), default="1h")


class ModelQuerySerializer(RangeQuerySerializer):
    version = serializers.IntegerField(required=False, min_value=1)
    deployment = serializers.IntegerField(required=False, min_value=1)


class MarkerSerializer(serializers.Serializer):
    time = serializers.IntegerField(help_text="Unix seconds.")
    kind = serializers.CharField()
    label = serializers.CharField()
    message = serializers.CharField()
    deployment = serializers.IntegerField()
    version = serializers.IntegerField(allow_null=True)


class FrameSerializer(serializers.Serializer):
    range = serializers.CharField()
    step_seconds = serializers.IntegerField()
    start = serializers.DateTimeField()
    end = serializers.DateTimeField()
    timestamps = serializers.ListField(child=serializers.IntegerField(), help_text="Unix seconds per point.")


class CountsSerializer(serializers.Serializer):
    requests = serializers.IntegerField(help_text="Requests the model took: success + failure.")
    success = serializers.IntegerField(required=False)
    failure = serializers.IntegerField(help_text="Server failures (retry): what error rates and gates judge.")
    client_errors = serializers.IntegerField(
        required=False, help_text="Requests refused as malformed (400: fix the request); not in error_rate."
    )
    error_rate = serializers.FloatField(allow_null=True, required=False)


class VersionSeriesSerializer(serializers.Serializer):
    version = serializers.IntegerField()
    latency = serializers.ChoiceField(choices=["quantiles", "average"])
    requests_per_second = points()
    error_rate = points()
    client_errors_per_second = points()
    avg_latency_ms = points()
    p50_ms = points()
    p95_ms = points()
    p99_ms = points()
    queue_ms = points()
    compute_ms = points()
    avg_batch_size = points()
    totals = CountsSerializer()


class GatewayTotalsSerializer(serializers.Serializer):
    requests = serializers.IntegerField()
    responses_2xx = serializers.IntegerField()
    responses_4xx = serializers.IntegerField()
    responses_5xx = serializers.IntegerField()
    responses_401 = serializers.IntegerField()
    responses_404 = serializers.IntegerField()
    responses_429 = serializers.IntegerField()
    responses_400 = serializers.IntegerField(
        help_text="Bad requests its instances answered (HTTP 400, gRPC INVALID_ARGUMENT): client errors."
    )
    requests_interactive = serializers.IntegerField(
        help_text="Requests admitted to the model (past the token and rate checks) from interactive callers."
    )
    requests_batch = serializers.IntegerField(help_text="The same from batch callers.")


class GatewaySeriesSerializer(serializers.Serializer):
    """What the gateway (HAProxy) saw: requests it forwarded, the refusals it answered itself, bad requests
    (400, client errors) and server errors (5xx) apart, its time."""

    requests_per_second = points()
    unauthorized_per_second = points()
    not_found_per_second = points()
    rate_limited_per_second = points()
    bad_requests_per_second = points()
    server_errors_per_second = points()
    interactive_per_second = points()
    batch_per_second = points()
    avg_ms = points()
    totals = GatewayTotalsSerializer()


class ReplicaSeriesSerializer(serializers.Serializer):
    """An autoscaled deployment's replicas: the highest desired and ready count in each step."""

    desired = serializers.ListField(child=serializers.IntegerField(allow_null=True))
    ready = serializers.ListField(child=serializers.IntegerField(allow_null=True))
    desired_now = serializers.IntegerField()
    ready_now = serializers.IntegerField()
    min_replicas = serializers.IntegerField()
    max_replicas = serializers.IntegerField(allow_null=True)
    markers = MarkerSerializer(many=True, help_text="The autoscaler's decisions in the range.")


class ModelMetricsSerializer(FrameSerializer):
    team = serializers.CharField()
    model = serializers.CharField()
    triton_name = serializers.CharField()
    latency = serializers.ChoiceField(
        choices=["quantiles", "average"], help_text="Quantiles where Triton's latency summaries are on."
    )
    latency_label = serializers.CharField()
    focus_version = serializers.IntegerField(allow_null=True)
    deployment = serializers.IntegerField(allow_null=True)
    versions = VersionSeriesSerializer(many=True)
    markers = MarkerSerializer(many=True, help_text="Deploys, switches and rollbacks in the range.")
    totals = CountsSerializer()
    failure_reasons = serializers.DictField(child=serializers.IntegerField())
    gateway = GatewaySeriesSerializer(
        help_text="At the gateway, per deployment of the model (not per version): requests forwarded, "
        "401 and 429 refusals of requests naming the model, 404s and 400s its instances answered, 5xx, "
        "average time."
    )
    replicas = ReplicaSeriesSerializer(
        allow_null=True,
        help_text="With ``deployment`` of an autoscaled deployment: its replicas over time and the "
        "autoscaler's decisions; null otherwise.",
    )


class DeviceSeriesSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    hbm_total_mb = serializers.IntegerField(allow_null=True)
    aicore_percent = points()
    hbm_used_mb = points()


class InstanceMetricsSerializer(FrameSerializer):
    host = serializers.CharField()
    instance = serializers.CharField()
    state = serializers.CharField()
    latency_summaries = serializers.BooleanField()
    requests_per_second = points()
    error_rate = points()
    cpu_percent = points()
    scrape_failures = serializers.ListField(child=serializers.IntegerField())
    devices = DeviceSeriesSerializer(many=True)


class FleetTotalsSerializer(serializers.Serializer):
    requests = serializers.IntegerField()
    failure = serializers.IntegerField()
    client_errors = serializers.IntegerField()
    error_rate = serializers.FloatField(allow_null=True)
    instances = serializers.IntegerField()
    instances_ready = serializers.IntegerField()
    hosts = serializers.IntegerField()


class BusyModelSerializer(serializers.Serializer):
    team = serializers.CharField()
    model = serializers.CharField()
    requests = serializers.IntegerField()
    requests_per_second = serializers.FloatField()
    error_rate = serializers.FloatField(allow_null=True)


class FleetMetricsSerializer(FrameSerializer):
    requests_per_second = points()
    error_rate = points()
    totals = FleetTotalsSerializer()
    instances_by_state = serializers.DictField(child=serializers.IntegerField())
    busiest_models = BusyModelSerializer(many=True)
    gateway = GatewaySeriesSerializer(
        allow_null=True,
        help_text="Platform staff: everything that reached the gateway, refusals before any model included.",
    )


def _range(request) -> str:
    query = RangeQuerySerializer(data=request.query_params)
    query.is_valid(raise_exception=True)
    return query.validated_data["range"]


@extend_schema(
    parameters=[
        OpenApiParameter(
            "model_slug", OpenApiTypes.STR, OpenApiParameter.PATH, description="The model's slug."
        ),
        RANGE_PARAMETER,
        VERSION_PARAMETER,
        DEPLOYMENT_PARAMETER,
    ]
)
class ModelMetricsViewSet(TeamScopedViewSet):
    """Time series of one model, one line per version (a rollout shows as one line handing over to the next)."""

    queryset = RegisteredModel.objects.all()
    serializer_class = ModelMetricsSerializer
    pagination_class = None
    filter_backends: list = []

    # "retrieve", not "list": the answer is one object, and drf-spectacular documents a list action as an array.
    @extend_schema(responses=ModelMetricsSerializer, operation_id="team_model_metrics")
    def retrieve(self, request, *args, **kwargs):
        model = get_object_or_404(self.get_queryset(), slug=kwargs["model_slug"])
        query = ModelQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        deployment = None
        if "deployment" in query.validated_data:
            deployment = get_object_or_404(model.deployments.all(), pk=query.validated_data["deployment"])
        data = services.model_metrics(
            model,
            query.validated_data["range"],
            version=query.validated_data.get("version"),
            deployment=deployment,
        )
        return Response(ModelMetricsSerializer(data).data)


@extend_schema(
    parameters=[
        OpenApiParameter("id", OpenApiTypes.INT, OpenApiParameter.PATH, description="The instance's id."),
        RANGE_PARAMETER,
    ]
)
class InstanceMetricsViewSet(viewsets.GenericViewSet):
    """An instance's traffic (of the models the caller may read), CPU use, scrape failures and its NPUs."""

    queryset = TritonInstance.objects.select_related("host")
    serializer_class = InstanceMetricsSerializer
    pagination_class = None
    filter_backends: list = []

    @extend_schema(responses=InstanceMetricsSerializer, operation_id="instance_metrics")
    def retrieve(self, request, *args, **kwargs):
        visible = self.get_queryset().for_user(request.user, Action.VIEW)
        instance = get_object_or_404(visible, pk=kwargs["pk"])
        data = services.instance_metrics(instance, request.user, _range(request))
        return Response(InstanceMetricsSerializer(data).data)


@extend_schema(parameters=[RANGE_PARAMETER])
class FleetMetricsViewSet(viewsets.GenericViewSet):
    """Totals over the instances the caller can see, and the busiest models among those they may read."""

    serializer_class = FleetMetricsSerializer
    pagination_class = None
    filter_backends: list = []

    @extend_schema(responses=FleetMetricsSerializer, operation_id="fleet_metrics")
    def retrieve(self, request, *args, **kwargs):
        return Response(FleetMetricsSerializer(services.fleet_metrics(request.user, _range(request))).data)


class TuningAdviceSerializer(serializers.Serializer):
    state = serializers.ChoiceField(choices=retune.ADVICE_STATES)
    reasons = serializers.ListField(child=serializers.CharField())
    live = serializers.DictField()
    tuned = serializers.DictField(allow_null=True)
    tuning = serializers.IntegerField(allow_null=True)


class TuningAdviceViewSet(TeamScopedViewSet):
    """Whether a version's live traffic (the last 15 minutes) has moved away from the point its serving
    settings were tuned at (``apps.monitoring.retune``): ``retune`` with the reasons, ``steady``, ``quiet``
    (too little traffic to say) or ``untuned``. A suggestion only: nothing changes a serving config but a
    new version and a rollout."""

    queryset = RegisteredModel.objects.all()
    serializer_class = TuningAdviceSerializer
    pagination_class = None
    filter_backends: list = []

    @extend_schema(responses=TuningAdviceSerializer, operation_id="team_version_tuning_advice")
    def retrieve(self, request, *args, **kwargs):
        model = get_object_or_404(self.get_queryset(), slug=kwargs["model_slug"])
        version = get_object_or_404(model.versions.all(), number=kwargs["number"])
        return Response(TuningAdviceSerializer(retune.advice(version)).data)
