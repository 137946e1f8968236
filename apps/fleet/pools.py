"""Pools: which hosts the scheduler may place replicas on, and the instances the platform makes from each
member host's inventory. Cordon and drain mark a host; ``apps.deployments.scheduler`` acts on the marks.

A host joins a pool by its label ``pool=<name>``. When a member's agent reports its devices and the port
range it owns, the pool's template decides the host's instances: one CPU instance, or one NPU instance per
group of ``devices_per_instance`` chips. Ports are taken from the agent's range, three per instance (HTTP,
gRPC, metrics), skipping those any instance of the host (hand-declared ones too) already uses.
"""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from apps.audit.services import record
from apps.fleet.models import (
    DesiredInstanceState,
    ExecutorKind,
    Host,
    InstanceState,
    Pool,
    TritonInstance,
    check_labels,
)
from backend_ge import npu_smi

POOL_LABEL = "pool"
PORTS_PER_INSTANCE = 3


def pool_named_by(labels: dict) -> Pool | None:
    name = (labels or {}).get(POOL_LABEL)
    return Pool.objects.filter(name=name).first() if isinstance(name, str) and name else None


def create_pool(
    *,
    actor,
    name: str,
    executor: str = ExecutorKind.CPU,
    team=None,
    devices_per_instance: int = 1,
    memory_budget_mb: int = 4096,
    hbm_reserve_mb: int = 1024,
) -> Pool:
    """Staff create a pool; hosts already labelled ``pool=<name>`` join it at once."""
    with transaction.atomic():
        if Pool.objects.filter(name=name).exists():
            raise ValidationError({"name": [f"A pool named '{name}' already exists."]})
        pool = Pool(
            name=name,
            executor=executor,
            team=team,
            devices_per_instance=devices_per_instance,
            memory_budget_mb=memory_budget_mb,
            hbm_reserve_mb=hbm_reserve_mb,
        )
        pool.full_clean()
        pool.save()
        joined = Host.objects.filter(**{f"labels__{POOL_LABEL}": name}).update(pool=pool)
        record(actor=actor, team=team, action="pool.created", target=pool, details={"hosts": joined})
    return pool


def update_pool(*, actor, pool: Pool, **fields) -> Pool:
    """Staff change a pool's placement policy or template. A CPU pool's member instances get the new budget
    at once; an NPU pool's hosts get their instances re-made from the template at their next heartbeat (it
    carries the inventory). Instances the template no longer wants are removed once they hold no replica
    (``retire_unwanted``)."""
    with transaction.atomic():
        pool = Pool.objects.select_for_update().get(pk=pool.pk)
        before = {name: getattr(pool, name) for name in fields}
        for name, value in fields.items():
            setattr(pool, name, value)
        pool.full_clean()
        pool.save()
        changed = {name: [before[name], value] for name, value in fields.items() if before[name] != value}
        if pool.executor == ExecutorKind.CPU:
            for host in Host.objects.filter(pool=pool):
                sync_template_instances(host, None)
        record(actor=actor, team=pool.team, action="pool.updated", target=pool, details=changed)
    return pool


def join_labelled_pool(host: Host) -> None:
    """A host whose label names a pool joins it (at creation, and on a heartbeat while it is in none)."""
    pool = pool_named_by(host.labels)
    if pool is not None and host.pool_id != pool.pk:
        Host.objects.filter(pk=host.pk).update(pool=pool)
        host.pool = pool


def _free_ports(host: Host, first: int, last: int, taken: set[int], count: int) -> list[int] | None:
    ports = [port for port in range(first, last + 1) if port not in taken][:count]
    return ports if len(ports) == count else None


def template_instances(pool: Pool, inventory: npu_smi.NpuInventory | None) -> list[dict]:
    """What the pool's template makes of a host with this inventory: name, devices, executor, capacity."""
    if pool.executor == ExecutorKind.CPU:
        return [{"name": "cpu-0", "device_ids": [], "executor": ExecutorKind.CPU,
                 "capacity_mb": pool.memory_budget_mb}]  # fmt: skip
    chips = sorted(inventory.chips if inventory else [], key=lambda c: (c.npu_id, c.chip_id))
    size = max(1, pool.devices_per_instance)
    wanted = []
    for start in range(0, len(chips) - size + 1, size):
        group = chips[start : start + size]
        hbm = sum(
            max(0, (chip.hbm_total_mb or chip.memory_total_mb or 0) - pool.hbm_reserve_mb) for chip in group
        )
        wanted.append(
            {
                "name": f"npu-{group[0].npu_id}-{group[0].chip_id}",
                "device_ids": [
                    chip.device_id if chip.device_id is not None else chip.npu_id for chip in group
                ],
                "executor": ExecutorKind.NPU,
                "capacity_mb": hbm,
            }
        )
    return wanted


def sync_template_instances(host: Host, inventory: npu_smi.NpuInventory | None) -> list[TritonInstance]:
    """Make the host's template instances what its pool's template wants: create the missing ones (once the
    agent reported its port range), update a changed capacity, and mark those no longer wanted (the host's
    devices shrank, the template changed, the host left its pool) ``unwanted_since``: the scheduler gives them
    no new replicas and moves theirs away, then ``remove_unwanted`` stops and deletes them. Returns the
    instances created. An NPU pool's template needs the inventory: without one nothing changes."""
    pool = Pool.objects.filter(pk=host.pool_id).first() if host.pool_id is not None else None
    existing = {i.name: i for i in TritonInstance.objects.filter(host=host)}
    # Another pool's template instances (the host changed pools) are unwanted whatever their names.
    others = [i.pk for i in existing.values() if _from_another_pool(i, pool) and i.unwanted_since is None]
    if others:
        TritonInstance.objects.filter(pk__in=others).update(unwanted_since=timezone.now())
    if pool is not None and pool.executor == ExecutorKind.NPU and inventory is None:
        return []  # no inventory reported yet: nothing to count
    wanted = template_instances(pool, inventory) if pool is not None else []
    names = {spec["name"] for spec in wanted}
    unwanted = [
        i.pk
        for i in existing.values()
        if i.from_template and i.name not in names and i.unwanted_since is None and i.pk not in others
    ]
    if unwanted:
        TritonInstance.objects.filter(pk__in=unwanted).update(unwanted_since=timezone.now())
    created = []
    for spec in wanted:
        have = existing.get(spec["name"])
        if have is not None:
            if _from_another_pool(have, pool):
                continue  # made once the old pool's instance of that name is drained and removed
            if have.from_template and (have.capacity_mb != spec["capacity_mb"] or have.unwanted_since):
                # Wanted again before it was removed: it stays (and runs, if it had been stopped for removal).
                TritonInstance.objects.filter(pk=have.pk).update(
                    capacity_mb=spec["capacity_mb"], unwanted_since=None,
                    desired_state=DesiredInstanceState.RUNNING,
                )  # fmt: skip
            continue
        if host.port_range_first is None or host.port_range_last is None:
            continue
        taken = {p for i in existing.values() for p in (i.http_port, i.grpc_port, i.metrics_port)}
        ports = _free_ports(host, host.port_range_first, host.port_range_last, taken, PORTS_PER_INSTANCE)
        if ports is None:
            break  # the range is full: the host page shows fewer instances than devices
        instance = TritonInstance.objects.create(
            host=host,
            http_port=ports[0],
            grpc_port=ports[1],
            metrics_port=ports[2],
            from_template=True,
            template_pool=pool,
            **spec,
        )
        existing[instance.name] = instance
        created.append(instance)
    if created:
        # The agent's next desired-state poll picks the new instances up (as ``services.notify_hosts``).
        Host.objects.filter(pk=host.pk).update(desired_generation=F("desired_generation") + 1)
    return created


def _from_another_pool(instance: TritonInstance, pool: Pool | None) -> bool:
    """A template instance another pool's template made (one without the mark counts as its host's pool's)."""
    made_by = instance.template_pool_id
    return instance.from_template and made_by is not None and made_by != getattr(pool, "pk", None)


def set_labels(*, actor, host: Host, labels: dict) -> Host:
    """Staff change a host's labels (checked: ``check_labels``); its pool follows its ``pool`` label. A host
    that leaves a pool (for another or none) has its template instances marked unwanted: the scheduler moves
    their replicas away one at a time, then they are stopped and removed (``apps.deployments.healing``), and
    the new pool's template makes the host's instances anew (a CPU pool's now, an NPU pool's at the agent's
    next heartbeat, which carries the inventory). Instances declared by hand stay."""
    labels = check_labels(labels)
    with transaction.atomic():
        host = Host.objects.select_for_update().get(pk=host.pk)
        before, old_pool = host.labels, host.pool
        new_pool = pool_named_by(labels)
        if old_pool is not None:
            # Which pool made them, for rows from before the mark existed.
            host.instances.filter(from_template=True, template_pool__isnull=True).update(
                template_pool=old_pool
            )
        Host.objects.filter(pk=host.pk).update(labels=labels, pool=new_pool)
        host.labels, host.pool = labels, new_pool
        unwanted = created = []
        if new_pool != old_pool:
            already = set(host.instances.filter(unwanted_since__isnull=False).values_list("pk", flat=True))
            created = sync_template_instances(host, None)
            unwanted = list(
                host.instances.filter(unwanted_since__isnull=False).exclude(pk__in=already).order_by("name")
            )
            Host.objects.filter(pk=host.pk).update(desired_generation=F("desired_generation") + 1)
        record(
            actor=actor,
            team=host.team,
            action="host.labels_changed",
            target=host,
            details={
                "from": before,
                "to": labels,
                "pool": [getattr(old_pool, "name", None), getattr(new_pool, "name", None)],
                "instances_unwanted": [i.name for i in unwanted],
                "instances_created": [i.name for i in created],
            },
        )
    host.refresh_from_db()
    return host


def remove_unwanted(emptied: list[int]) -> int:
    """Unwanted template instances that hold no replica any more (``emptied``: the scheduler's word): first
    stopped (the agent stops the server), then, once stopped or their host is gone, deleted. Returns how many
    were deleted."""
    rows = TritonInstance.objects.filter(pk__in=emptied, unwanted_since__isnull=False, from_template=True)
    to_stop = list(rows.filter(desired_state=DesiredInstanceState.RUNNING).values_list("host_id", flat=True))
    if to_stop:
        rows.filter(desired_state=DesiredInstanceState.RUNNING).update(
            desired_state=DesiredInstanceState.STOPPED
        )
        Host.objects.filter(pk__in=set(to_stop)).update(desired_generation=F("desired_generation") + 1)
    # Stopped - or on a host that will never run it again (revoked, or no heartbeat past the grace).
    gone = rows.filter(desired_state=DesiredInstanceState.STOPPED).filter(
        Q(state__in=[InstanceState.STOPPED, InstanceState.FAILED, InstanceState.QUARANTINED])
        | Q(host__revoked_at__isnull=False)
    )
    hosts = set(gone.values_list("host_id", flat=True))
    deleted = 0
    for instance in gone:
        record(actor=None, team=None, action="instance.removed", target=instance,
               details={"host": instance.host_id, "why": "no longer wanted by the pool template"})  # fmt: skip
        instance.delete()
        deleted += 1
    if hosts:
        Host.objects.filter(pk__in=hosts).update(desired_generation=F("desired_generation") + 1)
    return deleted


def set_cordon(*, actor, host: Host, cordoned: bool, drain: bool = False) -> Host:
    """Cordon (no new replicas), drain (cordon, and move its replicas away one at a time) or uncordon."""
    now = timezone.now()
    with transaction.atomic():
        fields = {
            "cordoned_at": now if cordoned else None,
            "draining_at": now if (cordoned and drain) else None,
        }
        if cordoned and not drain and host.draining_at is not None:
            fields["draining_at"] = host.draining_at  # cordoning a draining host keeps it draining
        Host.objects.filter(pk=host.pk).update(**fields)
        action = "host.drain" if drain else "host.cordon" if cordoned else "host.uncordon"
        record(actor=actor, team=host.team, action=action, target=host)
    host.refresh_from_db()
    return host
