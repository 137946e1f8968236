from django.apps import AppConfig


class ConversionsConfig(AppConfig):
    name = "apps.conversions"
    label = "conversions"
    verbose_name = "Conversion jobs"

    def ready(self) -> None:
        from apps.registry.signals import version_uploaded

        version_uploaded.connect(
            _convert_uploaded_version, dispatch_uid="conversions.convert_uploaded_version"
        )


def _convert_uploaded_version(sender, *, actor, version, options, **kwargs) -> None:
    from apps.conversions.services import start_conversion

    start_conversion(actor=actor, version=version, options=options)
