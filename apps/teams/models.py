"""Teams are the tenants of the platform: every tenant-owned row has a ``team`` foreign key, and the
queryset method ``for_user(user, action)`` (``apps.core.scoping``) is the one place that decides what a user
may see."""

from __future__ import annotations

import hashlib
from datetime import datetime

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.utils import timezone

from apps.core import priority
from apps.core.credentials import TEAM_TOKEN_SCHEME
from apps.core.scoping import (  # noqa: F401 - importable with the models they scope
    ACTION_MIN_ROLE,
    ROLE_RANK,
    Action,
    Role,
    TeamScopedQuerySet,
    role_allows,
    team_ids_for,
    team_roles,
)
from backend_ge import naming
from backend_ge.served_config import MAX_INSTANCE_COUNT


class TeamQuerySet(TeamScopedQuerySet):
    team_lookup = "pk"


# Slugs are part of Triton model names (backend_ge.naming), so their alphabet is defined there.
slug_validator = RegexValidator(rf"^{naming.SLUG_PATTERN}$", f"Use {naming.SLUG_RULE}.")


def default_requests_per_second() -> int:
    return settings.GATEWAY_DEFAULT_REQUESTS_PER_SECOND


class Team(models.Model):
    """A tenant: its members share models, deployments and tokens; nobody else sees them."""

    name = models.CharField(max_length=100)
    # Part of Triton model names and artifact paths, so restricted to a safe alphabet.
    slug = models.CharField(max_length=naming.SLUG_MAX_LENGTH, unique=True, validators=[slug_validator])
    # The chip ATC compiles for unless a conversion says otherwise (`npu-smi info` Name with "Ascend" prefixed).
    default_soc_version = models.CharField(max_length=32, default="Ascend310P3")
    quota_deployed_models = models.PositiveIntegerField(default=50, help_text="Models deployed at once.")
    quota_instances = models.PositiveIntegerField(
        default=8, help_text="Triton instances the team's deployments use."
    )
    quota_model_instances = models.PositiveIntegerField(
        default=MAX_INSTANCE_COUNT,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_INSTANCE_COUNT)],
        help_text="Model instances (python stub processes) one served model may run per Triton instance",
    )
    quota_requests_per_second = models.PositiveIntegerField(
        default=default_requests_per_second,
        help_text="Inference requests per second through the gateway, over all the team's models and tokens.",
    )
    default_priority_class = models.CharField(
        max_length=16,
        choices=priority.CHOICES,
        default=priority.DEFAULT_CLASS,
        help_text="The priority class of the team's tokens that do not name one (apps.core.priority).",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TeamQuerySet.as_manager()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def model_instance_limit(self) -> int:
        """How many model instances (``instance_group`` counts summed) a config of this team may ask for."""
        return max(1, min(self.quota_model_instances, MAX_INSTANCE_COUNT))

    def owner_count(self) -> int:
        return self.memberships.filter(role=Role.OWNER).count()


class MembershipSource(models.TextChoices):
    # Granted in the platform (staff, an accepted invitation, team creation): single sign-on leaves it alone.
    LOCAL = "local", "granted in the platform"
    # Granted from the identity provider's group claim: it follows the claim at every sign-in.
    SSO = "sso", "single sign-on group"


class Membership(models.Model):
    """A user's role in a team: viewer reads; maintainer changes models and deployments; owner also
    manages members and tokens."""

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=20, choices=Role.choices, default=Role.VIEWER)
    source = models.CharField(max_length=8, choices=MembershipSource.choices, default=MembershipSource.LOCAL)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TeamScopedQuerySet.as_manager()

    class Meta:
        ordering = ["team", "user__username"]
        constraints = [models.UniqueConstraint(fields=["team", "user"], name="unique_membership")]

    def __str__(self) -> str:
        return f"{self.user} in {self.team} ({self.role})"


class SsoIdentity(models.Model):
    """The identity provider's account behind a platform user: its subject is the stable link (usernames and
    emails can be reused or changed at the provider, so they never link an account)."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="sso_identity"
    )
    issuer = models.CharField(max_length=255)
    subject = models.CharField(max_length=255)
    created_at = models.DateTimeField(auto_now_add=True)
    last_sign_in_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["issuer", "subject"], name="unique_sso_subject")]

    def __str__(self) -> str:
        return f"{self.subject} at {self.issuer}"


TOKEN_SCHEME = TEAM_TOKEN_SCHEME


def hash_token_secret(secret: str) -> str:
    # The secret is 256 random bits, so a fast hash is enough: there is nothing to brute-force.
    return hashlib.sha256(secret.encode()).hexdigest()


class TokenQuerySet(TeamScopedQuerySet):
    def with_creator_role(self):
        """Annotate ``creator_role``: the creator's role in the token's team now (None once they left the team
        or their account was deactivated; authentication then refuses the token)."""
        role = Membership.objects.filter(
            team=models.OuterRef("team"), user=models.OuterRef("created_by"), user__is_active=True
        ).values("role")[:1]
        return self.annotate(creator_role=models.Subquery(role))


class ApiToken(models.Model):
    """A team-scoped API credential: ``tgp_<prefix>_<secret>``.

    The prefix is stored in clear so a token can be recognised in lists and logs; the secret is shown
    once at creation and stored only as a hash. A token acts with its creator's role in its team (at most
    viewer when read-only) and stops working when it expires, is revoked, or its creator leaves the team.
    """

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="tokens")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True)
    secret_hash = models.CharField(max_length=64)
    read_only = models.BooleanField(default=False)
    # Inference-only tokens call models through the gateway and nothing else: the management API refuses them.
    inference_only = models.BooleanField(default=False)
    # Blank: the team's default_priority_class (followed when the team changes it).
    priority_class = models.CharField(max_length=16, choices=priority.CHOICES, blank=True, default="")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = TokenQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.display_prefix} ({self.name})"

    def _creator_role(self) -> str | None:
        if hasattr(self, "creator_role"):  # annotated by TokenQuerySet.with_creator_role
            return self.creator_role
        if not self.created_by.is_active:
            return None
        return (
            Membership.objects.filter(team_id=self.team_id, user_id=self.created_by_id)
            .values_list("role", flat=True)
            .first()
        )

    @property
    def access(self) -> str:
        """What the token may do, as authentication grants it: its flags narrowed by its creator's role."""
        if self.inference_only:
            return "inference only"
        role = self._creator_role()
        if role is None:
            return "none"
        if self.read_only or role == Role.VIEWER:
            return "read-only"
        return "read-write, manage" if role == Role.OWNER else "read-write"

    @property
    def effective_priority_class(self) -> str:
        return self.priority_class or self.team.default_priority_class

    @property
    def display_prefix(self) -> str:
        return f"{TOKEN_SCHEME}_{self.prefix}"

    def is_expired(self, now: datetime | None = None) -> bool:
        return self.expires_at is not None and self.expires_at <= (now or timezone.now())

    def is_active(self, now: datetime | None = None) -> bool:
        return self.revoked_at is None and not self.is_expired(now)

    @property
    def status(self) -> str:
        """revoked, expired, inactive (its creator is no longer an active member: refused) or active."""
        if self.revoked_at is not None:
            return "revoked"
        if self.is_expired():
            return "expired"
        return "active" if self._creator_role() is not None else "inactive"


def normalise_invitee(identifier: str) -> str:
    """An invited username or email as stored and matched: trimmed; an email (anything with an @) lowercased."""
    identifier = identifier.strip()
    return identifier.lower() if "@" in identifier else identifier


class InvitationQuerySet(TeamScopedQuerySet):
    def pending(self, now: datetime | None = None):
        """Neither accepted, declined nor revoked, and not expired."""
        return self.filter(
            accepted_at__isnull=True,
            declined_at__isnull=True,
            revoked_at__isnull=True,
            expires_at__gt=now or timezone.now(),
        )

    def addressed_to(self, user):
        """Invitations whose invitee (as typed by the owner) is this user's username or email."""
        names = {normalise_invitee(user.get_username())}
        if user.email:
            names.add(normalise_invitee(user.email))
        names.discard("")
        return self.filter(invitee__in=names)


class TeamInvitation(models.Model):
    """An owner's request that someone join the team. It names the invitee as typed (never resolved to an
    account when created, so the owner cannot learn whether the account exists); the user whose username or
    email matches accepts or declines it."""

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="invitations")
    invitee = models.CharField(max_length=254, help_text="Username or email as typed, normalised.")
    role = models.CharField(max_length=20, choices=Role.choices, default=Role.VIEWER)
    invited_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    accepted_at = models.DateTimeField(null=True, blank=True)
    accepted_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    declined_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = InvitationQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["invitee"], name="teaminvitation_invitee")]

    def __str__(self) -> str:
        return f"{self.invitee} to {self.team} ({self.role})"

    @property
    def status(self) -> str:
        """accepted, declined, revoked, expired or pending."""
        if self.accepted_at is not None:
            return "accepted"
        if self.declined_at is not None:
            return "declined"
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at <= timezone.now():
            return "expired"
        return "pending"
