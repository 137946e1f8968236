from django.apps import AppConfig


class DeploymentsConfig(AppConfig):
    name = "apps.deployments"
    label = "deployments"
    verbose_name = "Deployments"

    def ready(self) -> None:
        from apps.deployments import receivers  # noqa: F401 - answers the registry's version_retiring
