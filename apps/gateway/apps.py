from django.apps import AppConfig


class GatewayConfig(AppConfig):
    name = "apps.gateway"
    label = "gateway"
    verbose_name = "Inference gateway"

    def ready(self) -> None:
        from apps.gateway import signals  # noqa: F401 - connects the pokes
