import django.db.models.deletion
from django.db import migrations, models
from django.db.models import OuterRef, Subquery


def mark_template_pools(apps, schema_editor):
    """Template instances made before the mark: by their host's pool of now."""
    TritonInstance = apps.get_model("fleet", "TritonInstance")
    Host = apps.get_model("fleet", "Host")
    pool_of_host = Host.objects.filter(pk=OuterRef("host_id")).values("pool_id")[:1]
    TritonInstance.objects.filter(from_template=True).update(template_pool_id=Subquery(pool_of_host))


class Migration(migrations.Migration):
    dependencies = [
        ("fleet", "0008_instance_reserved_mb"),
    ]

    operations = [
        migrations.AddField(
            model_name="tritoninstance",
            name="template_pool",
            field=models.ForeignKey(
                blank=True,
                editable=False,
                help_text="The pool whose template made it: once its host leaves that pool it is no longer "
                "wanted, even where the new pool's template would make one of the same name.",
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="+",
                to="fleet.pool",
            ),
        ),
        migrations.RunPython(mark_template_pools, migrations.RunPython.noop),
    ]
