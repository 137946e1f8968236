from __future__ import annotations

from django.contrib.auth import get_user_model
from django_filters import rest_framework as filters
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action, api_view
from rest_framework.exceptions import NotFound, PermissionDenied
from rest_framework.response import Response

from apps.core import priority
from apps.teams import services
from apps.teams.models import Action, ApiToken, Membership, Team, TeamInvitation, team_roles
from apps.teams.viewsets import TeamScopedViewSet, check_team_action

User = get_user_model()


class TeamSerializer(serializers.ModelSerializer):
    slug = serializers.CharField(
        max_length=50, required=False, help_text="Derived from the name when omitted."
    )
    role = serializers.SerializerMethodField()
    member_count = serializers.IntegerField(source="memberships.count", read_only=True)

    class Meta:
        model = Team
        fields = [
            "slug",
            "name",
            "role",
            "member_count",
            "quota_requests_per_second",
            "default_priority_class",
            "created_at",
        ]
        read_only_fields = ["quota_requests_per_second", "default_priority_class", "created_at"]

    def get_role(self, team: Team) -> str | None:
        return team_roles(self.context["request"].user).get(team.pk)


class TeamUpdateSerializer(serializers.ModelSerializer):
    # Checked by services.check_requests_per_second (one message for every bad value).
    quota_requests_per_second = serializers.JSONField(
        required=False,
        allow_null=True,
        help_text="Platform staff only: inference requests per second the gateway admits for the team "
        f"(1-{services.MAX_REQUESTS_PER_SECOND}).",
    )

    default_priority_class = serializers.ChoiceField(
        choices=priority.CHOICES,
        required=False,
        help_text="Owners: the priority class of the team's tokens that name none.",
    )

    class Meta:
        model = Team
        fields = ["name", "quota_requests_per_second", "default_priority_class"]


class TeamViewSet(
    mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.CreateModelMixin, viewsets.GenericViewSet
):
    """Teams the caller belongs to. Anyone signed in can create a team and becomes its owner."""

    serializer_class = TeamSerializer
    lookup_field = "slug"
    ordering_fields = ["name", "slug", "created_at"]

    def get_queryset(self):
        if self.action in ("retrieve", "partial_update") and services.may_change_quotas(self.request.user):
            return Team.objects.prefetch_related("memberships")  # staff set any team's quotas
        return Team.objects.for_user(self.request.user, Action.VIEW).prefetch_related("memberships")

    def perform_create(self, serializer):
        if getattr(self.request.user, "api_token", None) is not None:
            raise PermissionDenied(
                "API tokens belong to one team and cannot create teams; sign in to create one."
            )
        data = serializer.validated_data
        serializer.instance = services.create_team(
            actor=self.request.user, name=data["name"], slug=data.get("slug")
        )

    @extend_schema(request=TeamUpdateSerializer, responses=TeamSerializer)
    def partial_update(self, request, slug=None):
        team = self.get_object()
        serializer = TeamUpdateSerializer(team, data=request.data, partial=True)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        if "name" in data or "default_priority_class" in data:
            check_team_action(request.user, team, Action.MANAGE)  # before anything is written
        if "quota_requests_per_second" in data:
            team = services.set_request_rate_quota(
                actor=request.user, team=team, requests_per_second=data["quota_requests_per_second"]
            )
        if "name" in data:
            services.rename_team(actor=request.user, team=team, name=data["name"])
        if "default_priority_class" in data:
            services.set_default_priority_class(
                actor=request.user, team=team, priority_class=data["default_priority_class"]
            )
        return Response(TeamSerializer(team, context={"request": request}).data)


class MembershipSerializer(serializers.ModelSerializer):
    user = serializers.CharField(
        write_only=True, help_text="Username or email of an existing user (create only)."
    )
    username = serializers.CharField(source="user.username", read_only=True)
    email = serializers.CharField(source="user.email", read_only=True)
    role = serializers.CharField(help_text="owner, maintainer or viewer.")

    class Meta:
        model = Membership
        fields = ["id", "user", "username", "email", "role", "created_at"]
        read_only_fields = ["id", "created_at"]


class MembershipRoleSerializer(serializers.Serializer):
    role = serializers.CharField(help_text="owner, maintainer or viewer.")


class MembershipFilter(filters.FilterSet):
    class Meta:
        model = Membership
        fields = ["role"]


class MembershipViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.DestroyModelMixin,
    TeamScopedViewSet,
):
    """A team's members. Every member can list them; only owners add, change roles and remove."""

    queryset = Membership.objects.select_related("user")
    serializer_class = MembershipSerializer
    filterset_class = MembershipFilter
    ordering_fields = ["created_at", "role", "user__username"]
    action_requirements = {
        "create": Action.MANAGE,
        "partial_update": Action.MANAGE,
        "destroy": Action.MANAGE,
    }

    @extend_schema(
        request=MembershipSerializer,
        responses={
            201: MembershipSerializer,
            202: inline_serializer("MemberRequest", {"message": serializers.CharField()}),
        },
    )
    def create(self, request, *args, **kwargs):
        """Platform staff add an existing account at once (201; 400 for an unknown account). A team owner
        invites (202): one message whether the account exists or not; the invited user accepts it."""
        serializer = MembershipSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        if services.may_learn_accounts(request.user):
            membership = services.add_member(
                actor=request.user, team=self.team, user_identifier=data["user"], role=data["role"]
            )
            return Response(MembershipSerializer(membership).data, status=status.HTTP_201_CREATED)
        services.invite_member(
            actor=request.user, team=self.team, user_identifier=data["user"], role=data["role"]
        )
        message = services.member_request_message(
            team=self.team, user_identifier=data["user"], role=data["role"]
        )
        return Response({"message": message}, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=MembershipRoleSerializer, responses=MembershipSerializer)
    def partial_update(self, request, team_slug=None, pk=None):
        membership = self.get_object()
        serializer = MembershipRoleSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        services.change_member_role(
            actor=request.user, membership=membership, role=serializer.validated_data["role"]
        )
        return Response(MembershipSerializer(membership).data)

    def perform_destroy(self, instance):
        services.remove_member(actor=self.request.user, membership=instance)


class TeamInvitationSerializer(serializers.ModelSerializer):
    invitee = serializers.CharField(read_only=True, help_text="The username or email as the owner typed it.")
    invited_by = serializers.CharField(source="invited_by.username", read_only=True, allow_null=True)

    class Meta:
        model = TeamInvitation
        fields = ["id", "invitee", "role", "invited_by", "created_at", "expires_at"]
        read_only_fields = fields


class TeamInvitationViewSet(
    mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.DestroyModelMixin, TeamScopedViewSet
):
    """A team's pending invitations (owners only), by what was typed: they never tell whether an account
    matches. DELETE revokes. Invite with ``POST /teams/{slug}/members/``."""

    queryset = TeamInvitation.objects.select_related("invited_by")
    serializer_class = TeamInvitationSerializer
    ordering_fields = ["created_at", "invitee", "expires_at"]
    action_requirements = dict.fromkeys(("list", "retrieve", "destroy"), Action.MANAGE)

    def get_queryset(self):
        return super().get_queryset().pending()

    def perform_destroy(self, instance):
        services.revoke_invitation(actor=self.request.user, invitation=instance)


class TeamBriefSerializer(serializers.ModelSerializer):
    class Meta:
        model = Team
        fields = ["slug", "name"]


class MyInvitationSerializer(serializers.ModelSerializer):
    team = TeamBriefSerializer(read_only=True)
    invited_by = serializers.CharField(source="invited_by.username", read_only=True, allow_null=True)

    class Meta:
        model = TeamInvitation
        fields = ["id", "team", "role", "invited_by", "created_at", "expires_at"]
        read_only_fields = fields


class MyInvitationViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Pending invitations addressed to the signed-in user (by username or email). Accepting joins the team
    with the invited role. API tokens belong to one team and cannot answer invitations."""

    serializer_class = MyInvitationSerializer
    ordering_fields = ["created_at", "expires_at"]

    def initial(self, request, *args, **kwargs):
        super().initial(request, *args, **kwargs)
        if getattr(request.user, "api_token", None) is not None:
            raise PermissionDenied("API tokens cannot see or answer invitations; sign in to do so.")

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return TeamInvitation.objects.none()
        return (
            TeamInvitation.objects.addressed_to(self.request.user)
            .pending()
            .select_related("team", "invited_by")
        )

    @extend_schema(request=None, responses=MembershipSerializer)
    @action(detail=True, methods=["post"])
    def accept(self, request, pk=None):
        membership = services.accept_invitation(user=request.user, invitation_id=_invitation_id(pk))
        return Response(MembershipSerializer(membership).data)

    @extend_schema(request=None, responses=MyInvitationSerializer)
    @action(detail=True, methods=["post"])
    def decline(self, request, pk=None):
        invitation = services.decline_invitation(user=request.user, invitation_id=_invitation_id(pk))
        return Response(MyInvitationSerializer(invitation).data)


def _invitation_id(pk) -> int:
    try:
        return int(pk)
    except (TypeError, ValueError):
        raise NotFound("No such invitation.") from None


class ApiTokenSerializer(serializers.ModelSerializer):
    prefix = serializers.CharField(source="display_prefix", read_only=True)
    created_by = serializers.CharField(source="created_by.username", read_only=True)
    status = serializers.CharField(
        read_only=True, help_text="active, revoked, expired, or inactive (its creator left the team)."
    )
    access = serializers.CharField(
        read_only=True,
        help_text="What it may do: the read-only flag narrowed by the creator's role (a viewer's token is read-only).",
    )
    priority_class = serializers.ChoiceField(
        choices=[("", "the team's default"), *priority.CHOICES],
        required=False,
        help_text='interactive or batch; "" (the default) follows the team\'s default_priority_class.',
    )
    effective_priority_class = serializers.CharField(
        read_only=True, help_text="The class the gateway applies: priority_class, or the team's default."
    )

    class Meta:
        model = ApiToken
        fields = [
            "id",
            "name",
            "prefix",
            "read_only",
            "inference_only",
            "priority_class",
            "effective_priority_class",
            "status",
            "access",
            "created_by",
            "created_at",
            "expires_at",
            "last_used_at",
            "revoked_at",
        ]
        read_only_fields = ["id", "created_at", "last_used_at", "revoked_at"]


class ApiTokenCreatedSerializer(ApiTokenSerializer):
    token = serializers.CharField(read_only=True, help_text="The secret. Shown once; store it now.")

    class Meta(ApiTokenSerializer.Meta):
        fields = [*ApiTokenSerializer.Meta.fields, "token"]


class ApiTokenUpdateSerializer(serializers.Serializer):
    priority_class = serializers.ChoiceField(
        choices=[("", "the team's default"), *priority.CHOICES],
        help_text='interactive or batch; "" follows the team\'s default_priority_class.',
    )

    def validate(self, attrs):
        unknown = sorted(set(self.initial_data) - set(self.fields))
        if unknown:
            raise serializers.ValidationError(
                {unknown[0]: ["Only priority_class can change; create a new token for anything else."]}
            )
        return attrs


class ApiTokenFilter(filters.FilterSet):
    active = filters.BooleanFilter(field_name="revoked_at", lookup_expr="isnull")

    class Meta:
        model = ApiToken
        fields = ["read_only", "inference_only", "active"]


class ApiTokenViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.DestroyModelMixin,
    TeamScopedViewSet,
):
    """A team's API tokens (owners only). Creating returns the secret once; listing never does; DELETE
    revokes (the row stays, for the audit trail)."""

    queryset = ApiToken.objects.select_related("created_by", "team").with_creator_role()
    serializer_class = ApiTokenSerializer
    filterset_class = ApiTokenFilter
    ordering_fields = ["created_at", "name", "last_used_at"]
    action_requirements = dict.fromkeys(
        ("list", "retrieve", "create", "partial_update", "destroy"), Action.MANAGE
    )

    @extend_schema(request=ApiTokenSerializer, responses={201: ApiTokenCreatedSerializer})
    def create(self, request, team_slug=None):
        serializer = ApiTokenSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        token, plaintext = services.create_token(
            actor=request.user,
            team=self.team,
            name=data["name"],
            read_only=data.get("read_only", False),
            expires_at=data.get("expires_at"),
            inference_only=data.get("inference_only", False),
            priority_class=data.get("priority_class", ""),
        )
        token.token = plaintext
        return Response(ApiTokenCreatedSerializer(token).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=ApiTokenUpdateSerializer, responses=ApiTokenSerializer)
    def partial_update(self, request, team_slug=None, pk=None):
        """Only the priority class changes; a token's other properties are fixed at creation."""
        token = self.get_object()
        serializer = ApiTokenUpdateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        token = services.set_token_priority_class(
            actor=request.user, token=token, priority_class=serializer.validated_data["priority_class"]
        )
        return Response(ApiTokenSerializer(token).data)

    def perform_destroy(self, instance):
        services.revoke_token(actor=self.request.user, token=instance)


@extend_schema(
    responses=inline_serializer(
        "Me",
        {
            "username": serializers.CharField(),
            "email": serializers.CharField(),
            "teams": TeamSerializer(many=True),
            "token": ApiTokenSerializer(allow_null=True),
        },
    )
)
@api_view(["GET"])
def me(request):
    """The caller: user, teams with roles, and the API token in use (if any)."""
    teams = Team.objects.for_user(request.user, Action.VIEW).prefetch_related("memberships")
    token = getattr(request.user, "api_token", None)
    return Response(
        {
            "username": request.user.get_username(),
            "email": request.user.email,
            "teams": TeamSerializer(teams, many=True, context={"request": request}).data,
            "token": ApiTokenSerializer(token).data if token else None,
        }
    )
