"""REST API of deployments: deploy, switch version, undeploy, event history, how to call it, playground.

Members read (viewers included); maintainers deploy, switch and undeploy. The playground counts as reading:
it runs one inference on an endpoint that any client who can reach the instance may call anyway (Triton's
inference API is open; only its control plane is restricted), so it grants a viewer nothing new.
"""

from __future__ import annotations

import json

from django.conf import settings
from django.core.exceptions import ValidationError
from drf_spectacular.utils import extend_schema, extend_schema_field, inline_serializer
from rest_framework import mixins, serializers, status
from rest_framework.decorators import action
from rest_framework.exceptions import APIException, ParseError
from rest_framework.parsers import BaseParser, FormParser, MultiPartParser
from rest_framework.response import Response

from apps.core.body_limits import PLAYGROUND_HINT, RequestTooLarge, limit_body, too_large_message
from apps.deployments import autoscaling, calling, scheduler, services
from apps.deployments.models import (
    Deployment,
    DeploymentEvent,
    DeploymentInstance,
    DeploymentState,
    GatewayView,
    Spread,
)
from apps.fleet.models import Pool, TritonInstance, is_platform_staff
from apps.registry.models import ModelVersion, RegisteredModel
from apps.teams.models import Action
from apps.teams.viewsets import TeamScopedViewSet

EVENTS_SHOWN = 100


def _shows_instance_addresses(serializer: serializers.Serializer) -> bool:
    """Instance addresses are for platform staff: a tenant's client calls the gateway, and an instance
    answers it 403."""
    request = serializer.context.get("request")
    return request is not None and is_platform_staff(request.user)


class PlacementSerializer(serializers.ModelSerializer):
    instance = serializers.IntegerField(source="instance_id")
    instance_name = serializers.CharField(source="instance", help_text="host/instance")
    instance_state = serializers.CharField(source="instance.state")
    endpoint = serializers.SerializerMethodField()
    served_version = serializers.IntegerField(source="served_version.number", allow_null=True, default=None)
    canary_version = serializers.IntegerField(
        source="canary_version.number",
        allow_null=True,
        default=None,
        help_text="During a rollout: the canary this instance also serves, as its agent reported.",
    )

    class Meta:
        model = DeploymentInstance
        fields = [
            "instance",
            "instance_name",
            "instance_state",
            "endpoint",
            "served_version",
            "canary_version",
            "state",
            "last_error",
            "retiring_reason",
            "updated_at",
        ]
        read_only_fields = fields

    @extend_schema_field(serializers.CharField(allow_null=True))
    def get_endpoint(self, placement: DeploymentInstance) -> str | None:
        """The instance's HTTP address, for platform staff; null for everyone else."""
        return placement.instance.endpoint_url() if _shows_instance_addresses(self) else None


class EventSerializer(serializers.ModelSerializer):
    # A CharField renders the instance as str(instance) ("host/instance"); an event of the whole deployment
    # has none (null), where "instance.__str__" would have rendered None's bound method.
    instance = serializers.CharField(allow_null=True, help_text="host/instance, or null")
    version = serializers.IntegerField(source="version.number", allow_null=True, default=None)

    class Meta:
        model = DeploymentEvent
        fields = ["id", "kind", "message", "instance", "version", "details", "created_at"]
        read_only_fields = fields


class GatewayEndpointsSerializer(serializers.Serializer):
    http = serializers.CharField(
        help_text="The inference gateway's KServe v2 HTTP/REST address (GATEWAY_PUBLIC_URL): tritonclient.http, curl."
    )
    grpc = serializers.CharField(
        help_text="The gateway's KServe v2 gRPC address (GATEWAY_PUBLIC_GRPC); it reaches only instances "
        "dedicated to the team."
    )
    infer_url = serializers.CharField(
        help_text="POST a KServe v2 inference request here with the header Authorization: Bearer <API token>."
    )


class DeploymentSerializer(serializers.ModelSerializer):
    model = serializers.CharField(source="model.slug")
    model_name = serializers.CharField(source="model.name")
    triton_model_name = serializers.CharField()
    active_version = serializers.IntegerField(source="active_version.number", allow_null=True, default=None)
    target_version = serializers.IntegerField(source="target_version.number", allow_null=True, default=None)
    endpoints = serializers.SerializerMethodField()
    instance_endpoints = serializers.SerializerMethodField()
    placements = PlacementSerializer(many=True)
    created_by = serializers.CharField(source="created_by.username", allow_null=True, default=None)
    pool = serializers.CharField(source="pool.name", allow_null=True, default=None)
    replicas_ready = serializers.SerializerMethodField()
    state = serializers.SerializerMethodField()
    waiting_for = serializers.SerializerMethodField()

    class Meta:
        model = Deployment
        fields = [
            "id",
            "model",
            "model_name",
            "triton_model_name",
            "state",
            "waiting_for",
            "active_version",
            "target_version",
            "last_error",
            "pinned",
            "replicas",
            "pool",
            "spread",
            "replicas_ready",
            "pending_reason",
            "min_replicas",
            "max_replicas",
            "target_in_flight",
            "scale_down_window_s",
            "idle_period_s",
            "asleep_since",
            "last_cold_start_ms",
            "endpoints",
            "instance_endpoints",
            "placements",
            "created_by",
            "created_at",
            "updated_at",
        ]
        read_only_fields = fields

    def to_representation(self, deployment: Deployment) -> dict:
        view = self.context.get("gateway_view")
        if view is not None:  # one look at the gateways for a whole list
            deployment.__dict__.setdefault("_gateway_view", view)
        return super().to_representation(deployment)

    @extend_schema_field(serializers.ChoiceField(choices=DeploymentState.choices))
    def get_state(self, deployment: Deployment) -> str:
        """SERVING once a call succeeds: its replicas serve the active version and every running gateway
        routes it to one of them. Until the gateway does, DEPLOYING (or SWITCHING while it routes another
        version) with ``waiting_for`` saying so."""
        return deployment.reported_state()

    def get_waiting_for(self, deployment: Deployment) -> str:
        """What a deployment whose replicas serve still waits for before a call succeeds (the gateway's
        route); empty when nothing."""
        return deployment.waiting_for()

    def get_replicas_ready(self, deployment: Deployment) -> int:
        """Replicas READY now (those being replaced not counted)."""
        return deployment.replicas_ready()

    @extend_schema_field(GatewayEndpointsSerializer(allow_null=True))
    def get_endpoints(self, deployment: Deployment) -> dict | None:
        """Where clients call the model: the inference gateway (HTTP and gRPC) and the model's inference URL;
        null once the deployment is undeployed."""
        return calling.gateway_endpoints(deployment) if deployment.is_live() else None

    @extend_schema_field(serializers.ListField(child=serializers.CharField(), allow_null=True))
    def get_instance_endpoints(self, deployment: Deployment) -> list[str] | None:
        """For platform staff: the HTTP address of each instance the model is placed on, READY ones first
        (the gateway forwards there; instances answer only the gateway and the platform). Null for everyone
        else."""
        return calling.instance_endpoints(deployment) if _shows_instance_addresses(self) else None


class DeploymentDetailSerializer(DeploymentSerializer):
    events = serializers.SerializerMethodField()

    class Meta(DeploymentSerializer.Meta):
        fields = [*DeploymentSerializer.Meta.fields, "events"]
        read_only_fields = fields

    @extend_schema_field(EventSerializer(many=True))
    def get_events(self, deployment: Deployment) -> list[dict]:
        """The newest events first (at most 100)."""
        events = deployment.events.select_related("instance__host", "version")[:EVENTS_SHOWN]
        return EventSerializer(events, many=True).data


class DeploymentCreateSerializer(serializers.Serializer):
    model = serializers.CharField(help_text="The model's slug.")
    version = serializers.IntegerField(min_value=1, help_text="A READY version number of the model.")
    instances = serializers.ListField(
        child=serializers.IntegerField(),
        allow_empty=False,
        required=False,
        help_text="Pinned placement: ids of the instances to serve on. Without it the scheduler places replicas.",
    )
    replicas = serializers.IntegerField(
        required=False, help_text="How many copies serve the model (default 1), each where it fits."
    )
    pool = serializers.CharField(
        required=False,
        allow_null=True,
        help_text="The pool to place replicas in; empty: any pool the team may use.",
    )
    spread = serializers.ChoiceField(
        choices=Spread.choices,
        default=Spread.HOST,
        help_text="host: at most one replica per host while the pool has enough hosts; none: pack.",
    )

    def validate(self, attrs):
        if attrs.get("instances") and ("replicas" in attrs or attrs.get("pool")):
            raise serializers.ValidationError(
                {"instances": ["Give instances (pinned) or replicas and a pool, not both."]}
            )
        return attrs


class AutoscalingSerializer(serializers.Serializer):
    """Only the fields given change; ``min_replicas: null`` turns autoscaling off. Bounds are checked by
    ``apps.deployments.autoscaling.check_settings`` (a 400 naming the field)."""

    min_replicas = serializers.IntegerField(
        required=False, allow_null=True, help_text="0: scale to zero when idle."
    )
    max_replicas = serializers.IntegerField(
        required=False, allow_null=True, help_text="Bounded by the team's quota."
    )
    target_in_flight = serializers.FloatField(
        required=False, help_text="In-flight requests per replica (default 4)."
    )
    scale_down_window_s = serializers.IntegerField(
        required=False, help_text="Stabilisation window (default 300)."
    )
    idle_period_s = serializers.IntegerField(
        required=False, help_text="Idle time before scaling to zero (900)."
    )


class SwitchSerializer(serializers.Serializer):
    version = serializers.IntegerField(min_value=1, help_text="The READY version number to switch to.")


class SnippetsSerializer(serializers.Serializer):
    endpoint = serializers.CharField(
        help_text="The inference gateway (GATEWAY_PUBLIC_URL): clients never call an instance."
    )
    endpoints = serializers.ListField(child=serializers.CharField())
    grpc_endpoint = serializers.CharField(
        help_text="The gateway's gRPC address (only to instances dedicated to the team)."
    )
    token_env = serializers.CharField(
        help_text="The environment variable the snippets read the API token from."
    )
    triton_model_name = serializers.CharField()
    version = serializers.IntegerField()
    infer_url = serializers.CharField()
    signature = serializers.JSONField()
    tritonclient = serializers.CharField(help_text="A runnable Python script (tritonclient.http).")
    tritonclient_grpc = serializers.CharField(
        help_text="The same script over gRPC (tritonclient.grpc) through the gateway's gRPC address."
    )
    curl = serializers.CharField(help_text="A runnable shell command with a KServe v2 JSON body.")


class PlaygroundRequestSerializer(serializers.Serializer):
    inputs = serializers.JSONField(
        required=False,
        help_text=(
            'Per input name: {"mode": "random"} or {"mode": "json", "data": [...]} (nested, or flat in the '
            "input's order). Missing inputs get random data. In a multipart request, send this as a JSON "
            "string and a file part named after an input (a .npy array) for mode file."
        ),
    )


class PlaygroundOutputSerializer(serializers.Serializer):
    name = serializers.CharField()
    datatype = serializers.CharField()
    shape = serializers.ListField(child=serializers.IntegerField())
    data = serializers.ListField(child=serializers.JSONField(), required=False)
    preview = serializers.ListField(child=serializers.JSONField(), required=False)
    truncated = serializers.BooleanField(required=False)
    top5 = serializers.ListField(
        child=inline_serializer(
            "TopClass", {"index": serializers.IntegerField(), "score": serializers.FloatField()}
        ),
        required=False,
    )


class PlaygroundResultSerializer(serializers.Serializer):
    instance = serializers.CharField()
    endpoint = serializers.CharField()
    version = serializers.IntegerField()
    latency_ms = serializers.FloatField(help_text="Round trip of the one inference as the platform saw it.")
    inputs = serializers.ListField(child=serializers.JSONField())
    outputs = PlaygroundOutputSerializer(many=True)


class InferenceFailed(APIException):
    status_code = status.HTTP_502_BAD_GATEWAY
    default_code = "inference_failed"
    default_detail = "The inference failed."


class NotServing(APIException):
    status_code = status.HTTP_409_CONFLICT
    default_code = "not_serving"
    default_detail = "The deployment has no READY instance."


ERROR = inline_serializer(
    "DeploymentError", {"error": serializers.CharField(), "message": serializers.CharField()}
)


class PlaygroundJSONParser(BaseParser):
    """JSON bodies up to PLAYGROUND_MAX_BYTES, read from the stream. DRF's JSONParser goes through
    ``request.body``, which Django caps at DATA_UPLOAD_MAX_MEMORY_SIZE (2.5 MiB) for every view alike, and
    one 224x224 RGB image is 150,528 numbers, about 3 MB of JSON. BodyLimitMiddleware has refused a larger
    declared body already; reading one byte more than the limit keeps this bounded on its own too."""

    media_type = "application/json"

    def parse(self, stream, media_type=None, parser_context=None):
        limit = settings.PLAYGROUND_MAX_BYTES
        raw = stream.read(limit + 1) if stream is not None else b""
        if len(raw) > limit:
            raise RequestTooLarge(too_large_message(limit, hint=PLAYGROUND_HINT))
        try:
            return json.loads(raw or b"{}")
        except ValueError as exc:
            raise ParseError(f"JSON parse error - {exc}") from None


def parse_playground_specs(data, files) -> dict[str, calling.InputSpec]:
    """``inputs`` (a dict, or its JSON text in a form) plus file parts named after inputs."""
    raw = data.get("inputs") if hasattr(data, "get") else None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValidationError({"inputs": [f"Not valid JSON: {exc.msg}."]}) from None
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ValidationError({"inputs": ['Give an object: {"<input name>": {"mode": ..., "data": ...}}.']})
    specs: dict[str, calling.InputSpec] = {}
    for name, spec in raw.items():
        if not isinstance(spec, dict):
            raise ValidationError(
                {f"inputs.{name}": ['Give {"mode": "random" | "json" | "file", "data": ...}.']}
            )
        specs[name] = calling.InputSpec(mode=str(spec.get("mode", "random")), data=spec.get("data"))
    for name, upload in files.items():
        specs.setdefault(name, calling.InputSpec(mode="file"))
        specs[name].mode, specs[name].upload = "file", upload
    return specs


class DeploymentViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TeamScopedViewSet):
    """A team's deployments, newest first: state, active/target version, placements per instance and the
    event history. POST (maintainer) deploys a READY version on instances; ``switch`` rolls out another
    version with zero failed requests; ``undeploy`` removes it. ``snippets`` and ``playground`` show how to
    call it."""

    queryset = Deployment.objects.select_related(
        "model__team", "active_version", "target_version", "created_by", "pool"
    ).prefetch_related(
        "placements__instance__host", "placements__served_version", "placements__canary_version"
    )
    serializer_class = DeploymentSerializer
    filterset_fields = ["state"]
    ordering_fields = ["created_at", "updated_at", "state"]
    action_requirements = {
        "switch": Action.CHANGE,
        "autoscaling": Action.CHANGE,
        "undeploy": Action.CHANGE,
        "snippets": Action.VIEW,
        "playground": Action.VIEW,
    }

    def get_serializer_class(self):
        return DeploymentDetailSerializer if self.action == "retrieve" else DeploymentSerializer

    def get_serializer_context(self) -> dict:
        return {**super().get_serializer_context(), "gateway_view": GatewayView.load()}

    def _detail(self, deployment: Deployment, code: int = status.HTTP_200_OK) -> Response:
        return Response(
            DeploymentDetailSerializer(
                self.get_queryset().get(pk=deployment.pk), context=self.get_serializer_context()
            ).data,
            status=code,
        )

    @extend_schema(
        request=DeploymentCreateSerializer, responses={201: DeploymentDetailSerializer, 400: ERROR}
    )
    def create(self, request, *args, **kwargs):
        serializer = DeploymentCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        model = RegisteredModel.objects.filter(team=self.team, slug=data["model"]).first()
        if model is None:
            raise ValidationError({"model": [f"Team {self.team.slug} has no model '{data['model']}'."]})
        version = model.versions.filter(number=data["version"]).first()
        if version is None:
            raise ValidationError({"version": [f"{model} has no version {data['version']}."]})
        if not data.get("instances"):
            deployment = services.deploy_version(
                actor=request.user,
                model=model,
                version=version,
                replicas=data.get("replicas", 1),
                pool=self._pool(data.get("pool")),
                spread=data["spread"],
            )
            return self._detail(deployment, status.HTTP_201_CREATED)
        wanted = list(dict.fromkeys(data["instances"]))
        usable = {
            i.pk: i
            for i in TritonInstance.objects.usable_by_team(self.team)
            .filter(pk__in=wanted)
            .select_related("host")
        }
        missing = [pk for pk in wanted if pk not in usable]
        if missing:
            raise ValidationError(
                {
                    "instances": [
                        f"No instance with id {', '.join(map(str, missing))} that this team may deploy on."
                    ]
                }
            )
        deployment = services.deploy_version(
            actor=request.user, model=model, version=version, instances=[usable[pk] for pk in wanted]
        )
        return self._detail(deployment, status.HTTP_201_CREATED)

    def _pool(self, name: str | None) -> Pool | None:
        """The named pool if this team may use it; unknown and another team's pools read alike (a 400)."""
        return scheduler.usable_pool(self.team, name)

    @extend_schema(request=SwitchSerializer, responses={200: DeploymentDetailSerializer, 400: ERROR})
    @action(detail=True, methods=["post"])
    def switch(self, request, team_slug=None, pk=None):
        deployment = self.get_object()
        serializer = SwitchSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        number = serializer.validated_data["version"]
        version = ModelVersion.objects.filter(model=deployment.model, number=number).first()
        if version is None:
            raise ValidationError({"version": [f"{deployment.model} has no version {number}."]})
        services.switch_version(actor=request.user, deployment=deployment, version=version)
        return self._detail(deployment)

    @extend_schema(request=AutoscalingSerializer, responses={200: DeploymentDetailSerializer, 400: ERROR})
    @action(detail=True, methods=["post"])
    def autoscaling(self, request, team_slug=None, pk=None):
        deployment = self.get_object()
        serializer = AutoscalingSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        autoscaling.configure(
            actor=request.user, deployment=deployment, values=dict(serializer.validated_data)
        )
        return self._detail(deployment)

    @extend_schema(request=None, responses={200: DeploymentDetailSerializer})
    @action(detail=True, methods=["post"])
    def undeploy(self, request, team_slug=None, pk=None):
        deployment = services.undeploy(actor=request.user, deployment=self.get_object())
        return self._detail(deployment)

    @extend_schema(responses={200: SnippetsSerializer, 400: ERROR})
    @action(detail=True, methods=["get"])
    def snippets(self, request, team_slug=None, pk=None):
        return Response(SnippetsSerializer(calling.snippets(self.get_object())).data)

    @extend_schema(
        request={
            "application/json": PlaygroundRequestSerializer,
            "multipart/form-data": {
                "type": "object",
                "properties": {
                    "inputs": {"type": "string", "description": "The JSON object of the JSON body, as text."}
                },
                "additionalProperties": {"type": "string", "format": "binary"},
            },
        },
        responses={200: PlaygroundResultSerializer, 400: ERROR, 409: ERROR, 413: ERROR, 502: ERROR},
    )
    @limit_body("PLAYGROUND_MAX_BYTES", PLAYGROUND_HINT)
    @action(detail=True, methods=["post"], parser_classes=[PlaygroundJSONParser, MultiPartParser, FormParser])
    def playground(self, request, team_slug=None, pk=None):
        """Run one inference on the first READY instance: random, JSON or .npy inputs; outputs with the
        top-5 classes of a classifier-shaped output, and the latency."""
        deployment = self.get_object()
        specs = parse_playground_specs(request.data, request.FILES)
        try:
            result = calling.run_playground(deployment, specs)
        except calling.PlaygroundUnavailable as exc:
            if calling.ready_placement(deployment) is None:
                raise NotServing(str(exc)) from None
            raise InferenceFailed(str(exc)) from None
        return Response(result.as_dict())
