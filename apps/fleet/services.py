"""Fleet actions: registering hosts and instances, heartbeats with inventory, start/stop/restart requests."""

from __future__ import annotations

import logging

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from apps.audit.services import record
from apps.fleet.models import Device, ExecutorKind, Host, InstanceState, TritonInstance
from backend_ge import npu_smi

log = logging.getLogger(__name__)


def register_host(*, name: str, address: str, labels: dict | None = None, team=None) -> Host:
    """Create or update the row of a host whose agent starts (idempotent: agents restart)."""
    host, created = Host.objects.get_or_create(
        name=name, defaults={"address": address, "labels": labels or {}, "team": team}
    )
    if not created:
        fields = {"address": address}
        if labels is not None:
            fields["labels"] = labels
        Host.objects.filter(pk=host.pk).update(**fields)
        host.refresh_from_db()
    else:
        host.full_clean()
    return host


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
        record(
            actor=actor,
            team=host.team,
            action="instance.created",
            target=instance,
            details={"host": host.name},
        )
    return instance


def request_instance_state(*, actor, instance: TritonInstance, action: str) -> TritonInstance:
    """start | stop | restart. The agent acts within a second; a start also lifts a quarantine."""
    from apps.fleet.tasks import restart_instance

    if action not in ("start", "stop", "restart"):
        raise ValidationError({"action": [f"'{action}' is not an action; use start, stop or restart."]})
    with transaction.atomic():
        fields: dict = {"desired_state": "STOPPED" if action == "stop" else "RUNNING"}
        if action in ("start", "restart") and instance.state in (
            InstanceState.QUARANTINED,
            InstanceState.FAILED,
        ):
            fields.update(state=InstanceState.STOPPED, crash_times=[], state_changed_at=timezone.now())
        TritonInstance.objects.filter(pk=instance.pk).update(**fields)
        record(actor=actor, team=instance.host.team, action=f"instance.{action}", target=instance)
        if action == "restart":
            transaction.on_commit(
                lambda: restart_instance.apply_async(args=[instance.pk], queue=instance.host.queue)
            )
    instance.refresh_from_db()
    return instance


def record_heartbeat(host_id: int, *, facts: dict, inventory: npu_smi.NpuInventory | None = None) -> None:
    """What the agent reports every 10 s: liveness, facts and the NPU inventory (when npu-smi exists)."""
    if inventory is None:
        try:
            inventory = npu_smi.read_inventory()
        except npu_smi.NpuSmiError as exc:
            log.warning("npu-smi failed: %s", exc)
    fields = {"last_heartbeat_at": timezone.now(), "facts": facts}
    if inventory is not None:
        fields["npu_driver_version"] = inventory.driver_version
    Host.objects.filter(pk=host_id).update(**fields)
    if inventory is not None:
        sync_devices(host_id, inventory)


def sync_devices(host_id: int, inventory: npu_smi.NpuInventory) -> None:
    seen = []
    for chip in inventory.chips:
        device, _ = Device.objects.update_or_create(
            host_id=host_id,
            npu_id=chip.npu_id,
            chip_id=chip.chip_id,
            defaults={
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
            },
        )
        seen.append(device.pk)
    Device.objects.filter(host_id=host_id).exclude(pk__in=seen).delete()
