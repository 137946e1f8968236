from django.db import migrations, models

# The GE backend's INVALID_ARG answers (reason INVALID_REQUEST) were counted as failures; they are the
# caller's error (a 400), counted apart from now on. The same move for the rows written before.
CLIENT_ERROR_REASONS = ("INVALID_REQUEST",)


def move_client_errors(apps, schema_editor):
    ModelMetrics = apps.get_model("monitoring", "ModelMetrics")
    changed = []
    rows = ModelMetrics.objects.filter(failure__gt=0).only("failure", "failure_reasons", "client_errors")
    for row in rows.iterator(chunk_size=2000):
        reasons = dict(row.failure_reasons or {})
        moved = sum(int(reasons.pop(reason, 0)) for reason in CLIENT_ERROR_REASONS)
        if moved:
            row.failure = max(0, row.failure - moved)
            row.client_errors += moved
            row.failure_reasons = reasons
            changed.append(row)
        if len(changed) >= 2000:
            ModelMetrics.objects.bulk_update(changed, ["failure", "failure_reasons", "client_errors"])
            changed = []
    ModelMetrics.objects.bulk_update(changed, ["failure", "failure_reasons", "client_errors"])


def move_back(apps, schema_editor):
    ModelMetrics = apps.get_model("monitoring", "ModelMetrics")
    changed = []
    for row in ModelMetrics.objects.filter(client_errors__gt=0).iterator(chunk_size=2000):
        reasons = dict(row.failure_reasons or {})
        reasons["INVALID_REQUEST"] = reasons.get("INVALID_REQUEST", 0) + row.client_errors
        row.failure += row.client_errors
        row.failure_reasons = reasons
        changed.append(row)
    ModelMetrics.objects.bulk_update(changed, ["failure", "failure_reasons"], batch_size=2000)


class Migration(migrations.Migration):
    dependencies = [
        ("monitoring", "0002_scrape_state_final_counts"),
    ]

    operations = [
        migrations.AddField(
            model_name="modelmetrics",
            name="client_errors",
            field=models.BigIntegerField(
                default=0, help_text="Requests refused as malformed (400): the caller's error, not a failure."
            ),
        ),
        migrations.RunPython(move_client_errors, move_back),
    ]
