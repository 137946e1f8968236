"""Deployments put a READY model version on Triton instances and switch versions without dropping requests."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import models
from django.utils import timezone

from apps.deployments.cold_start import HOPS
from apps.teams.models import TeamScopedQuerySet
from hostagent import protocol


class DeploymentState(models.TextChoices):
    PENDING = "PENDING", "Pending"
    DEPLOYING = "DEPLOYING", "Deploying"
    SERVING = "SERVING", "Serving"
    SWITCHING = "SWITCHING", "Switching version"
    FAILED = "FAILED", "Failed"
    UNDEPLOYING = "UNDEPLOYING", "Undeploying"
    UNDEPLOYED = "UNDEPLOYED", "Undeployed"


ACTIVE_STATES = (
    DeploymentState.PENDING,
    DeploymentState.DEPLOYING,
    DeploymentState.SERVING,
    DeploymentState.SWITCHING,
    DeploymentState.FAILED,
)


class Spread(models.TextChoices):
    HOST = "host", "At most one replica per host while the pool has enough hosts"
    NONE = "none", "Replicas may share a host"


class Deployment(models.Model):
    """One model of a team served on a set of Triton instances.

    State machine: PENDING -> DEPLOYING -> SERVING | FAILED; SERVING -> SWITCHING -> SERVING (the new version, or
    the old one still serving when the switch failed); any -> UNDEPLOYING -> UNDEPLOYED. ``active_version`` is
    what clients get; ``target_version`` is the version being rolled out, if any. At most one live deployment
    per model.
    """

    team = models.ForeignKey("teams.Team", on_delete=models.CASCADE, related_name="deployments")
    model = models.ForeignKey(
        "registry.RegisteredModel", on_delete=models.CASCADE, related_name="deployments"
    )
    instances = models.ManyToManyField(
        "fleet.TritonInstance",
        through="DeploymentInstance",
        through_fields=("deployment", "instance"),
        related_name="deployments",
    )
    active_version = models.ForeignKey(
        "registry.ModelVersion", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    target_version = models.ForeignKey(
        "registry.ModelVersion", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    state = models.CharField(max_length=20, choices=DeploymentState.choices, default=DeploymentState.PENDING)
    last_error = models.TextField(blank=True)
    # Placement by intent (apps.deployments.scheduler): how many replicas, where, how spread. A pinned
    # deployment serves on the instances a person picked and the scheduler leaves it alone.
    pinned = models.BooleanField(default=True)
    replicas = models.PositiveSmallIntegerField(default=1)
    pool = models.ForeignKey(
        "fleet.Pool",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="deployments",
        help_text="Empty: any pool the team may use.",
    )
    spread = models.CharField(max_length=10, choices=Spread.choices, default=Spread.HOST)
    pending_reason = models.TextField(
        blank=True, help_text="Why some replicas are not placed (the scheduler's last word)."
    )
    # Since when replicas wait for room (set with the first pending reason, cleared when all are placed): the
    # waiting replicas take freed room in this order (``apps.deployments.room``).
    waiting_since = models.DateTimeField(null=True, blank=True)
    # Autoscaling (apps.deployments.autoscaling): on while min_replicas is set; replicas then follows the
    # gateway's in-flight requests between min and max. min_replicas 0: scale to zero after the idle period.
    min_replicas = models.PositiveSmallIntegerField(null=True, blank=True)
    max_replicas = models.PositiveSmallIntegerField(null=True, blank=True)
    target_in_flight = models.FloatField(default=4.0, help_text="In-flight requests per replica.")
    scale_down_window_s = models.PositiveIntegerField(default=300)
    idle_period_s = models.PositiveIntegerField(default=900)
    asleep_since = models.DateTimeField(null=True, blank=True)
    last_cold_start_ms = models.PositiveIntegerField(
        null=True, blank=True, help_text="How long the gateway held the request that woke it last."
    )
    last_cold_start = models.JSONField(
        default=dict, blank=True, help_text="Where the last cold start's time went, hop by hop (ms)."
    )
    scaling_memory = models.JSONField(default=dict, blank=True, help_text="The autoscaler's last figures.")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = TeamScopedQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["model"],
                condition=~models.Q(state="UNDEPLOYED"),
                name="one_live_deployment_per_model",
            )
        ]

    def __str__(self) -> str:
        return f"{self.model} ({self.state})"

    def triton_model_name(self) -> str:
        return self.model.triton_model_name()

    def is_live(self) -> bool:
        return self.state != DeploymentState.UNDEPLOYED

    def autoscaled(self) -> bool:
        return self.min_replicas is not None and not self.pinned

    def cold_start_hops(self) -> list[tuple[str, int]]:
        """The last cold start's breakdown as (what the hop is, ms), in order (``apps.deployments.cold_start``)."""
        hops = self.last_cold_start or {}
        return [(label, hops[key]) for key, label in HOPS if isinstance(hops.get(key), int)]

    def residency(self) -> str:
        """Whether its model is in memory now: "asleep" (scaled to zero; the next request wakes it),
        "waking" (asked for replicas, none ready yet), "loaded" (a replica serves, and every running gateway
        has one in rotation). Reads prefetched placements."""
        if self.autoscaled() and self.replicas == 0:
            return "asleep"
        if not self.replicas_ready():
            return "waking"
        in_rotation = self.gateway_view().servers_in_rotation(self)
        return "waking" if in_rotation == 0 else "loaded"

    def holds_requests_asleep(self) -> bool:
        """Scale to zero is on: the gateway holds a request while no replica serves and wakes it."""
        return self.min_replicas == 0 and not self.pinned

    def gateway_view(self) -> GatewayView:
        """What the running gateways route (loaded once per object; ``GatewayView.annotate`` shares one
        among the deployments of a list)."""
        if "_gateway_view" not in self.__dict__:
            self._gateway_view = GatewayView.load()
        return self._gateway_view

    def waiting_for(self) -> str:
        """Why a deployment whose placements serve is not callable through the gateway yet; empty otherwise."""
        return self.gateway_view().waiting_for(self)

    def reported_state(self) -> str:
        """The state clients are told: SERVING only once a call would succeed, i.e. the placements serve the
        active version *and* every running gateway routes it to a server in rotation. Until the gateway has
        it: DEPLOYING, or SWITCHING while the gateway still routes another version."""
        if not self.waiting_for():
            return self.state
        return self.gateway_view().state_meanwhile(self)

    def get_reported_state_display(self) -> str:
        return DeploymentState(self.reported_state()).label

    def replicas_ready(self) -> int:
        """Replicas READY now; those being replaced do not count (reads prefetched placements)."""
        return sum(
            1 for p in self.placements.all() if p.state == PlacementState.READY and not p.retiring_reason
        )

    def traffic_split(self) -> list[dict]:
        """Which version serves where, and its share of the requests that name no version: the active version
        alone (100 %), or during a rollout the stable and canary versions at the rollout's weights."""
        placements = [p for p in self.placements.all() if p.state != PlacementState.UNLOADED]
        rollout = (
            Rollout.objects.live()
            .filter(deployment=self)
            .select_related("stable_version", "canary_version")
            .first()
        )
        if rollout is None:
            if self.active_version is None:
                return []
            where = [str(p.instance) for p in placements if p.served_version_id == self.active_version_id]
            return [
                {"version": self.active_version.number, "role": "active", "weight": 100, "instances": where}
            ]
        stable = [str(p.instance) for p in placements if p.served_version_id == rollout.stable_version_id]
        canary = [str(p.instance) for p in placements if p.canary_version_id == rollout.canary_version_id]
        return [
            {"version": rollout.stable_version.number, "role": "stable", "weight": 100 - rollout.current_weight,
             "instances": stable},
            {"version": rollout.canary_version.number, "role": "canary", "weight": rollout.current_weight,
             "instances": canary},
        ]  # fmt: skip


class PlacementState(models.TextChoices):
    """The values are the agent protocol's (``hostagent.protocol.PlacementState``): the agent reads them."""

    PENDING = protocol.PlacementState.PENDING.value, "Pending"
    LOADING = protocol.PlacementState.LOADING.value, "Loading"
    READY = protocol.PlacementState.READY.value, "Ready"
    FAILED = protocol.PlacementState.FAILED.value, "Failed"
    UNLOADED = protocol.PlacementState.UNLOADED.value, "Unloaded"


class DeploymentInstance(models.Model):
    """The deployment on one instance: which version that instance serves, as its host agent last reported.

    State machine: PENDING -> LOADING -> READY | FAILED; READY -> LOADING (version switch) -> READY;
    any -> UNLOADED on undeploy. READY holds only while Triton reports ``served_version`` ready: the agent's
    reconcile loop checks every interval and turns a placement whose model is gone into LOADING (it reloads
    it) or FAILED (with the reason), and back into READY once Triton serves it again.

    Every decision about the placement (deploy, switch, undeploy, roll back) bumps ``generation`` and hands the
    agent that number; the agent reports with it, and a report for an older generation is dropped (a
    conditional UPDATE), so a stale task, retry or reconcile never undoes a newer decision.
    ``applied_generation`` is the generation the agent last finished applying: lower means work is pending.
    """

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="placements")
    instance = models.ForeignKey("fleet.TritonInstance", on_delete=models.CASCADE, related_name="placements")
    served_version = models.ForeignKey(
        "registry.ModelVersion", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    canary_version = models.ForeignKey(
        "registry.ModelVersion",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="+",
        help_text="During a rollout: the canary version this instance also serves, as its agent last reported.",
    )
    state = models.CharField(max_length=20, choices=PlacementState.choices, default=PlacementState.PENDING)
    last_error = models.TextField(blank=True)
    generation = models.PositiveIntegerField(default=1)
    applied_generation = models.PositiveIntegerField(default=0)
    # Being replaced (its host was lost, revoked, drained, or its instance quarantined): it no longer counts
    # as a replica, and once its replacement serves it is told to unload (``unload``).
    retiring_reason = models.CharField(max_length=200, blank=True)
    unload = models.BooleanField(default=False)
    # The gateway routes requests to it (set by the gateway before it puts the replica in rotation, cleared
    # when it confirms the replica out of rotation with no request in flight): an unload decided meanwhile
    # reaches the agent only after that confirmation (drain, then unload), or after
    # ``GATEWAY_DRAIN_TIMEOUT_S`` counted from ``draining_since`` when no gateway confirms.
    routed = models.BooleanField(default=False)
    draining_since = models.DateTimeField(null=True, blank=True)
    # Evicted under memory pressure to make room for this deployment's replica: the memory it frees is that
    # deployment's while it waits for it (another waiting replica evicts for itself instead of queueing).
    evicted_for = models.ForeignKey(
        Deployment, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["deployment", "instance"]
        constraints = [models.UniqueConstraint(fields=["deployment", "instance"], name="unique_placement")]

    def __str__(self) -> str:
        return f"{self.deployment} on {self.instance} ({self.state})"

    def is_applied(self) -> bool:
        """The agent has finished applying the latest decision (successfully or not)."""
        return self.applied_generation == self.generation


class EventQuerySet(TeamScopedQuerySet):
    team_lookup = "deployment__team"


class DeploymentEvent(models.Model):
    """One step of a deployment's history: what happened, on which instance, with Triton's own error text."""

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="events")
    kind = models.CharField(max_length=50)
    message = models.TextField()
    instance = models.ForeignKey(
        "fleet.TritonInstance", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    version = models.ForeignKey(
        "registry.ModelVersion", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    details = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = EventQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.created_at:%H:%M:%S} {self.kind}: {self.message}"


class ReplicaSampleQuerySet(TeamScopedQuerySet):
    team_lookup = "deployment__team"


class ReplicaSample(models.Model):
    """An autoscaled deployment's replicas when they changed, as the autoscaler saw them at an evaluation:
    ``desired`` (what it decided; 0 asleep) and ``ready`` (placements serving). Written only on a change, so
    a sleeping model costs nothing; the deployment page's chart draws them as steps, the value before its
    range carried in."""

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="replica_samples")
    at = models.DateTimeField()
    desired = models.PositiveIntegerField()
    ready = models.PositiveIntegerField()

    objects = ReplicaSampleQuerySet.as_manager()

    class Meta:
        ordering = ["at", "id"]
        indexes = [models.Index(fields=["deployment", "at"], name="replica_sample_deployment_at")]

    def __str__(self) -> str:
        return f"{self.at:%H:%M:%S} {self.ready}/{self.desired}"


class RolloutState(models.TextChoices):
    RUNNING = "RUNNING", "Running"
    PAUSED = "PAUSED", "Paused"
    PROMOTED = "PROMOTED", "Promoted"
    ROLLED_BACK = "ROLLED_BACK", "Rolled back"
    ABORTED = "ABORTED", "Aborted"


LIVE_ROLLOUT_STATES = (RolloutState.RUNNING, RolloutState.PAUSED)
DEFAULT_ROLLOUT_STEPS = [10, 25, 50, 100]


def default_rollout_steps() -> list[int]:
    return list(DEFAULT_ROLLOUT_STEPS)


class RolloutQuerySet(TeamScopedQuerySet):
    team_lookup = "deployment__team"

    def live(self):
        return self.filter(state__in=LIVE_ROLLOUT_STATES)


class Rollout(models.Model):
    """A progressive rollout of ``canary_version`` next to ``stable_version`` on one deployment.

    State machine: RUNNING <-> PAUSED; RUNNING -> PROMOTED (every check passed at the last step, or "promote
    now") | ROLLED_BACK (``max_failed_checks`` consecutive failed checks, or too little traffic past the
    deadline) | ABORTED (a maintainer rolled back by hand). While RUNNING or PAUSED both versions are loaded
    and the gateway sends ``current_weight`` % of the requests that name no version to the canary, the rest to
    the stable version; a request that names a version gets that version. At most one live rollout per
    deployment; the database is the source of truth (a restart resumes it, the gateway's weights come from it).
    """

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="rollouts")
    # A live rollout's versions are in use (archive and delete refuse them); an ended rollout lets go of a
    # version deleted later (null), its events and audit rows still name it.
    stable_version = models.ForeignKey(
        "registry.ModelVersion", null=True, on_delete=models.SET_NULL, related_name="+"
    )
    canary_version = models.ForeignKey(
        "registry.ModelVersion", null=True, on_delete=models.SET_NULL, related_name="+"
    )
    state = models.CharField(max_length=20, choices=RolloutState.choices, default=RolloutState.RUNNING)
    steps = models.JSONField(
        default=default_rollout_steps, help_text="Canary weights in percent, increasing, ending at 100."
    )
    step_interval_s = models.PositiveIntegerField(default=60)
    current_step = models.PositiveIntegerField(default=0, help_text="Index into steps.")
    current_weight = models.PositiveSmallIntegerField(default=0, help_text="Percent of unversioned requests.")
    # Gates.
    min_success_rate = models.FloatField(default=0.99)
    max_p99_ms = models.FloatField(null=True, blank=True, help_text="Absolute p99 limit for the canary.")
    max_p99_ratio = models.FloatField(
        null=True, blank=True, help_text="Canary p99 at most this times the stable version's p99."
    )
    min_requests = models.PositiveIntegerField(default=50)
    max_failed_checks = models.PositiveSmallIntegerField(default=3)
    traffic_deadline_s = models.PositiveIntegerField(
        default=600, help_text="A step that has not seen min_requests by then counts as a failed check."
    )
    consecutive_failures = models.PositiveSmallIntegerField(default=0)
    step_started_at = models.DateTimeField(null=True, blank=True)
    next_check_at = models.DateTimeField(null=True, blank=True)
    baseline = models.JSONField(
        default=dict,
        blank=True,
        help_text="Per instance: the server process and the cumulative counters read at the last judged check.",
    )
    window_started_at = models.DateTimeField(null=True, blank=True)
    canary_unload_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="Once ended: when the canary is unloaded (after the gateway took it out of rotation).",
    )
    reason = models.TextField(blank=True, help_text="Why it ended (the figures that failed, or who acted).")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = RolloutQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["deployment"],
                condition=models.Q(state__in=["RUNNING", "PAUSED"]),
                name="one_live_rollout_per_deployment",
            )
        ]
        # The beat's tick: due checks and pending unloads, found without a scan of every rollout ever run.
        indexes = [
            models.Index(fields=["state", "next_check_at"], name="rollout_due_check"),
            models.Index(fields=["canary_unload_at"], name="rollout_pending_unload"),
        ]

    def __str__(self) -> str:
        return f"rollout of {self.canary_version} on {self.deployment} ({self.state}, {self.current_weight}%)"

    def is_live(self) -> bool:
        return self.state in LIVE_ROLLOUT_STATES


class RolloutAnalysis(models.Model):
    """One check of a rollout: the figures of both versions over the window and which gates failed."""

    rollout = models.ForeignKey(Rollout, on_delete=models.CASCADE, related_name="analyses")
    checked_at = models.DateTimeField()
    window_start = models.DateTimeField()
    weight = models.PositiveSmallIntegerField()
    passed = models.BooleanField()
    waiting = models.BooleanField(default=False, help_text="Too few canary requests to judge yet.")
    figures = models.JSONField(
        default=dict, blank=True, help_text="Per version: requests, success rate, p50/p99, queue time."
    )
    failed_gates = models.JSONField(default=list, blank=True)

    class Meta:
        ordering = ["rollout", "checked_at", "id"]

    def __str__(self) -> str:
        return f"{self.rollout_id} at {self.checked_at:%H:%M:%S}: {'pass' if self.passed else 'fail'}"


class GatewayRouting(models.Model):
    """What one running gateway routes, as it last reported after applying a sync: the gateway's half of
    "SERVING" (``apps.deployments.routing``). ``routes`` maps a deployment's id to ``[version, servers]``:
    the version its unversioned requests reach (0: any, during a switch) and how many of its servers are in
    rotation (a sleeping deployment's route holds requests with none). ``seen_at`` is the gateway's heartbeat:
    a gateway silent for ``GATEWAY_ROUTES_STALE_S`` is no longer waited for. One row per gateway process
    (host name and bind), removed when it stops."""

    name = models.CharField(max_length=200, unique=True)
    routes = models.JSONField(default=dict, blank=True)
    seen_at = models.DateTimeField()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"gateway {self.name} ({len(self.routes)} routes)"


@dataclass(frozen=True)
class GatewayView:
    """The routes of every gateway that reported within ``GATEWAY_ROUTES_STALE_S``: deployment id ->
    (version, servers in rotation). No gateway running: nothing to wait for, the placements alone decide
    (as for draining, ``apps.deployments.draining``)."""

    gateways: tuple[dict[int, tuple[int, int]], ...] = ()

    @classmethod
    def load(cls) -> GatewayView:
        since = timezone.now() - timedelta(seconds=settings.GATEWAY_ROUTES_STALE_S)
        rows = GatewayRouting.objects.filter(seen_at__gte=since).values_list("routes", flat=True)
        return cls(
            tuple(
                {int(pk): (int(entry[0]), int(entry[1])) for pk, entry in routes.items()} for routes in rows
            )
        )

    @classmethod
    def annotate(cls, deployments) -> None:
        """One view for a list of deployments (one query, whatever their number)."""
        view = cls.load()
        for deployment in deployments:
            deployment._gateway_view = view

    def servers_in_rotation(self, deployment: Deployment) -> int | None:
        """The fewest servers in rotation for it over the running gateways; None without a gateway."""
        if not self.gateways:
            return None
        return min(routes.get(deployment.pk, (0, 0))[1] for routes in self.gateways)

    def waiting_for(self, deployment: Deployment) -> str:
        if (
            not self.gateways
            or deployment.state != DeploymentState.SERVING
            or deployment.active_version is None
        ):
            return ""
        want = deployment.active_version.number
        for routes in self.gateways:
            routed = routes.get(deployment.pk)
            if routed is None:
                return f"the gateway to route version {want} (its next sync)"
            version, servers = routed
            if version != want:
                now = f"version {version}" if version else "every version (a switch)"
                return f"the gateway to route version {want} (it routes {now})"
            if not servers and not deployment.holds_requests_asleep():
                return f"the gateway to put a replica of version {want} in rotation"
        return ""

    def state_meanwhile(self, deployment: Deployment) -> str:
        """A gateway still routes another version: SWITCHING; none routes it yet, or without a server in
        rotation: DEPLOYING."""
        want = deployment.active_version.number if deployment.active_version else None
        other = any(routes.get(deployment.pk, (want,))[0] != want for routes in self.gateways)
        return DeploymentState.SWITCHING if other else DeploymentState.DEPLOYING


# Defined in its own module (the deployments' models would pass this file's size), registered from here.
from apps.deployments.tuning_models import TuningJob, TuningState  # noqa: E402, F401
