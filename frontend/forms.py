from django import forms

from apps.core import priority
from apps.teams.models import Role
from apps.teams.services import MAX_REQUESTS_PER_SECOND


class TeamForm(forms.Form):
    name = forms.CharField(max_length=100)
    slug = forms.CharField(
        max_length=50,
        required=False,
        help_text="Lowercase letters, digits and hyphens. Derived from the name when empty.",
    )


class QuotaForm(forms.Form):
    quota_requests_per_second = forms.IntegerField(
        min_value=1, max_value=MAX_REQUESTS_PER_SECOND, label="Requests per second"
    )


class MemberForm(forms.Form):
    user = forms.CharField(max_length=150, label="Username or email")
    role = forms.ChoiceField(choices=Role.choices, initial=Role.VIEWER)


class RoleForm(forms.Form):
    role = forms.ChoiceField(choices=Role.choices)


class PriorityClassForm(forms.Form):
    priority_class = forms.ChoiceField(choices=[("", "the team's default"), *priority.CHOICES])


class TokenForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="Where the token is used, e.g. 'CI pipeline'.")
    read_only = forms.BooleanField(required=False, label="Read-only")
    inference_only = forms.BooleanField(
        required=False,
        label="Inference only",
        help_text="Calls models through the gateway; the management API refuses it.",
    )
    priority_class = forms.ChoiceField(
        required=False,
        choices=[("", "the team's default"), *priority.CHOICES],
        label="Priority class",
        help_text="When a model is saturated, interactive requests are served before batch ones.",
    )
    expires_in_days = forms.IntegerField(
        required=False,
        min_value=1,
        max_value=3650,
        label="Expires in (days)",
        help_text="Empty: never expires.",
    )
