"""REST API of the fleet: hosts with their NPU inventory and Triton instances, and instance control.

Hosts are platform infrastructure, not team rows, so they live at ``/api/v1/hosts/`` rather than under a
team. Visibility is ``Host.objects.for_user``: shared hosts and hosts dedicated to one of the caller's teams
(platform staff see all); another team's dedicated host is a 404. Starting, stopping and restarting an
instance is for platform staff on shared hosts, and also for the owning team's maintainers and owners on a
dedicated host; anyone else who can see the instance gets a 403 that says so. Staff add hosts (each gets a
one-time join token for its agent), change their labels (``PATCH``: pools follow), revoke them and create
instances.
"""

from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import Q
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema, extend_schema_field, inline_serializer
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied
from rest_framework.response import Response

from apps.fleet import pools, services
from apps.fleet.models import (
    Device,
    ExecutorKind,
    Host,
    Pool,
    TritonInstance,
    check_labels,
    host_name_validator,
    is_platform_staff,
)
from apps.teams.models import Action, Team, team_ids_for


def require_staff(user, what: str) -> None:
    if not is_platform_staff(user):
        raise PermissionDenied(f"Only platform staff may {what}.")


def require_operator(user, instance: TritonInstance) -> None:
    if not instance.host.can_be_operated_by(user):
        who = (
            "platform staff"
            if instance.host.team_id is None
            else f"platform staff and the maintainers and owners of team '{instance.host.team.slug}'"
        )
        raise PermissionDenied(
            f"Only {who} may start, stop or restart the instances of {instance.host.name}."
        )


class DeviceSerializer(serializers.ModelSerializer):
    class Meta:
        model = Device
        fields = [
            "npu_id",
            "chip_id",
            "logical_id",
            "name",
            "soc_version",
            "health",
            "aicore_percent",
            "hbm_used_mb",
            "hbm_total_mb",
            "memory_used_mb",
            "memory_total_mb",
            "power_w",
            "temperature_c",
            "updated_at",
        ]
        read_only_fields = fields


class EndpointsSerializer(serializers.Serializer):
    http = serializers.CharField(
        source="endpoint_url", help_text="KServe v2 HTTP/REST (tritonclient.http, curl)."
    )
    grpc = serializers.CharField(source="grpc_endpoint", help_text="KServe v2 gRPC (tritonclient.grpc).")
    metrics = serializers.CharField(source="metrics_url", help_text="Prometheus metrics.")


class InstanceSummarySerializer(serializers.ModelSerializer):
    class Meta:
        model = TritonInstance
        fields = ["id", "name", "state", "desired_state", "http_port", "executor"]
        read_only_fields = fields


class InstanceSerializer(serializers.ModelSerializer):
    host = serializers.CharField(source="host.name", help_text="The host's name.")
    endpoints = EndpointsSerializer(source="*", read_only=True)
    can_operate = serializers.SerializerMethodField()

    class Meta:
        model = TritonInstance
        fields = [
            "id",
            "host",
            "name",
            "http_port",
            "grpc_port",
            "metrics_port",
            "device_ids",
            "executor",
            "latency_summaries",
            "desired_state",
            "state",
            "pid",
            "restarts",
            "last_error",
            "state_changed_at",
            "endpoints",
            "can_operate",
            "created_at",
        ]
        read_only_fields = [
            "id",
            "desired_state",
            "state",
            "pid",
            "restarts",
            "last_error",
            "state_changed_at",
            "created_at",
        ]

    def get_can_operate(self, instance: TritonInstance) -> bool:
        """Whether the caller may start, stop and restart this instance."""
        request = self.context.get("request")
        return bool(request) and instance.host.can_be_operated_by(request.user)


class InstanceDeploymentSerializer(serializers.Serializer):
    team = serializers.CharField(source="deployment.team.slug")
    deployment = serializers.IntegerField(source="deployment_id")
    triton_model_name = serializers.CharField(source="deployment.triton_model_name")
    served_version = serializers.IntegerField(source="served_version.number", allow_null=True, default=None)
    state = serializers.CharField()
    last_error = serializers.CharField()


class InstanceDetailSerializer(InstanceSerializer):
    log_tail = serializers.SerializerMethodField()
    deployments = serializers.SerializerMethodField()

    class Meta(InstanceSerializer.Meta):
        fields = [*InstanceSerializer.Meta.fields, "crash_times", "log_tail", "deployments"]
        read_only_fields = fields

    @extend_schema_field(serializers.CharField(allow_null=True))
    def get_log_tail(self, instance: TritonInstance) -> str | None:
        """The server's last output lines: platform staff only (null for others). A shared instance's log
        names every team's models, their load errors and host paths."""
        request = self.context.get("request")
        return instance.log_tail if request and is_platform_staff(request.user) else None

    @extend_schema_field(InstanceDeploymentSerializer(many=True))
    def get_deployments(self, instance: TritonInstance) -> list[dict]:
        """The live deployments of the caller's teams on this instance (other teams' stay invisible)."""
        return InstanceDeploymentSerializer(
            visible_placements(self.context["request"].user, instance), many=True
        ).data


def visible_placements(user, instance: TritonInstance) -> list:
    """The caller's teams' live placements on the instance. Through the reverse relation: the fleet sits below
    the deployments app and does not import it."""
    placements = instance.placements.filter(
        deployment__team__in=team_ids_for(user, Action.VIEW)
    ).select_related("deployment__model__team", "deployment__team", "served_version")
    return [placement for placement in placements if placement.deployment.is_live()]


class InstanceCreateSerializer(serializers.Serializer):
    host = serializers.CharField(help_text="Name of the host the instance runs on.")
    name = serializers.CharField(max_length=63, validators=[host_name_validator])
    http_port = serializers.IntegerField(min_value=1, max_value=65535)
    grpc_port = serializers.IntegerField(min_value=1, max_value=65535)
    metrics_port = serializers.IntegerField(min_value=1, max_value=65535)
    device_ids = serializers.ListField(child=serializers.IntegerField(min_value=0), required=False)
    executor = serializers.ChoiceField(choices=ExecutorKind.choices, default=ExecutorKind.CPU)
    latency_summaries = serializers.BooleanField(default=False)


class HostSerializer(serializers.ModelSerializer):
    team = serializers.SlugRelatedField(
        slug_field="slug",
        queryset=Team.objects.all(),
        allow_null=True,
        required=False,
        help_text="Empty: shared by all teams; a team slug: dedicated to that team.",
    )
    status = serializers.CharField(read_only=True, help_text="online when the agent's heartbeat is recent.")
    heartbeat_age_seconds = serializers.FloatField(read_only=True, allow_null=True)
    identity = serializers.CharField(
        read_only=True, help_text="joined, awaiting join, revoked or no credential (the agent's identity)."
    )
    device_count = serializers.SerializerMethodField()
    gateway_unreachable = serializers.SerializerMethodField(
        help_text="Instances of this host a running gateway's health checks cannot reach (a partition between "
        "gateway and host while the agent may still be heard): gateway, instance, reason, since. The gateway "
        "has taken them out of rotation; replicas are not moved for it (drain the host to move them)."
    )
    instances = InstanceSummarySerializer(many=True, read_only=True)
    pool = serializers.CharField(source="pool.name", read_only=True, allow_null=True, default=None)
    agent_protocol = serializers.IntegerField(
        read_only=True,
        allow_null=True,
        help_text="The agent protocol version the host's agent last spoke (0: an agent from before the "
        "X-Agent-Protocol header); null until its agent calls.",
    )
    agent_protocol_served = serializers.BooleanField(
        read_only=True,
        allow_null=True,
        help_text="Whether this platform serves that version; false: the agent is refused until it is upgraded "
        "(or, for a newer agent, the platform).",
    )

    class Meta:
        model = Host
        fields = [
            "name",
            "address",
            "team",
            "labels",
            "pool",
            "cordoned_at",
            "draining_at",
            "status",
            "last_heartbeat_at",
            "heartbeat_age_seconds",
            "identity",
            "gateway_unreachable",
            "joined_at",
            "revoked_at",
            "npu_driver_version",
            "agent_protocol",
            "agent_protocol_served",
            "facts",
            "device_count",
            "instances",
            "created_at",
        ]
        read_only_fields = [
            "cordoned_at",
            "draining_at",
            "last_heartbeat_at",
            "npu_driver_version",
            "facts",
            "created_at",
            "joined_at",
            "revoked_at",
        ]

    def get_gateway_unreachable(self, host: Host) -> list[dict]:
        return [{**entry, "since": entry["since"].isoformat()} for entry in host.unreachable_from_gateways()]

    def get_device_count(self, host: Host) -> int:
        return len(host.devices.all())

    def validate_name(self, value: str) -> str:
        if Host.objects.filter(name=value).exists():
            raise serializers.ValidationError(f"A host named '{value}' already exists.")
        return value

    def validate_labels(self, value) -> dict:
        return checked_labels(value)


def checked_labels(value) -> dict:
    try:
        return check_labels(value)
    except DjangoValidationError as exc:
        raise serializers.ValidationError(exc.message_dict["labels"]) from exc


class HostLabelsSerializer(serializers.Serializer):
    """What staff may change on a host after it joined: its labels (``pool=<name>`` makes it a member of that
    pool). The whole set is replaced."""

    labels = serializers.JSONField(
        help_text='Key/value strings, e.g. {"pool": "ascend", "rack": "r12"}; keys of lowercase letters, '
        "digits and . _ / -, values of letters, digits and . _ - (1-63 characters)."
    )

    def validate(self, attrs):
        unknown = (
            sorted(set(self.initial_data) - set(self.fields)) if isinstance(self.initial_data, dict) else []
        )
        if unknown:
            raise serializers.ValidationError(
                {name: ["Only labels may be changed here."] for name in unknown}
            )
        return attrs

    def validate_labels(self, value) -> dict:
        return checked_labels(value)


class HostDetailSerializer(HostSerializer):
    devices = DeviceSerializer(many=True, read_only=True)
    instances = InstanceSerializer(many=True, read_only=True)

    class Meta(HostSerializer.Meta):
        fields = [*HostSerializer.Meta.fields, "devices"]


class HostCreatedSerializer(HostSerializer):
    join_token = serializers.CharField(read_only=True, help_text="One-time: give it to the host's agent.")

    class Meta(HostSerializer.Meta):
        fields = [*HostSerializer.Meta.fields, "join_token"]


class JoinTokenSerializer(serializers.Serializer):
    host = serializers.CharField()
    join_token = serializers.CharField()


class HostViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Hosts the caller's teams may use, with heartbeat status, NPU inventory and instances.
    POST (platform staff) adds a host and answers its one-time join token; join-token and revoke (staff)."""

    serializer_class = HostSerializer
    lookup_field = "name"
    lookup_value_regex = r"[a-z0-9-]+"
    filterset_fields = ["address"]
    ordering_fields = ["name", "last_heartbeat_at", "created_at"]

    def get_queryset(self):
        return (
            Host.objects.for_user(self.request.user, Action.VIEW)
            .select_related("team")
            .prefetch_related("devices", "instances__host__team")
            .order_by("name")
        )

    def get_serializer_class(self):
        return HostDetailSerializer if self.action == "retrieve" else HostSerializer

    @extend_schema(responses={201: HostCreatedSerializer})
    def create(self, request, *args, **kwargs):
        """Staff add a host; the answer carries its one-time join token (shown once, never again)."""
        require_staff(request.user, "add hosts")
        serializer = HostSerializer(data=request.data, context={"request": request})
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        host, token = services.create_host(
            actor=request.user,
            name=data["name"],
            address=data["address"],
            labels=data.get("labels"),
            team=data.get("team"),
        )
        host = self.get_queryset().get(pk=host.pk)
        body = HostSerializer(host, context={"request": request}).data
        return Response({**body, "join_token": token}, status=status.HTTP_201_CREATED)

    @extend_schema(request=HostLabelsSerializer, responses={200: HostSerializer})
    def partial_update(self, request, *args, **kwargs):
        """Staff change the host's labels; it joins or leaves pools by its ``pool`` label (the instances a
        pool's template made for it are drained and removed when it leaves). Audited."""
        host = self.get_object()
        require_staff(request.user, "change a host's labels")
        serializer = HostLabelsSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        host = pools.set_labels(actor=request.user, host=host, labels=serializer.validated_data["labels"])
        return Response(
            HostSerializer(self.get_queryset().get(pk=host.pk), context={"request": request}).data
        )

    @extend_schema(request=None, responses={200: JoinTokenSerializer})
    @action(detail=True, methods=["post"], url_path="join-token")
    def join_token(self, request, name=None):
        """A new one-time join token (staff): the agent joins with it and gets a new credential."""
        require_staff(request.user, "issue join tokens")
        host = self.get_object()
        token = services.issue_join_token(actor=request.user, host=host)
        return Response({"host": host.name, "join_token": token})

    @extend_schema(request=None, responses={200: HostSerializer})
    @action(detail=True, methods=["post"])
    def revoke(self, request, name=None):
        """Revoke the host's credential (staff): its agent's calls get 401 at once and it gets no more work."""
        require_staff(request.user, "revoke hosts")
        host = services.revoke_host(actor=request.user, host=self.get_object())
        return Response(
            HostSerializer(self.get_queryset().get(pk=host.pk), context={"request": request}).data
        )

    def _cordon(self, request, *, cordoned: bool, drain: bool = False) -> Response:
        require_staff(request.user, "cordon, drain or uncordon hosts")
        host = pools.set_cordon(actor=request.user, host=self.get_object(), cordoned=cordoned, drain=drain)
        return Response(
            HostSerializer(self.get_queryset().get(pk=host.pk), context={"request": request}).data
        )

    @extend_schema(request=None, responses={200: HostSerializer})
    @action(detail=True, methods=["post"])
    def cordon(self, request, name=None):
        """No new replicas on this host (staff); those it serves stay."""
        return self._cordon(request, cordoned=True)

    @extend_schema(request=None, responses={200: HostSerializer})
    @action(detail=True, methods=["post"])
    def drain(self, request, name=None):
        """Cordon, and move its replicas elsewhere one at a time, each new one READY before the old unloads."""
        return self._cordon(request, cordoned=True, drain=True)

    @extend_schema(request=None, responses={200: HostSerializer})
    @action(detail=True, methods=["post"])
    def uncordon(self, request, name=None):
        return self._cordon(request, cordoned=False)


class PoolSerializer(serializers.ModelSerializer):
    team = serializers.SlugRelatedField(
        slug_field="slug", queryset=Team.objects.all(), allow_null=True, required=False,
        help_text="Empty: shared by all teams; a team slug: dedicated to that team.",
    )  # fmt: skip
    hosts = serializers.SlugRelatedField(slug_field="name", many=True, read_only=True)

    class Meta:
        model = Pool
        fields = ["name", "team", "executor", "devices_per_instance", "memory_budget_mb", "hbm_reserve_mb",
                  "placement_policy", "hosts", "created_at"]  # fmt: skip
        read_only_fields = ["hosts", "created_at"]
        extra_kwargs = {"name": {"validators": [host_name_validator]}}


class PoolUpdateSerializer(serializers.ModelSerializer):
    """What staff may change on a pool: its placement policy and its instance template (the platform then
    adds, resizes or removes the member hosts' template instances)."""

    class Meta:
        model = Pool
        fields = ["devices_per_instance", "memory_budget_mb", "hbm_reserve_mb", "placement_policy"]


class PoolViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Pools the caller's teams may use (staff: all) with their hosts. POST (staff) creates one; hosts
    labelled ``pool=<name>`` join it. PATCH (staff) changes its placement policy or template."""

    serializer_class = PoolSerializer
    lookup_field = "name"
    lookup_value_regex = r"[a-z0-9-]+"

    def get_queryset(self):
        rows = Pool.objects.prefetch_related("hosts").select_related("team").order_by("name")
        if is_platform_staff(self.request.user):
            return rows
        return rows.filter(Q(team__isnull=True) | Q(team__in=team_ids_for(self.request.user, Action.VIEW)))

    def create(self, request, *args, **kwargs):
        require_staff(request.user, "create pools")
        serializer = PoolSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        pool = pools.create_pool(actor=request.user, **serializer.validated_data)
        return Response(
            PoolSerializer(self.get_queryset().get(pk=pool.pk)).data, status=status.HTTP_201_CREATED
        )

    @extend_schema(request=PoolUpdateSerializer, responses={200: PoolSerializer})
    def partial_update(self, request, *args, **kwargs):
        pool = self.get_object()
        require_staff(request.user, "change pools")
        serializer = PoolUpdateSerializer(data=request.data, partial=True)
        serializer.is_valid(raise_exception=True)
        pool = pools.update_pool(actor=request.user, pool=pool, **serializer.validated_data)
        return Response(PoolSerializer(self.get_queryset().get(pk=pool.pk)).data)


ERROR = inline_serializer(
    "InstanceActionError", {"error": serializers.CharField(), "message": serializers.CharField()}
)


class InstanceViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Triton + GE instances on the hosts the caller may see. The detail has the log tail and the caller's
    deployments on it. POST start / stop / restart: staff on shared hosts, the owning team's maintainers
    and owners on dedicated ones; the host's agent acts within a second. POST (staff) creates an instance."""

    serializer_class = InstanceSerializer
    filterset_fields = ["state", "executor"]
    ordering_fields = ["name", "state", "created_at"]

    def get_queryset(self):
        queryset = (
            TritonInstance.objects.for_user(self.request.user, Action.VIEW)
            .select_related("host__team")
            .order_by("host__name", "name")
        )
        host = self.request.query_params.get("host")
        return queryset.filter(host__name=host) if host else queryset

    def get_serializer_class(self):
        return InstanceDetailSerializer if self.action == "retrieve" else InstanceSerializer

    @extend_schema(request=InstanceCreateSerializer, responses={201: InstanceDetailSerializer})
    def create(self, request, *args, **kwargs):
        require_staff(request.user, "create instances")
        serializer = InstanceCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = dict(serializer.validated_data)
        host = get_object_or_404(Host.objects.all(), name=data.pop("host"))
        instance = services.create_instance(actor=request.user, host=host, **data)
        return Response(
            InstanceDetailSerializer(instance, context={"request": request}).data,
            status=status.HTTP_201_CREATED,
        )

    def _act(self, request, verb: str) -> Response:
        instance = self.get_object()
        require_operator(request.user, instance)
        instance = services.request_instance_state(actor=request.user, instance=instance, action=verb)
        return Response(InstanceDetailSerializer(instance, context={"request": request}).data)

    @extend_schema(request=None, responses={200: InstanceDetailSerializer, 403: ERROR})
    @action(detail=True, methods=["post"])
    def start(self, request, pk=None):
        """Run the instance (also lifts a quarantine)."""
        return self._act(request, "start")

    @extend_schema(request=None, responses={200: InstanceDetailSerializer, 403: ERROR})
    @action(detail=True, methods=["post"])
    def stop(self, request, pk=None):
        """Stop the instance gracefully: in-flight requests finish."""
        return self._act(request, "stop")

    @extend_schema(request=None, responses={200: InstanceDetailSerializer, 403: ERROR})
    @action(detail=True, methods=["post"])
    def restart(self, request, pk=None):
        """Restart the tritonserver; the agent loads its deployed models again."""
        return self._act(request, "restart")
