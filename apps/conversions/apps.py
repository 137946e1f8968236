from django.apps import AppConfig


class ConversionsConfig(AppConfig):
    name = "apps.conversions"
    label = "conversions"
    verbose_name = "Conversion jobs"
