from django.contrib import admin

from apps.teams.models import ApiToken, Membership, Team


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    list_display = ("name", "slug", "created_at")
    search_fields = ("name", "slug")
    inlines = [MembershipInline]


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = (
        "display_prefix",
        "name",
        "team",
        "read_only",
        "created_by",
        "expires_at",
        "last_used_at",
        "revoked_at",
    )
    list_filter = ("team", "read_only")
    readonly_fields = ("prefix", "secret_hash", "created_by", "last_used_at")
