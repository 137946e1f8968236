"""Fill ``TritonInstance.reserved_mb`` from the placements already there (the scheduler keeps it from now on)."""

import math

from django.db import migrations

FOOTPRINT_BASE_MB = 64  # as apps.registry.models at the time of this migration
FOOTPRINT_MARGIN = 1.5


def footprint(version) -> int:
    if version is None:
        return 0
    if version.footprint_mb:
        return version.footprint_mb
    return FOOTPRINT_BASE_MB + math.ceil(version.size_bytes * FOOTPRINT_MARGIN / 2**20)


def backfill(apps, schema_editor):
    DeploymentInstance = apps.get_model("deployments", "DeploymentInstance")
    TritonInstance = apps.get_model("fleet", "TritonInstance")
    held: dict[int, int] = {}
    live = (
        DeploymentInstance.objects.exclude(state="UNLOADED")
        .exclude(deployment__state="UNDEPLOYED")
        .select_related("deployment__active_version", "deployment__target_version")
    )
    for placement in live.iterator():
        deployment = placement.deployment
        mb = footprint(deployment.active_version)
        if deployment.target_version_id != deployment.active_version_id:
            mb += footprint(deployment.target_version)
        held[placement.instance_id] = held.get(placement.instance_id, 0) + mb
    for instance_id, mb in held.items():
        TritonInstance.objects.filter(pk=instance_id).update(reserved_mb=mb)


class Migration(migrations.Migration):
    dependencies = [
        ("deployments", "0011_replica_samples"),
        ("fleet", "0008_instance_reserved_mb"),
    ]

    operations = [migrations.RunPython(backfill, migrations.RunPython.noop)]
