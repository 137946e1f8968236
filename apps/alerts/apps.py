from django.apps import AppConfig


class AlertsConfig(AppConfig):
    name = "apps.alerts"
    label = "alerts"
    verbose_name = "Alerts and notifications"

    def ready(self) -> None:
        from apps.alerts import receivers  # noqa: F401 - connects the default rules to new deployments
