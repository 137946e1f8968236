import secrets

from django.db import migrations, models

import apps.fleet.models


def give_each_instance_its_own_key(apps, schema_editor):
    # AddField evaluates a callable default once for all existing rows; every instance needs its own secret.
    TritonInstance = apps.get_model("fleet", "TritonInstance")
    for instance in TritonInstance.objects.all():
        instance.api_key = secrets.token_hex(24)
        instance.save(update_fields=["api_key"])


class Migration(migrations.Migration):
    dependencies = [
        ("fleet", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="tritoninstance",
            name="api_key",
            field=models.CharField(default="", editable=False, max_length=64),
            preserve_default=False,
        ),
        migrations.RunPython(give_each_instance_its_own_key, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="tritoninstance",
            name="api_key",
            field=models.CharField(
                default=apps.fleet.models.new_instance_api_key, editable=False, max_length=64
            ),
        ),
    ]
