from django.apps import AppConfig


class TeamsConfig(AppConfig):
    name = "apps.teams"
    label = "teams"
    verbose_name = "Teams"

    def ready(self) -> None:
        from apps.teams import schema  # noqa: F401  registers the OpenAPI auth extension
