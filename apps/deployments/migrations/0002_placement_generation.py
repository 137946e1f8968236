from django.db import migrations, models


def settled_placements_are_applied(apps, schema_editor):
    # Placements an agent already finished count as applied, so reconcile does not redo them after the upgrade.
    placement = apps.get_model("deployments", "DeploymentInstance")
    placement.objects.filter(state__in=["READY", "FAILED", "UNLOADED"]).update(applied_generation=1)


class Migration(migrations.Migration):
    dependencies = [("deployments", "0001_initial")]

    operations = [
        migrations.AddField(
            model_name="deploymentinstance",
            name="generation",
            field=models.PositiveIntegerField(default=1),
        ),
        migrations.AddField(
            model_name="deploymentinstance",
            name="applied_generation",
            field=models.PositiveIntegerField(default=0),
        ),
        migrations.RunPython(settled_placements_are_applied, migrations.RunPython.noop),
    ]
