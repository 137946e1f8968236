"""Inference hosts, their NPU devices and the Triton + GE instances that run on them.

Hosts are platform infrastructure. A host is either shared (``team`` empty: every team may deploy on it) or
dedicated to one team; ``HostQuerySet.for_user`` gives each user the hosts their teams may use, so another
team's dedicated host is a 404.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from datetime import timedelta

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import RegexValidator
from django.db import models
from django.db.models import Q
from django.utils import timezone

from apps.core.credentials import HOST_CREDENTIAL_SCHEME, HOST_JOIN_TOKEN_SCHEME
from apps.teams.models import Action, TeamScopedQuerySet, team_ids_for
from backend_ge.runtime import API_KEY_HEADER, GRPC_API_KEY_HEADER
from hostagent import protocol

host_name_validator = RegexValidator(
    r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$",
    "Use lowercase letters, digits and hyphens (it names the instances' users and directories).",
)

# Host labels (``pool=<name>`` makes a host a member of that pool): a small allow-list of key and value
# syntax, so a label can always be shown, matched and written into a config without escaping.
LABEL_KEY = re.compile(r"^[a-z0-9](?:[a-z0-9._/-]{0,61}[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")
MAX_LABELS = 32


def check_labels(labels) -> dict[str, str]:
    """Host labels as staff may set them: an object of at most ``MAX_LABELS`` string pairs, keys of lowercase
    letters, digits and ``. _ / -``, values of letters, digits and ``. _ -`` (1-63 characters, starting and
    ending with a letter or digit). Raises a ValidationError naming ``labels`` otherwise."""

    def refuse(message: str):
        return ValidationError({"labels": [message]})

    if labels is None:
        return {}
    if not isinstance(labels, dict):
        raise refuse('Labels are an object of key/value strings, e.g. {"pool": "ascend"}.')
    if len(labels) > MAX_LABELS:
        raise refuse(f"At most {MAX_LABELS} labels (got {len(labels)}).")
    for key, value in labels.items():
        shown = repr(key)[:70]
        if not isinstance(key, str) or not LABEL_KEY.match(key):
            raise refuse(
                f"Label key {shown} is not allowed: 1-63 lowercase letters, digits, '.', '_', '/' or '-', "
                "starting and ending with a letter or digit."
            )
        if not isinstance(value, str) or not LABEL_VALUE.match(value):
            raise refuse(
                f"The value of label '{key}' is not allowed: a string of 1-63 letters, digits, '.', '_' or "
                "'-', starting and ending with a letter or digit."
            )
    return dict(labels)


HEARTBEAT_INTERVAL = timedelta(seconds=10)
# Three missed heartbeats: long enough to ride out a busy agent, short enough to notice a dead host.
OFFLINE_AFTER = 3 * HEARTBEAT_INTERVAL
# A join token is for the operator who sets the host up now, not a standing secret.
JOIN_TOKEN_TTL = timedelta(hours=24)
JOIN_TOKEN_SCHEME = HOST_JOIN_TOKEN_SCHEME
CREDENTIAL_SCHEME = HOST_CREDENTIAL_SCHEME


def new_host_secret(scheme: str) -> str:
    """``<scheme>_<secret>``: the scheme tells an operator what a leaked string is."""
    return f"{scheme}_{secrets.token_urlsafe(32)}"


def hash_host_secret(raw: str) -> str:
    """Only this hash is stored: a copy of the database does not let anyone act as a host."""
    return hashlib.sha256(raw.encode()).hexdigest()


def is_platform_staff(user) -> bool:
    """Platform operators (``is_staff``) run the fleet. Only a signed-in session carries that power: an API
    token is scoped to one team and acts with its creator's role there, nothing more."""
    return bool(
        user is not None
        and getattr(user, "is_authenticated", False)
        and user.is_staff
        and getattr(user, "api_token", None) is None
    )


class ExecutorKind(models.TextChoices):
    CPU = "cpu", "CPU (onnxruntime)"
    NPU = "npu", "NPU (pyACL)"


class PlacementPolicy(models.TextChoices):
    """Which instance that fits a replica the scheduler prefers."""

    SPREAD = "spread", "spread (least loaded first)"
    BINPACK = "binpack", "binpack (most loaded that fits first)"


class PoolQuerySet(models.QuerySet):
    def usable_by_team(self, team):
        """Shared pools and the team's dedicated ones."""
        return self.filter(Q(team__isnull=True) | Q(team=team))


class Pool(models.Model):
    """A group of hosts the scheduler places replicas in, and the template of their instances.

    A host joins when its labels hold ``pool=<name>`` (staff set them; the host page and the API show the
    pool). When a member host's agent reports its devices, the platform creates the host's instances from
    the template: one CPU instance with ``memory_budget_mb`` of capacity, or one NPU instance per group of
    ``devices_per_instance`` chips whose capacity is their HBM minus ``hbm_reserve_mb`` per chip. Their ports
    come from the range the agent reports it owns. A pool with ``team`` set is that team's alone.
    """

    name = models.CharField(max_length=63, unique=True, validators=[host_name_validator])
    team = models.ForeignKey(
        "teams.Team",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="pools",
        help_text="Empty: shared by all teams. Set: dedicated to this team.",
    )
    executor = models.CharField(max_length=10, choices=ExecutorKind.choices, default=ExecutorKind.CPU)
    devices_per_instance = models.PositiveSmallIntegerField(
        default=1, help_text="NPU pools: chips per instance (1: one instance per NPU)."
    )
    memory_budget_mb = models.PositiveIntegerField(
        default=4096, help_text="CPU pools: the memory one instance's models may use."
    )
    hbm_reserve_mb = models.PositiveIntegerField(
        default=1024, help_text="NPU pools: HBM per chip kept free for the runtime."
    )
    placement_policy = models.CharField(
        max_length=10,
        choices=PlacementPolicy.choices,
        default=PlacementPolicy.SPREAD,
        help_text="spread: a replica goes to the least loaded instance that fits (load spread, headroom "
        "everywhere); binpack: to the most loaded one that still fits (fewer devices busy, whole devices free "
        "for big models).",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    objects = PoolQuerySet.as_manager()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class HostQuerySet(TeamScopedQuerySet):
    def for_user(self, user, action: str = Action.VIEW):
        """Shared hosts and hosts dedicated to the user's teams; platform staff see every host."""
        if is_platform_staff(user):
            return self.all()
        return self.filter(Q(team__isnull=True) | Q(team__in=team_ids_for(user, action)))

    def usable_by_team(self, team):
        """Hosts a team may deploy on: shared ones and the team's own."""
        return self.filter(Q(team__isnull=True) | Q(team=team))


class Host(models.Model):
    """A machine that runs a host agent (``python -m hostagent --platform URL``).

    Identity: staff create the host and get a one-time join token; the agent exchanges it for a per-host
    credential (only its sha256 is kept here) and calls the agent API (``/agent/v1/``) with it.
    State machine: CREATED (join token pending) -> JOINED (credential issued) -> REVOKED (credential
    refused); a new join token moves a revoked host back to JOINED once its agent joins again.
    ``desired_generation`` goes up with every change of what the host must do; agents poll it cheaply.
    """

    name = models.CharField(max_length=63, unique=True, validators=[host_name_validator])
    address = models.CharField(
        max_length=255, help_text="Address clients and the platform reach the instances at."
    )
    team = models.ForeignKey(
        "teams.Team",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="hosts",
        help_text="Empty: shared by all teams. Set: dedicated to this team.",
    )
    labels = models.JSONField(default=dict, blank=True)
    facts = models.JSONField(default=dict, blank=True, help_text="CPU count, memory, OS, agent version.")
    npu_driver_version = models.CharField(max_length=50, blank=True)
    # The agent protocol its agent last spoke (``X-Agent-Protocol``; 0: an agent from before the header),
    # served or refused. Empty: no agent has called since the platform started recording it.
    agent_protocol = models.PositiveSmallIntegerField(null=True, blank=True, editable=False)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    # Since when the platform has heard this host without a break (a gap of more than half the scheduler's
    # grace starts a new run): how the scheduler tells a host that went silent from a platform that was not
    # listening (``apps.deployments.lost.listening_since``). Empty: since before anyone counted.
    heard_since = models.DateTimeField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    credential_hash = models.CharField(max_length=64, blank=True, db_index=True, editable=False)
    join_token_hash = models.CharField(max_length=64, blank=True, db_index=True, editable=False)
    join_token_expires_at = models.DateTimeField(null=True, blank=True, editable=False)
    joined_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    desired_generation = models.PositiveBigIntegerField(default=1, editable=False)
    pool = models.ForeignKey(
        Pool, null=True, blank=True, on_delete=models.SET_NULL, related_name="hosts", editable=False
    )
    # Ports the agent owns for its instances (it reports the range; the platform takes ports from it).
    port_range_first = models.PositiveIntegerField(null=True, blank=True, editable=False)
    port_range_last = models.PositiveIntegerField(null=True, blank=True, editable=False)
    cordoned_at = models.DateTimeField(null=True, blank=True, help_text="Set: no new replicas here.")
    draining_at = models.DateTimeField(
        null=True, blank=True, help_text="Set: its replicas move elsewhere, one at a time."
    )

    objects = HostQuerySet.as_manager()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def identity(self) -> str:
        """revoked | joined | awaiting join (a join token was issued and not used yet) | no credential."""
        if self.revoked_at is not None:
            return "revoked"
        if self.credential_hash:
            return "joined"
        return "awaiting join" if self.join_token_hash else "no credential"

    def is_online(self, now=None) -> bool:
        if self.last_heartbeat_at is None:
            return False
        return (now or timezone.now()) - self.last_heartbeat_at <= OFFLINE_AFTER

    @property
    def status(self) -> str:
        return "online" if self.is_online() else "offline"

    @property
    def agent_protocol_served(self) -> bool | None:
        """Whether this platform serves the agent protocol the host's agent last spoke (None: not known)."""
        if self.agent_protocol is None:
            return None
        return protocol.serves_agent_protocol(self.agent_protocol)

    @property
    def agent_protocol_advice(self) -> str:
        """What to do about an agent this platform refuses (empty while it is served, or not known)."""
        if self.agent_protocol_served is not False:
            return ""
        side = "host agent" if self.agent_protocol < protocol.MIN_AGENT_PROTOCOL_VERSION else "platform"
        return f"refused: upgrade the {side} (this platform accepts {protocol.accepted_agent_protocols()})"

    def can_be_operated_by(self, user) -> bool:
        """Who may start, stop and restart this host's instances: staff everywhere; on a host dedicated to
        a team, also that team's maintainers and owners."""
        if is_platform_staff(user):
            return True
        return self.team_id is not None and self.team_id in team_ids_for(user, Action.CHANGE)

    def is_schedulable(self, grace: timedelta, now=None) -> bool:
        """New replicas may go here: joined, not revoked or cordoned, heard from within ``grace``."""
        return (
            self.revoked_at is None
            and self.cordoned_at is None
            and self.last_heartbeat_at is not None
            and (now or timezone.now()) - self.last_heartbeat_at <= grace
        )

    def unreachable_from_gateways(self) -> list[dict]:
        """What the running gateways cannot reach on this host (``GatewayReachability``): one entry per gateway
        and instance, with the reason and since when. Empty: every gateway reaches it (or none runs)."""
        rows = GatewayReachability.current().filter(instance__host=self).select_related("instance")
        return [
            {"gateway": r.gateway, "instance": r.instance.name, "reason": r.reason, "since": r.since}
            for r in rows
        ]

    def heartbeat_age_seconds(self) -> float | None:
        if self.last_heartbeat_at is None:
            return None
        return (timezone.now() - self.last_heartbeat_at).total_seconds()


class DeviceHealth(models.TextChoices):
    OK = "OK", "OK"
    WARNING = "Warning", "Warning"
    ALARM = "Alarm", "Alarm"
    CRITICAL = "Critical", "Critical"
    UNKNOWN = "Unknown", "Unknown"


class Device(models.Model):
    """One NPU chip of a host, as the agent's last `npu-smi info` reported it."""

    host = models.ForeignKey(Host, on_delete=models.CASCADE, related_name="devices")
    npu_id = models.PositiveIntegerField()
    chip_id = models.PositiveIntegerField(default=0)
    logical_id = models.PositiveIntegerField(null=True, blank=True, help_text="Device id the runtime uses.")
    name = models.CharField(max_length=50)
    soc_version = models.CharField(max_length=50, blank=True)
    health = models.CharField(max_length=20, choices=DeviceHealth.choices, default=DeviceHealth.UNKNOWN)
    aicore_percent = models.FloatField(null=True, blank=True)
    memory_used_mb = models.IntegerField(null=True, blank=True)
    memory_total_mb = models.IntegerField(null=True, blank=True)
    hbm_used_mb = models.IntegerField(null=True, blank=True)
    hbm_total_mb = models.IntegerField(null=True, blank=True)
    power_w = models.FloatField(null=True, blank=True)
    temperature_c = models.FloatField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["host", "npu_id", "chip_id"]
        constraints = [
            models.UniqueConstraint(fields=["host", "npu_id", "chip_id"], name="unique_device_per_host")
        ]

    def __str__(self) -> str:
        return f"{self.host.name}/npu{self.npu_id}.{self.chip_id} ({self.name})"


class InstanceState(models.TextChoices):
    """The values are the agent protocol's (``hostagent.protocol.InstanceState``): the agent reports them."""

    STOPPED = protocol.InstanceState.STOPPED.value, "Stopped"
    STARTING = protocol.InstanceState.STARTING.value, "Starting"
    READY = protocol.InstanceState.READY.value, "Ready"
    FAILED = protocol.InstanceState.FAILED.value, "Failed"
    QUARANTINED = protocol.InstanceState.QUARANTINED.value, "Quarantined"


class DesiredInstanceState(models.TextChoices):
    RUNNING = protocol.DesiredInstanceState.RUNNING.value, "Running"
    STOPPED = protocol.DesiredInstanceState.STOPPED.value, "Stopped"


def new_instance_api_key() -> str:
    """The secret every Triton API but health requires on one instance (hex: also a valid HAProxy name)."""
    return secrets.token_hex(24)


class InstanceQuerySet(HostQuerySet):
    def for_user(self, user, action: str = Action.VIEW):
        return self.filter(host__in=Host.objects.for_user(user, action))

    def usable_by_team(self, team):
        return self.filter(Q(host__team__isnull=True) | Q(host__team=team))


class TritonInstance(models.Model):
    """A tritonserver process with the GE backend, supervised by its host's agent.

    State machine: STOPPED -> STARTING -> READY | FAILED | QUARANTINED. A crash sends READY back to STARTING
    (restart with exponential backoff); too many crashes within the window -> QUARANTINED, which only an
    explicit start clears. ``desired_state`` is what the platform wants; the agent reconciles towards it.
    """

    host = models.ForeignKey(Host, on_delete=models.CASCADE, related_name="instances")
    name = models.CharField(max_length=63, validators=[host_name_validator])
    http_port = models.PositiveIntegerField()
    grpc_port = models.PositiveIntegerField()
    metrics_port = models.PositiveIntegerField()
    device_ids = models.JSONField(default=list, blank=True)
    executor = models.CharField(max_length=10, choices=ExecutorKind.choices, default=ExecutorKind.CPU)
    latency_summaries = models.BooleanField(
        default=False,
        help_text="Triton's latency quantile summaries; they cost throughput, so off by default.",
    )
    desired_state = models.CharField(
        max_length=20, default=DesiredInstanceState.RUNNING, choices=DesiredInstanceState.choices
    )
    state = models.CharField(max_length=20, choices=InstanceState.choices, default=InstanceState.STOPPED)
    pid = models.IntegerField(null=True, blank=True)
    server_started_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When the agent started the server ``pid`` (the host's clock): a process the agent started "
        "counted nothing before, so monitoring counts its first reading from zero. Empty: unknown start.",
    )
    restarts = models.PositiveIntegerField(default=0)
    crash_times = models.JSONField(
        default=list, blank=True, help_text="Recent crash timestamps (ISO), for quarantine."
    )
    last_error = models.TextField(blank=True)
    log_tail = models.TextField(blank=True)
    state_changed_at = models.DateTimeField(default=timezone.now)
    # Commands for the agent (start/stop/restart): the agent acts once per new sequence number.
    command = models.CharField(max_length=10, blank=True)
    command_seq = models.PositiveIntegerField(default=0)
    capacity_mb = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Memory its models may use (NPU: HBM minus the reserve). Empty: its pool's CPU budget.",
    )
    # Written only by ``apps.deployments`` (the scheduler and the services that create, revive, unload and
    # re-size placements), in the transaction of the placement change, under this row's lock: a decision
    # reads one column per instance instead of summing every placement of its pool.
    reserved_mb = models.PositiveIntegerField(
        default=0,
        editable=False,
        help_text="Memory its live placements hold (the sum of their versions' footprints), kept by the "
        "scheduler with every placement change.",
    )
    from_template = models.BooleanField(default=False, editable=False)
    template_pool = models.ForeignKey(
        Pool,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        editable=False,
        help_text="The pool whose template made it: once its host leaves that pool it is no longer wanted, "
        "even where the new pool's template would make one of the same name.",
    )
    unwanted_since = models.DateTimeField(
        null=True,
        blank=True,
        editable=False,
        help_text="A template instance its host's pool no longer wants (fewer devices, another template, the "
        "host left the pool): no new replicas; its replicas move away one at a time, then it stops and goes.",
    )
    # Only the gateway and the platform hold it: Triton refuses every API but health without it.
    api_key = models.CharField(max_length=64, default=new_instance_api_key, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = InstanceQuerySet.as_manager()

    class Meta:
        ordering = ["host", "name"]
        constraints = [
            models.UniqueConstraint(fields=["host", "name"], name="unique_instance_name_per_host"),
            models.UniqueConstraint(fields=["host", "http_port"], name="unique_http_port_per_host"),
            models.UniqueConstraint(fields=["host", "grpc_port"], name="unique_grpc_port_per_host"),
            models.UniqueConstraint(fields=["host", "metrics_port"], name="unique_metrics_port_per_host"),
        ]

    def __str__(self) -> str:
        return f"{self.host.name}/{self.name}"

    def is_settling(self) -> bool:
        """The agent of an online host is still moving the instance towards its desired state (pages poll
        while this holds; an offline host's agent cannot act, so there is nothing to wait for)."""
        if not self.host.is_online():
            return False
        if self.desired_state == DesiredInstanceState.STOPPED:
            return self.state in (InstanceState.READY, InstanceState.STARTING)
        return self.state in (InstanceState.STOPPED, InstanceState.STARTING)

    def endpoint_url(self) -> str:
        return f"http://{self.host.address}:{self.http_port}"

    def key_headers(self, protocol: str = "http") -> dict[str, str]:
        """The header that unlocks this instance's APIs (all but health): only the platform sends it."""
        return {(GRPC_API_KEY_HEADER if protocol == "grpc" else API_KEY_HEADER): self.api_key}

    def grpc_endpoint(self) -> str:
        return f"{self.host.address}:{self.grpc_port}"

    def metrics_url(self) -> str:
        return f"http://{self.host.address}:{self.metrics_port}/metrics"


class GatewayReachability(models.Model):
    """An instance a running gateway cannot reach: its health checks fail at the connection (a timeout or a
    refusal, not an answer saying the model is not ready) while the platform may still hear the host's agent.
    One row per gateway process and instance, written by the gateway after each sync
    (``apps.fleet.services.record_gateway_reachability``); rows whose gateway has not reported within
    ``GATEWAY_ROUTES_STALE_S`` are ignored. The platform does not move replicas for it (see
    ``docs/operators/network-faults.md``): the gateway takes the instance out of rotation, operators see it
    on the host (page, API) and in the host-offline alert."""

    gateway = models.CharField(max_length=200)
    instance = models.ForeignKey(
        TritonInstance, on_delete=models.CASCADE, related_name="gateway_reachability"
    )
    reason = models.CharField(max_length=200)
    since = models.DateTimeField()
    seen_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["gateway", "instance"], name="one_reachability_per_gateway_instance"
            )
        ]
        ordering = ["instance_id", "gateway"]

    def __str__(self) -> str:
        return f"{self.instance} unreachable from gateway {self.gateway}: {self.reason}"

    @classmethod
    def current(cls):
        """The rows of gateways that reported recently (a stopped gateway's rows age out)."""
        since = timezone.now() - timedelta(seconds=settings.GATEWAY_ROUTES_STALE_S)
        return cls.objects.filter(seen_at__gte=since)
