from django.contrib import admin

from apps.teams.models import ApiToken, Membership, Team, TeamInvitation


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    list_display = ("name", "slug", "quota_model_instances", "quota_requests_per_second", "created_at")
    search_fields = ("name", "slug")
    # Changed through apps.teams.services.set_request_rate_quota (bounded and audited): the team API or page.
    readonly_fields = ("quota_requests_per_second",)
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


@admin.register(TeamInvitation)
class TeamInvitationAdmin(admin.ModelAdmin):
    list_display = ("invitee", "team", "role", "invited_by", "created_at", "expires_at", "status")
    list_filter = ("team", "role")
    search_fields = ("invitee",)
    readonly_fields = ("invited_by", "accepted_by", "created_at")
