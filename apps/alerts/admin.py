from django.contrib import admin

from apps.alerts.models import Alert, AlertRule, NotificationChannel, NotificationDelivery, Silence


@admin.register(AlertRule)
class AlertRuleAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "team",
        "kind",
        "threshold",
        "window_minutes",
        "for_seconds",
        "severity",
        "enabled",
    )
    list_filter = ("kind", "enabled", "team")


@admin.register(Alert)
class AlertAdmin(admin.ModelAdmin):
    list_display = ("rule", "team", "subject", "state", "active_since", "fired_at", "resolved_at")
    list_filter = ("state", "team")


@admin.register(NotificationChannel)
class NotificationChannelAdmin(admin.ModelAdmin):
    list_display = ("name", "team", "kind", "enabled")


@admin.register(Silence)
class SilenceAdmin(admin.ModelAdmin):
    list_display = ("team", "rule", "starts_at", "ends_at", "comment")


@admin.register(NotificationDelivery)
class NotificationDeliveryAdmin(admin.ModelAdmin):
    list_display = ("created_at", "team", "channel", "status", "state", "attempts", "response_status")
    list_filter = ("state",)
