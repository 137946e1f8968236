from django.apps import AppConfig


class ConversionsConfig(AppConfig):
    name = "apps.conversions"
    label = "conversions"
    verbose_name = "Conversion jobs"

    def ready(self) -> None:
        from apps.conversions import receivers  # noqa: F401 - converts what the registry's uploads announce
