from django.contrib import admin

from apps.audit.models import AuditEvent


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    list_display = ("created_at", "actor_label", "team", "action", "target_type", "target_label")
    list_filter = ("action", "team")
    search_fields = ("actor_label", "target_label", "action")

    def has_change_permission(self, request, obj=None):
        return False

    def has_add_permission(self, request):
        return False
