from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.contrib.auth.forms import AuthenticationForm
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.paginator import Paginator
from django.http import HttpResponseBadRequest
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST

from apps.audit.models import AuditEvent
from apps.fleet.models import is_platform_staff
from apps.gateway.metrics import gateway_wide_summary
from apps.teams import services
from apps.teams.models import Action, ApiToken, Membership, Team, TeamInvitation
from frontend.context_processors import current_team
from frontend.forms import MemberForm, PriorityClassForm, QuotaForm, RoleForm, TeamForm, TokenForm
from frontend.pages import TeamPageView
from frontend.sso import sign_in_context
from frontend.status import team_status


def sign_in_locked(request, original_response=None, credentials=None):
    """django-axes' answer to a sign-in while its username or address is locked: the sign-in page again,
    saying why and for how long (429)."""
    minutes = int(settings.AXES_COOLOFF_TIME.total_seconds() // 60)
    username = (credentials or {}).get("username") or request.POST.get("username", "")
    form = AuthenticationForm(request, initial={"username": username})
    message = (
        f"Too many failed sign-ins for this account or from your address: signing in is locked for "
        f"{minutes} minutes after the last failed try. Wait, or ask an operator to unlock it."
    )
    context = {"form": form, "locked_message": message, **sign_in_context()}
    return render(request, "registration/login.html", context, status=429)


def add_service_errors(form, error: ValidationError) -> None:
    """Show a service's validation errors next to the matching form fields."""
    for field, messages_ in (
        error.message_dict.items() if hasattr(error, "error_dict") else [(None, error.messages)]
    ):
        target = field if field in form.fields else None
        for message in messages_:
            form.add_error(target, message)


@login_required
def dashboard(request):
    team = current_team(request)
    context: dict = {"team": team}
    if team is not None:
        context.update(
            team_count=Team.objects.for_user(request.user, Action.VIEW).count(),
            member_count=team.memberships.count(),
            active_token_count=ApiToken.objects.filter(team=team, revoked_at__isnull=True)
            .exclude(expires_at__lte=timezone.now())
            .count(),
            event_count_24h=AuditEvent.objects.filter(
                team=team, created_at__gte=timezone.now() - timedelta(hours=24)
            ).count(),
            recent_events=AuditEvent.objects.for_user(request.user).filter(team=team)[:10],
            status=team_status(request.user, team),
        )
    context["invitations"] = (
        TeamInvitation.objects.addressed_to(request.user).pending().select_related("team", "invited_by")
    )
    if is_platform_staff(request.user):
        context["gateway_wide"] = gateway_wide_summary(timezone.now() - timedelta(hours=1))
    return render(request, "frontend/dashboard.html", context)


@login_required
@require_POST
def answer_invitation(request, pk: int, answer: str):
    """Accept or decline an invitation addressed to the signed-in user (404 for anyone else's)."""
    try:
        if answer == "accept":
            membership = services.accept_invitation(user=request.user, invitation_id=pk)
            request.session["team_slug"] = membership.team.slug
            messages.success(request, f"You joined {membership.team.name} as {membership.role}.")
        else:
            invitation = services.decline_invitation(user=request.user, invitation_id=pk)
            messages.success(request, f"Invitation to {invitation.team.name} declined.")
    except ValidationError as error:
        messages.error(request, " ".join(error.messages))
    return redirect("dashboard")


@login_required
@require_POST
def switch_team(request):
    team = get_object_or_404(
        Team.objects.for_user(request.user, Action.VIEW), slug=request.POST.get("team", "")
    )
    request.session["team_slug"] = team.slug
    next_url = request.POST.get("next") or "/"
    if not url_has_allowed_host_and_scheme(next_url, allowed_hosts={request.get_host()}):
        next_url = "/"
    # A page of the previous team makes no sense for the new one: go to the same page of the new team.
    previous = request.POST.get("previous", "")
    if previous and f"/teams/{previous}/" in next_url:
        next_url = next_url.replace(f"/teams/{previous}/", f"/teams/{team.slug}/", 1)
    return redirect(next_url)


@login_required
def team_new(request):
    form = TeamForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            team = services.create_team(
                actor=request.user, name=form.cleaned_data["name"], slug=form.cleaned_data["slug"] or None
            )
        except ValidationError as error:
            add_service_errors(form, error)
        else:
            request.session["team_slug"] = team.slug
            messages.success(request, f"Team {team.name} created. You are its owner.")
            return redirect("team-settings", team_slug=team.slug)
    return render(request, "frontend/team_new.html", {"form": form})


class TeamSettingsView(TeamPageView):
    """Members and tokens of one team. Everyone in the team sees members; owners manage both."""

    template_name = "frontend/team_settings.html"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context.setdefault("member_form", MemberForm())
        context.setdefault("token_form", TokenForm())
        context.setdefault("team_form", TeamForm(initial={"name": self.team.name, "slug": self.team.slug}))
        context["memberships"] = (
            Membership.objects.for_user(self.request.user).filter(team=self.team).select_related("user")
        )
        context["role_choices"] = RoleForm.base_fields["role"].choices
        context["can_set_quotas"] = services.may_change_quotas(self.request.user)
        context.setdefault("quota_form", QuotaForm())
        if self.can(Action.MANAGE):
            context["invitations"] = (
                TeamInvitation.objects.for_user(self.request.user, Action.MANAGE)
                .filter(team=self.team)
                .pending()
                .select_related("invited_by")
            )
            context["tokens"] = (
                ApiToken.objects.for_user(self.request.user, Action.MANAGE)
                .filter(team=self.team)
                .select_related("created_by", "team")
                .with_creator_role()
            )
            context["priority_choices"] = PriorityClassForm.base_fields["priority_class"].choices
            # The plaintext is handed over exactly once, through the session, then dropped.
            context["new_token"] = self.request.session.pop("new_token", None)
        return context

    def post(self, request, *args, **kwargs):
        operation = request.POST.get("op", "")
        handler = getattr(self, f"op_{operation}", None)
        if handler is None:
            return HttpResponseBadRequest(f"Unknown operation '{operation}'.")
        return handler(request)

    def _membership(self, request) -> Membership:
        return get_object_or_404(
            Membership.objects.for_user(request.user).filter(team=self.team),
            pk=request.POST.get("membership"),
        )

    def _done(self, text: str):
        messages.success(self.request, text)
        return redirect("team-settings", team_slug=self.team.slug)

    def _invalid(self, **forms):
        return self.render_to_response(self.get_context_data(**forms), status=400)

    def op_rename(self, request):
        self.require(Action.MANAGE)
        form = TeamForm(request.POST)
        if form.is_valid():
            try:
                services.rename_team(actor=request.user, team=self.team, name=form.cleaned_data["name"])
            except ValidationError as error:
                add_service_errors(form, error)
            else:
                return self._done("Team renamed.")
        return self._invalid(team_form=form)

    def op_set_quota(self, request):
        if not services.may_change_quotas(request.user):
            raise PermissionDenied("Only platform staff change a team's quotas.")
        form = QuotaForm(request.POST)
        if form.is_valid():
            try:
                services.set_request_rate_quota(
                    actor=request.user,
                    team=self.team,
                    requests_per_second=form.cleaned_data["quota_requests_per_second"],
                )
            except ValidationError as error:
                add_service_errors(form, error)
            else:
                return self._done("Request rate quota set.")
        return self._invalid(quota_form=form)

    def op_add_member(self, request):
        self.require(Action.MANAGE)
        form = MemberForm(request.POST)
        if form.is_valid():
            identifier, role = form.cleaned_data["user"], form.cleaned_data["role"]
            try:
                if services.may_learn_accounts(request.user):
                    membership = services.add_member(
                        actor=request.user, team=self.team, user_identifier=identifier, role=role
                    )
                    return self._done(f"{membership.user.get_username()} added as {membership.role}.")
                services.invite_member(
                    actor=request.user, team=self.team, user_identifier=identifier, role=role
                )
            except ValidationError as error:
                add_service_errors(form, error)
            else:
                # One message whether the account exists or not (see services.invite_member).
                return self._done(
                    services.member_request_message(team=self.team, user_identifier=identifier, role=role)
                )
        return self._invalid(member_form=form)

    def op_revoke_invitation(self, request):
        self.require(Action.MANAGE)
        invitation = get_object_or_404(
            TeamInvitation.objects.for_user(request.user, Action.MANAGE).filter(team=self.team).pending(),
            pk=request.POST.get("invitation"),
        )
        services.revoke_invitation(actor=request.user, invitation=invitation)
        return self._done(f"Invitation of {invitation.invitee} revoked.")

    def op_change_role(self, request):
        self.require(Action.MANAGE)
        membership = self._membership(request)
        form = RoleForm(request.POST)
        try:
            if not form.is_valid():
                raise ValidationError({"role": ["Pick owner, maintainer or viewer."]})
            services.change_member_role(
                actor=request.user, membership=membership, role=form.cleaned_data["role"]
            )
        except ValidationError as error:
            messages.error(request, " ".join(error.messages))
            return redirect("team-settings", team_slug=self.team.slug)
        return self._done(f"{membership.user.get_username()} is now {membership.role}.")

    def op_remove_member(self, request):
        self.require(Action.MANAGE)
        membership = self._membership(request)
        try:
            services.remove_member(actor=request.user, membership=membership)
        except ValidationError as error:
            messages.error(request, " ".join(error.messages))
            return redirect("team-settings", team_slug=self.team.slug)
        return self._done(f"{membership.user.get_username()} removed from the team.")

    def op_create_token(self, request):
        self.require(Action.MANAGE)
        form = TokenForm(request.POST)
        if form.is_valid():
            days = form.cleaned_data["expires_in_days"]
            try:
                token, plaintext = services.create_token(
                    actor=request.user,
                    team=self.team,
                    name=form.cleaned_data["name"],
                    read_only=form.cleaned_data["read_only"],
                    inference_only=form.cleaned_data["inference_only"],
                    priority_class=form.cleaned_data["priority_class"],
                    expires_at=timezone.now() + timedelta(days=days) if days else None,
                )
            except ValidationError as error:
                add_service_errors(form, error)
            else:
                request.session["new_token"] = {"name": token.name, "secret": plaintext}
                return redirect("team-settings", team_slug=self.team.slug)
        return self._invalid(token_form=form)

    def op_set_default_priority_class(self, request):
        self.require(Action.MANAGE)
        try:
            services.set_default_priority_class(
                actor=request.user, team=self.team, priority_class=request.POST.get("priority_class", "")
            )
        except ValidationError as error:
            messages.error(request, " ".join(error.messages))
            return redirect("team-settings", team_slug=self.team.slug)
        return self._done(f"Tokens without a class of their own are now {self.team.default_priority_class}.")

    def op_set_token_priority_class(self, request):
        self.require(Action.MANAGE)
        token = get_object_or_404(
            ApiToken.objects.for_user(request.user, Action.MANAGE).filter(team=self.team),
            pk=request.POST.get("token"),
        )
        try:
            services.set_token_priority_class(
                actor=request.user, token=token, priority_class=request.POST.get("priority_class", "")
            )
        except ValidationError as error:
            messages.error(request, " ".join(error.messages))
            return redirect("team-settings", team_slug=self.team.slug)
        return self._done(f"Token {token.display_prefix} is now {token.effective_priority_class}.")

    def op_revoke_token(self, request):
        self.require(Action.MANAGE)
        token = get_object_or_404(
            ApiToken.objects.for_user(request.user, Action.MANAGE).filter(team=self.team),
            pk=request.POST.get("token"),
        )
        services.revoke_token(actor=request.user, token=token)
        if request.headers.get("HX-Request"):
            return render(request, "frontend/partials/token_row.html", {"token": token, "can_manage": True})
        return self._done(f"Token {token.display_prefix} revoked.")


class AuditLogView(TeamPageView):
    template_name = "frontend/audit_log.html"
    page_size = 50

    def get_template_names(self):
        if self.request.headers.get("HX-Request"):
            return ["frontend/partials/audit_table.html"]
        return [self.template_name]

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        events = AuditEvent.objects.for_user(self.request.user).filter(team=self.team)
        action = self.request.GET.get("action", "").strip()
        if action:
            events = events.filter(action__startswith=action)
        actor = self.request.GET.get("actor", "").strip()
        if actor:
            events = events.filter(actor_label__icontains=actor)
        context["page"] = Paginator(events, self.page_size).get_page(self.request.GET.get("page"))
        context["action_filter"] = action
        context["actor_filter"] = actor
        context["actions"] = (
            AuditEvent.objects.filter(team=self.team)
            .order_by("action")
            .values_list("action", flat=True)
            .distinct()
        )
        return context
