"""What the gateway should route, read from the database: the one place that decides who reaches what.

* A live deployment (not undeploying) is a backend ``d<id>`` with one server per placement, and a route in
  ``models.map``. A placement is in rotation when its instance is READY and it serves the version clients are
  pinned to; during a switch requests are not pinned and every placement that serves something stays in
  rotation, so no request meets a half-switched instance. Servers are checked with the readiness of the pinned
  version (of the model, during a switch).
* During a live rollout (RUNNING or PAUSED) unversioned requests are pinned to the stable version, except
  ``current_weight`` % of them that go to the canary backend ``d<id>c``: only the placements whose agent reports
  serving the canary, checked with the canary version's readiness. While none of them is in rotation the weight
  is 0, so no request waits for a canary that is not there.
* Drain, then unload (``apps.deployments.draining``): the placements about to enter the rotation for the
  first time and the routed ones told to unload are collected (``Tracked``), for the gateway to mark the
  former before it routes to them and to confirm the latter once they have no request in flight - those of
  an undeploying deployment too, whose route and servers are gone (new requests get the gateway's 404)
  while the requests already sent to them finish.
* Tokens that may infer: every active team token whose creator is still an active member (read-only ones too,
  as viewers may run models), and inference-only tokens. Expired tokens stay in the map with their expiry so
  the gateway can say so; revoked ones are removed.
* gRPC unary calls follow the same routes (each slot has a gRPC twin with the placements' gRPC ports; the
  gateway reads the model name from the message, see ``apps.gateway.grpc_frontend``). Streams are not
  inspected, so they go only to instances on hosts dedicated to the caller's team (``g<team id>``); server-level
  calls go to any routable instance (``grpc_any``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from datetime import timedelta
from functools import lru_cache
from urllib.parse import quote

from django.conf import settings
from django.db.models import F
from django.utils import timezone

from apps.deployments.models import (
    Deployment,
    DeploymentInstance,
    DeploymentState,
    PlacementState,
    Rollout,
)
from apps.fleet.models import InstanceState, TritonInstance
from apps.gateway.grpc_frontend import ANY_INSTANCE
from apps.gateway.haproxy import NEVER_EXPIRES, GatewayState, Options, Route, Server
from apps.teams.models import ApiToken, Team
from backend_ge.config import ConfigError, parse_config
from backend_ge.runtime import API_KEY_HEADER, GRPC_API_KEY_HEADER

# Expired tokens are kept this long so a client hears "expired" rather than "invalid".
EXPIRED_TOKENS_KEPT = timedelta(days=7)


@dataclass
class Tracked:
    """Placements the sync tells ``apps.deployments.draining`` about, each with its servers as (logical
    backend, server key): ``to_mark`` are in rotation in this state but not yet marked routed; ``to_confirm``
    are routed, told to unload, and out of rotation in this state (an undeploying deployment's: with the
    backends it had, which this state no longer has)."""

    to_mark: dict[int, list[tuple[str, str]]] = field(default_factory=dict)
    to_confirm: dict[int, list[tuple[str, str]]] = field(default_factory=dict)


def options() -> Options:
    return Options(
        directory=settings.GATEWAY_DIR,
        bind=settings.GATEWAY_BIND,
        grpc_bind=settings.GATEWAY_GRPC_BIND,
        stats_bind=settings.GATEWAY_STATS_BIND,
        key_header=API_KEY_HEADER,
        grpc_key_header=GRPC_API_KEY_HEADER,
        default_limit=settings.GATEWAY_DEFAULT_REQUESTS_PER_SECOND,
        threads=settings.GATEWAY_THREADS,
        check_interval_ms=settings.GATEWAY_CHECK_INTERVAL_MS,
        buffer_size=settings.GATEWAY_BUFFER_BYTES,
        grpc_max_message=settings.GATEWAY_GRPC_MAX_MESSAGE_BYTES,
        activation_timeout_s=settings.GATEWAY_ACTIVATION_TIMEOUT_S,
        server_maxconn=settings.GATEWAY_SERVER_MAXCONN,
    )


def backend_name(deployment_id: int) -> str:
    return f"d{deployment_id}"


def canary_backend_name(deployment_id: int) -> str:
    return f"d{deployment_id}c"


def grpc_backend_name(team_id: int) -> str:
    return f"g{team_id}"


# What a sync reads of each row (a sync follows every placement change; with 300 deployments the full rows'
# JSON and timestamps were most of its time). A field read below but missing here costs a query per row:
# ``tests/gateway/test_state.py`` counts a sync's queries.
_VERSION = ("number", "config_text")
DEPLOYMENT_FIELDS = (
    "state", "replicas", "min_replicas", "pinned", "team__slug", "model__slug", "model__team__slug",
    *(f"{version}__{field}" for version in ("active_version", "target_version") for field in _VERSION),
)  # fmt: skip
PLACEMENT_FIELDS = (
    "deployment_id", "state", "last_error", "retiring_reason", "unload", "routed", "canary_version_id",
    "served_version__number", "instance__api_key", "instance__state", "instance__http_port",
    "instance__grpc_port", "instance__host__address", "instance__host__revoked_at",
)  # fmt: skip
ROLLOUT_FIELDS = (
    "deployment_id", "current_weight", "canary_version_id",
    *(f"{version}__{field}" for version in ("stable_version", "canary_version") for field in _VERSION),
)  # fmt: skip


def _routed_version(deployment: Deployment) -> int | None:
    """The version unversioned requests are pinned to; 0 = not pinned (switching); None = not routed."""
    if deployment.state == DeploymentState.SWITCHING:
        return 0
    version = deployment.active_version or deployment.target_version
    return version.number if version is not None else None


def _routable(instance: TritonInstance) -> bool:
    """READY, on a host whose credential is not revoked: a revoked host is no longer trusted with requests,
    whatever its instances still report."""
    return instance.state == InstanceState.READY and instance.host.revoked_at is None


def _server(instance: TritonInstance) -> Server:
    return Server(instance.api_key, instance.host.address, instance.http_port, grpc_port=instance.grpc_port)


def _in_rotation(placement: DeploymentInstance, version: int) -> bool:
    """READY instance serving ``version`` (0: serving anything, during a switch), and not told to unload: a
    retired replica (drained, or replaced) leaves the rotation in the same commit that tells its agent to
    unload it, so requests go to its replacement before the model is gone."""
    served = placement.served_version
    if placement.unload:
        return False
    return _routable(placement.instance) and served is not None and (version == 0 or served.number == version)


def _canary_servers(
    state: GatewayState, name: str, placements: list[DeploymentInstance], rollout: Rollout, tracked: Tracked
) -> int:
    """The canary backend: only the placements that report serving the rollout's canary (so a canary-routed
    request never meets an instance without it). Returns how many are in rotation."""
    servers, in_rotation = [], 0
    for placement in placements:
        if placement.canary_version_id != rollout.canary_version_id:
            continue
        instance = placement.instance
        server = _server(instance)
        servers.append(server)
        ready = _routable(instance) and placement.state == PlacementState.READY and not placement.unload
        state.weights[(name, server.key)] = 100 if ready else 0
        if not ready and _routable(instance):
            state.awaiting_placement.add((name, server.key))
        if ready and not placement.routed:
            tracked.to_mark.setdefault(placement.pk, []).append((name, server.key))
        in_rotation += ready
    if servers:
        state.backends[name] = tuple(sorted(servers))
    return in_rotation


def _add_http_routes(state: GatewayState, tracked: Tracked, only: set[int] | None = None) -> None:
    live = Deployment.objects.exclude(state__in=(DeploymentState.UNDEPLOYING, DeploymentState.UNDEPLOYED))
    deployments = (
        (live if only is None else live.filter(pk__in=only))
        # model__team: the Triton model name is made of the model's team's slug (one query, not one a deployment).
        .select_related("team", "model__team", "active_version", "target_version")
        .only(*DEPLOYMENT_FIELDS)
    )
    # Grouped here rather than by prefetch_related, which builds a related manager and a queryset for each
    # deployment (with 300 deployments, a sync's median 157-174 ms -> 144-151 ms; a sync follows every
    # placement change). UNLOADED placements are not fetched.
    deployments = list(deployments)
    placements_of: dict[int, list[DeploymentInstance]] = {}
    for placement in (
        DeploymentInstance.objects.filter(deployment_id__in=[d.pk for d in deployments])
        .exclude(state=PlacementState.UNLOADED)
        .select_related("instance__host", "served_version")
        .only(*PLACEMENT_FIELDS)
        .order_by("pk")
    ):
        placements_of.setdefault(placement.deployment_id, []).append(placement)
    rollouts = {
        rollout.deployment_id: rollout
        for rollout in Rollout.objects.live()
        .select_related("stable_version", "canary_version")
        .only(*ROLLOUT_FIELDS)
    }
    for deployment in deployments:
        version = _routed_version(deployment)
        if version is None:
            continue
        model = deployment.triton_model_name()
        name = backend_name(deployment.pk)
        placements = placements_of.get(deployment.pk, [])
        rollout = rollouts.get(deployment.pk)
        if rollout is not None and version:
            version = rollout.stable_version.number
        servers = []
        for placement in placements:
            instance = placement.instance
            server = _server(instance)
            servers.append(server)
            in_rotation = _in_rotation(placement, version)
            state.weights[(name, server.key)] = 100 if in_rotation else 0
            if not in_rotation and _routable(instance):
                state.awaiting_placement.add((name, server.key))
            if in_rotation and not placement.routed:
                tracked.to_mark[placement.pk] = [(name, server.key)]
            elif placement.unload and placement.routed:
                tracked.to_confirm[placement.pk] = [
                    (name, server.key),
                    (canary_backend_name(deployment.pk), server.key),
                ]
        state.backends[name] = tuple(sorted(servers))
        state.checks[name] = f"{model}/versions/{version}" if version else model
        route = Route(deployment.team.slug, name, version)
        if rollout is not None and version:
            canary = canary_backend_name(deployment.pk)
            ready = _canary_servers(state, canary, placements, rollout, tracked)
            if canary in state.backends:
                state.checks[canary] = f"{model}/versions/{rollout.canary_version.number}"
                # No canary placement in rotation: unversioned requests all stay on the stable version.
                weight = min(100, rollout.current_weight) if ready else 0
                route = replace(
                    route,
                    canary_backend=canary,
                    canary_version=rollout.canary_version.number,
                    canary_weight=weight,
                )
        state.routes[model] = route
        _add_priority_levels(state, model, deployment, rollout)
        if deployment.min_replicas == 0 and not deployment.pinned:
            state.sleepy[model] = name
            failure = _wake_failure(deployment, placements)
            if failure:
                state.wake_failures[name] = wake_failure_value(failure)
        _add_to_index(state, deployment, route, placements)


@lru_cache(maxsize=4096)
def config_priority_levels(config_text: str) -> int:
    """``dynamic_batching.priority_levels`` of a served config (0: none, or not a config the gateway can read;
    a READY version's text is immutable, so a sync parses each once)."""
    try:
        cfg = parse_config(config_text)
    except ConfigError:
        return 0
    if cfg.platform == "ensemble" or not cfg.HasField("dynamic_batching"):
        return 0
    return max(0, cfg.dynamic_batching.priority_levels)


def _add_priority_levels(state: GatewayState, model: str, deployment: Deployment, rollout) -> None:
    versions = [deployment.active_version, deployment.target_version]
    if rollout is not None:
        versions += [rollout.stable_version, rollout.canary_version]
    for version in versions:
        if version is None:
            continue
        levels = config_priority_levels(version.config_text)
        if levels:
            state.priority_levels[f"{model}/{version.number}"] = str(levels)


def _add_to_index(state: GatewayState, deployment: Deployment, route: Route, placements) -> None:
    """The model in its team's ``GET /v2/models`` answer if a call reaches it: the versions served by
    replicas in rotation (the canary's too while it takes requests), READY; or, scaled to zero with none in
    rotation, its active version, ASLEEP (the gateway holds the call and wakes it)."""
    versions = set()
    for placement in placements:
        key = _server(placement.instance).key
        if state.weights.get((route.backend, key)) and placement.served_version is not None:
            versions.add(placement.served_version.number)
        canary = route.canary_backend
        if (
            canary
            and route.canary_weight
            and state.weights.get((canary, key))
            and placement.canary_version_id
        ):
            versions.add(route.canary_version)
    if versions:
        entry_state = "READY"
    elif deployment.holds_requests_asleep() and deployment.active_version is not None:
        versions, entry_state = {deployment.active_version.number}, "ASLEEP"
    else:
        return
    numbers = ",".join(str(v) for v in sorted(versions))
    state.index.setdefault(route.team, []).append(f"{deployment.triton_model_name()}/{numbers}/{entry_state}")


def _track_undeploying(tracked: Tracked) -> None:
    """An undeploying deployment has no route and no servers (``_add_http_routes``), but its routed replicas
    still drain: requests sent to them before the gateway dropped them finish there first."""
    rows = (
        DeploymentInstance.objects.filter(
            deployment__state=DeploymentState.UNDEPLOYING, unload=True, routed=True
        )
        .exclude(state=PlacementState.UNLOADED)
        .select_related("instance__host")
    )
    for placement in rows:
        key = _server(placement.instance).key
        deployment_id = placement.deployment_id
        tracked.to_confirm[placement.pk] = [
            (backend_name(deployment_id), key),
            (canary_backend_name(deployment_id), key),
        ]


def _wake_failure(deployment, placements) -> str:
    """Why a woken scale-to-zero deployment cannot serve: it wants replicas, none is READY or loading, and
    one failed (its last error). Empty while a replica serves, loads or is still to be placed."""
    if deployment.replicas == 0 or not placements:
        return ""
    states = {p.state for p in placements if not p.retiring_reason}
    if PlacementState.FAILED not in states or states & {
        PlacementState.READY,
        PlacementState.LOADING,
        PlacementState.PENDING,
    }:
        return ""
    return next((p.last_error for p in placements if p.state == PlacementState.FAILED and p.last_error), "")


def wake_failure_value(reason: str) -> str:
    """A reason as a map value: only characters that need no escaping in JSON or the map file, at most 300,
    percent-encoded (gRPC's grpc-message takes it as it is; wake.lua decodes it for the HTTP body)."""
    kept = re.sub(r"[^A-Za-z0-9 .,:;()_/-]+", " ", reason).strip()[:300] or "its replica failed to load"
    return quote(kept, safe="")


def _add_grpc_routes(state: GatewayState) -> None:
    every = []
    for instance in TritonInstance.objects.select_related("host"):
        server = Server(
            instance.api_key, instance.host.address, instance.grpc_port, check_port=instance.http_port
        )
        every.append(server)
        state.weights[(ANY_INSTANCE, server.key)] = 100 if _routable(instance) else 0
    state.grpc_backends[ANY_INSTANCE] = tuple(sorted(every))
    dedicated = TritonInstance.objects.filter(host__team__isnull=False).select_related("host")
    for instance in dedicated:
        name = grpc_backend_name(instance.host.team_id)
        server = Server(
            instance.api_key, instance.host.address, instance.grpc_port, check_port=instance.http_port
        )
        state.grpc_backends[name] = tuple(sorted((*state.grpc_backends.get(name, ()), server)))
        state.weights[(name, server.key)] = 100 if _routable(instance) else 0
    for team_id, slug in Team.objects.filter(hosts__isnull=False).values_list("pk", "slug").distinct():
        if grpc_backend_name(team_id) in state.grpc_backends:
            state.grpc_routes[slug] = grpc_backend_name(team_id)


def _add_tokens(state: GatewayState) -> None:
    now = timezone.now()
    tokens = (
        ApiToken.objects.filter(
            revoked_at__isnull=True,
            created_by__is_active=True,
            created_by__memberships__team=F("team"),
        )
        .exclude(expires_at__lt=now - EXPIRED_TOKENS_KEPT)
        .values_list(
            "prefix",
            "secret_hash",
            "team__slug",
            "expires_at",
            "priority_class",
            "team__default_priority_class",
        )
    )
    for prefix, secret_hash, team, expires_at, own_class, team_class in tokens:
        expires = int(expires_at.timestamp()) if expires_at is not None else NEVER_EXPIRES
        state.tokens[f"{prefix}:{secret_hash}"] = f"{team}:{expires}:{own_class or team_class}"


def desired_state(tracked: Tracked | None = None, only: set[int] | None = None) -> GatewayState:
    """``tracked``: filled with the placements to mark routed and to confirm drained. ``only``: just these
    deployments' routes, backends and map entries (``with_deployments`` puts them into a whole state)."""
    state = GatewayState()
    tracked = tracked if tracked is not None else Tracked()
    _add_http_routes(state, tracked, only)
    for models in state.index.values():
        models.sort()  # one order, however the state was put together
    if only is not None:
        return state
    _track_undeploying(tracked)
    _add_grpc_routes(state)
    _add_tokens(state)
    state.limits = {
        slug: str(rps) for slug, rps in Team.objects.values_list("slug", "quota_requests_per_second")
    }
    return state


def with_deployments(applied: GatewayState, part: GatewayState, ids: set[int]) -> GatewayState:
    """``applied`` (the whole state a sync applied last) with the deployments ``ids`` as ``part`` has them
    (``desired_state(only=ids)``: one read of a few rows), everything else as it was: what a full sync would
    give for them, without reading the other deployments, the instances and the tokens again."""
    ours = {backend_name(pk) for pk in ids}

    def mine(logical: str) -> bool:
        return logical.removesuffix("c") in ours

    models = {model for model, route in applied.routes.items() if mine(route.backend)} | set(part.routes)
    index: dict[str, list[str]] = {}
    for team, entries in applied.index.items():
        kept = [entry for entry in entries if entry.rsplit("/", 2)[0] not in models]
        index[team] = sorted(kept + part.index.get(team, []))
    index.update({team: entries for team, entries in part.index.items() if team not in index})
    return replace(
        applied,
        backends={**{k: v for k, v in applied.backends.items() if not mine(k)}, **part.backends},
        weights={**{k: w for k, w in applied.weights.items() if not mine(k[0])}, **part.weights},
        routes={**{m: r for m, r in applied.routes.items() if m not in models}, **part.routes},
        checks={**{k: c for k, c in applied.checks.items() if not mine(k)}, **part.checks},
        awaiting_placement={k for k in applied.awaiting_placement if not mine(k[0])}
        | part.awaiting_placement,
        sleepy={**{m: k for m, k in applied.sleepy.items() if m not in models}, **part.sleepy},
        index={team: entries for team, entries in index.items() if entries},
        wake_failures={
            **{k: w for k, w in applied.wake_failures.items() if not mine(k)},
            **part.wake_failures,
        },
        priority_levels={
            **{k: n for k, n in applied.priority_levels.items() if k.rsplit("/", 1)[0] not in models},
            **part.priority_levels,
        },
    )
