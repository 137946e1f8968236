"""Fleet actions: creating hosts (with a one-time join token), joining, revoking, instances, heartbeats with
inventory, start/stop/restart requests."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import timedelta

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from apps.audit.services import record
from apps.fleet import pools
from apps.fleet.long_poll import poke_watchers
from apps.fleet.models import (
    CREDENTIAL_SCHEME,
    JOIN_TOKEN_SCHEME,
    JOIN_TOKEN_TTL,
    DesiredInstanceState,
    Device,
    ExecutorKind,
    GatewayReachability,
    Host,
    InstanceState,
    TritonInstance,
    hash_host_secret,
    new_host_secret,
)
from backend_ge import npu_smi

log = logging.getLogger(__name__)


def heard_break() -> timedelta:
    """Silence longer than this (half the scheduler's grace) breaks a host's run of heard heartbeats."""
    return timedelta(seconds=settings.SCHEDULER_HOST_GRACE_S / 2)


class JoinRefused(Exception):
    """The join token is unknown, used or expired."""


def create_host(*, actor, name: str, address: str, labels: dict | None = None, team=None) -> tuple[Host, str]:
    """Staff add a host; returns it with its one-time join token (shown once, only its hash is kept)."""
    token = new_host_secret(JOIN_TOKEN_SCHEME)
    with transaction.atomic():
        host = Host(
            name=name,
            address=address,
            labels=labels or {},
            team=team,
            join_token_hash=hash_host_secret(token),
            join_token_expires_at=timezone.now() + JOIN_TOKEN_TTL,
        )
        host.full_clean()
        host.save()
        pools.join_labelled_pool(host)
        record(actor=actor, team=team, action="host.created", target=host, details={"address": address})
    return host, token


def issue_join_token(*, actor, host: Host) -> str:
    """A new join token (the previous one stops working); the host's credential changes when it joins."""
    token = new_host_secret(JOIN_TOKEN_SCHEME)
    with transaction.atomic():
        Host.objects.filter(pk=host.pk).update(
            join_token_hash=hash_host_secret(token),
            join_token_expires_at=timezone.now() + JOIN_TOKEN_TTL,
        )
        record(actor=actor, team=host.team, action="host.join_token_issued", target=host)
    return token


def join_host(token: str) -> tuple[Host, str]:
    """An agent exchanges a join token for its host's credential. The token works once; a new credential
    replaces any earlier one (and lifts a revocation: staff issued the token on purpose)."""
    now = timezone.now()
    credential = new_host_secret(CREDENTIAL_SCHEME)
    with transaction.atomic():
        host = (
            Host.objects.select_for_update()
            .filter(join_token_hash=hash_host_secret(token), join_token_expires_at__gt=now)
            .exclude(join_token_hash="")
            .first()
        )
        if host is None:
            raise JoinRefused
        Host.objects.filter(pk=host.pk).update(
            credential_hash=hash_host_secret(credential),
            join_token_hash="",
            join_token_expires_at=None,
            joined_at=now,
            revoked_at=None,
            desired_generation=F("desired_generation") + 1,
        )
        record(actor=None, team=host.team, action="host.joined", target=host)
    host.refresh_from_db()
    return host, credential


def revoke_host(*, actor, host: Host) -> Host:
    """The host's credential and any pending join token stop working at once: its agent gets 401."""
    with transaction.atomic():
        Host.objects.filter(pk=host.pk).update(
            revoked_at=timezone.now(), credential_hash="", join_token_hash="", join_token_expires_at=None
        )
        record(actor=actor, team=host.team, action="host.revoked", target=host)
    host.refresh_from_db()
    return host


def host_for_credential(raw: str) -> Host | None:
    """The joined, unrevoked host this credential belongs to (one indexed lookup per agent call)."""
    if not raw.startswith(f"{CREDENTIAL_SCHEME}_"):
        return None
    # No ordering, no exclude: it runs on every agent call (an empty hash never equals a sha256).
    rows = Host.objects.filter(credential_hash=hash_host_secret(raw), revoked_at__isnull=True).order_by()[:1]
    return next(iter(rows), None)


def record_agent_protocol(host: Host, spoken: int) -> None:
    """The agent protocol version the host's agent spoke on this call; written only when it changed (an
    agent upgrade), so an agent's calls cost no write for it."""
    if host.agent_protocol != spoken:
        Host.objects.filter(pk=host.pk).update(agent_protocol=spoken)
        host.agent_protocol = spoken


def notify_hosts(host_ids: Iterable[int]) -> None:
    """What these hosts must do changed: their agents' next poll of the desired state gets the news."""
    ids = set(host_ids)
    if ids:
        Host.objects.filter(pk__in=ids).update(desired_generation=F("desired_generation") + 1)
        # Their held polls answer after the commit, not at the watchers' next sweep.
        transaction.on_commit(poke_watchers)


def _check_ports_free(host: Host, ports: list[int], exclude_pk=None) -> None:
    taken = set()
    for row in TritonInstance.objects.filter(host=host).exclude(pk=exclude_pk):
        taken |= {row.http_port, row.grpc_port, row.metrics_port}
    clash = sorted(set(ports) & taken)
    if len(set(ports)) != len(ports):
        raise ValidationError({"ports": ["The HTTP, gRPC and metrics ports must be three different ports."]})
    if clash:
        raise ValidationError(
            {"ports": [f"Port(s) {clash} are already used by another instance on {host.name}."]}
        )


def create_instance(
    *,
    actor,
    host: Host,
    name: str,
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    device_ids: list[int] | None = None,
    executor: str = ExecutorKind.CPU,
    latency_summaries: bool = False,
) -> TritonInstance:
    with transaction.atomic():
        if TritonInstance.objects.filter(host=host, name=name).exists():
            raise ValidationError({"name": [f"{host.name} already has an instance named '{name}'."]})
        _check_ports_free(host, [http_port, grpc_port, metrics_port])
        instance = TritonInstance(
            host=host,
            name=name,
            http_port=http_port,
            grpc_port=grpc_port,
            metrics_port=metrics_port,
            device_ids=device_ids or [],
            executor=executor,
            latency_summaries=latency_summaries,
        )
        instance.full_clean()
        instance.save()
        notify_hosts([host.pk])
        record(
            actor=actor,
            team=host.team,
            action="instance.created",
            target=instance,
            details={"host": host.name},
        )
    return instance


def request_instance_state(*, actor, instance: TritonInstance, action: str) -> TritonInstance:
    """start | stop | restart. The agent acts within a second (its next desired-state poll); a start also lifts
    a quarantine. Each request is a numbered command, so the agent acts on it once however often it polls."""
    if action not in ("start", "stop", "restart"):
        raise ValidationError({"action": [f"'{action}' is not an action; use start, stop or restart."]})
    with transaction.atomic():
        fields: dict = {
            "desired_state": DesiredInstanceState.STOPPED
            if action == "stop"
            else DesiredInstanceState.RUNNING,
            "command": action,
            "command_seq": F("command_seq") + 1,
        }
        if action in ("start", "restart") and instance.state in (
            InstanceState.QUARANTINED,
            InstanceState.FAILED,
        ):
            fields.update(state=InstanceState.STOPPED, crash_times=[], state_changed_at=timezone.now())
        TritonInstance.objects.filter(pk=instance.pk).update(**fields)
        record(actor=actor, team=instance.host.team, action=f"instance.{action}", target=instance)
        notify_hosts([instance.host_id])
    instance.refresh_from_db()
    return instance


def record_heartbeat(
    host: Host,
    *,
    facts: dict,
    inventory: npu_smi.NpuInventory | None = None,
    log_tails: dict[int, str] | None = None,
    read_local: bool = True,
    port_range: tuple[int, int] | None = None,
) -> None:
    """What the agent reports every 10 s: liveness, facts, the NPU inventory (when npu-smi exists) and its
    instances' log tails. ``host`` is the row as the credential check loaded it.

    Only what changed is written: an idle host's heartbeat is one UPDATE of ``last_heartbeat_at`` (offline
    detection reads it) and one SELECT of its instances' log tails, plus one SELECT of its devices when it
    reports an inventory. A fleet of hundreds of hosts heartbeats tens of times a second, and rewriting
    unchanged rows would be most of that work (and of PostgreSQL's dead tuples).
    ``read_local``: read npu-smi here when no inventory was given (an agent on this machine).
    ``port_range``: the ports the agent owns for its instances; with a pool, the pool's template makes the
    host's instances from the inventory and takes their ports from this range (``apps.fleet.pools``)."""
    if inventory is None and read_local:
        try:
            inventory = npu_smi.read_inventory()
        except npu_smi.NpuSmiError as exc:
            log.warning("npu-smi failed: %s", exc)
    now = timezone.now()
    fields: dict = {"last_heartbeat_at": now}
    # A heartbeat after a break (the host was silent, or the platform was not listening: restarted, its
    # database down) starts a new run of heard heartbeats.
    if host.last_heartbeat_at is None or now - host.last_heartbeat_at > heard_break():
        fields["heard_since"] = now
    if facts != host.facts:
        fields["facts"] = facts
    if inventory is not None and inventory.driver_version != host.npu_driver_version:
        fields["npu_driver_version"] = inventory.driver_version
    if port_range is not None and port_range != (host.port_range_first, host.port_range_last):
        fields["port_range_first"], fields["port_range_last"] = port_range
        host.port_range_first, host.port_range_last = port_range
    Host.objects.filter(pk=host.pk).update(**fields)
    if log_tails:
        record_log_tails(host.pk, log_tails)
    if inventory is not None:
        sync_devices(host.pk, inventory)
    if host.pool_id is None and host.labels.get(pools.POOL_LABEL):
        pools.join_labelled_pool(host)
    if (
        host.pool_id is not None
        or host.instances.filter(from_template=True, unwanted_since__isnull=True).exists()
    ):
        pools.sync_template_instances(host, inventory)


def record_log_tails(host_id: int, log_tails: dict[int, str]) -> None:
    """The instances' last log lines (the host's own instances only; an unchanged tail is not rewritten)."""
    current = TritonInstance.objects.filter(host_id=host_id, pk__in=list(log_tails)).values_list(
        "pk", "log_tail"
    )
    changed = [TritonInstance(pk=pk, log_tail=log_tails[pk]) for pk, tail in current if tail != log_tails[pk]]
    if len(changed) == 1:
        TritonInstance.objects.filter(pk=changed[0].pk).update(log_tail=changed[0].log_tail)
    elif changed:
        TritonInstance.objects.bulk_update(changed, ["log_tail"])


def record_instance_state(instance: TritonInstance, **fields) -> None:
    """An agent reports what its supervisor did to an instance (absolute values: a retry is harmless).

    A pid comes with the time the agent started that server, or its start is unknown (an agent that does not
    say): monitoring counts a known start's first reading from zero, an unknown one's as a baseline."""
    if "pid" in fields or "started_at" in fields:
        fields["server_started_at"] = fields.pop("started_at", None)
    if "state" in fields and fields["state"] != instance.state:
        fields["state_changed_at"] = timezone.now()
    if fields:
        TritonInstance.objects.filter(pk=instance.pk).update(**fields)


def _device_values(chip: npu_smi.NpuChip) -> dict:
    return {
        "logical_id": chip.device_id,
        "name": chip.name,
        "soc_version": chip.soc_version,
        "health": chip.health if chip.health in ("OK", "Warning", "Alarm", "Critical") else "Unknown",
        "aicore_percent": chip.aicore_percent,
        "memory_used_mb": chip.memory_used_mb,
        "memory_total_mb": chip.memory_total_mb,
        "hbm_used_mb": chip.hbm_used_mb,
        "hbm_total_mb": chip.hbm_total_mb,
        "power_w": chip.power_w,
        "temperature_c": chip.temperature_c,
    }


def sync_devices(host_id: int, inventory: npu_smi.NpuInventory) -> None:
    """The host's devices as its agent's `npu-smi info` reports them: new chips added, changed ones updated
    (``updated_at``: when a value last changed), chips no longer reported removed. One SELECT, and one
    statement per kind of change; an unchanged inventory writes nothing."""
    existing = {(d.npu_id, d.chip_id): d for d in Device.objects.filter(host_id=host_id)}
    reported = {(chip.npu_id, chip.chip_id): _device_values(chip) for chip in inventory.chips}
    now = timezone.now()
    created, changed = [], []
    for (npu_id, chip_id), values in reported.items():
        device = existing.get((npu_id, chip_id))
        if device is None:
            created.append(Device(host_id=host_id, npu_id=npu_id, chip_id=chip_id, **values))
        elif any(getattr(device, name) != value for name, value in values.items()):
            for name, value in values.items():
                setattr(device, name, value)
            device.updated_at = now
            changed.append(device)
    if created:
        # Two heartbeats of one host at once (a retry) may both create a chip: the second one's row is a copy.
        Device.objects.bulk_create(created, ignore_conflicts=True)
    if changed:
        Device.objects.bulk_update(changed, [*next(iter(reported.values())), "updated_at"])
    gone = [device.pk for key, device in existing.items() if key not in reported]
    if gone:
        Device.objects.filter(pk__in=gone).delete()


def record_gateway_reachability(gateway: str, unreachable: dict[str, str]) -> None:
    """What one gateway cannot reach now: ``unreachable`` maps an instance's key (the gateway's server name)
    to the reason its health checks give (a connection timeout, a refusal). Rows of instances it reaches again
    go; the others keep the time they were first seen; every row of this gateway is marked seen now."""
    now = timezone.now()
    ids = dict(TritonInstance.objects.filter(api_key__in=list(unreachable)).values_list("api_key", "pk"))
    wanted = {ids[key]: reason[:200] for key, reason in unreachable.items() if key in ids}
    with transaction.atomic():
        rows = GatewayReachability.objects.filter(gateway=gateway)
        rows.exclude(instance_id__in=list(wanted)).delete()
        known = set(rows.values_list("instance_id", flat=True))
        for instance_id, reason in wanted.items():
            if instance_id in known:
                rows.filter(instance_id=instance_id).update(reason=reason, seen_at=now)
            else:
                GatewayReachability.objects.create(
                    gateway=gateway, instance_id=instance_id, reason=reason, since=now, seen_at=now
                )


def forget_gateway_reachability(gateway: str) -> None:
    """A gateway that stops reports nothing any more."""
    GatewayReachability.objects.filter(gateway=gateway).delete()
