"""Devices are the platform's: drop DEVICE_ID/device_ids from stored configs and serving options.

Configs generated before this change carried the devices a tenant chose at upload; the host agent now
refuses a config with them and sets the placing instance's devices itself.
"""

from django.db import migrations

DEVICE_PARAMETERS = ("DEVICE_ID", "device_ids")


def strip_device_parameters(apps, schema_editor):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    ModelVersion = apps.get_model("registry", "ModelVersion")
    for version in ModelVersion.objects.exclude(config_text="").iterator():
        changed = []
        try:
            cfg = text_format.Parse(version.config_text, mc.ModelConfig())
        except text_format.ParseError:
            cfg = None  # not the platform's rendering; the agent reports it
        if cfg is not None and any(key in cfg.parameters for key in DEVICE_PARAMETERS):
            for key in DEVICE_PARAMETERS:
                cfg.parameters.pop(key, None)
            version.config_text = text_format.MessageToString(cfg)
            changed.append("config_text")
        options = dict(version.serving_options or {})
        if "device_ids" in options:
            options.pop("device_ids")
            version.serving_options = options
            changed.append("serving_options")
        if changed:
            version.save(update_fields=changed)


class Migration(migrations.Migration):
    dependencies = [("registry", "0002_upload_options")]

    operations = [migrations.RunPython(strip_device_parameters, migrations.RunPython.noop)]
