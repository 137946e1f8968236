"""Versions get a free-text note, tags, and an archive time (archived versions are never "latest" nor deployable)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("registry", "0003_configs_without_device_parameters"),
    ]

    operations = [
        migrations.AddField(
            model_name="modelversion",
            name="archived_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="modelversion",
            name="note",
            field=models.TextField(blank=True, max_length=2000),
        ),
        migrations.AddField(
            model_name="modelversion",
            name="tags",
            field=models.JSONField(
                blank=True, default=list, help_text="Short labels, see apps.registry.services."
            ),
        ),
    ]
