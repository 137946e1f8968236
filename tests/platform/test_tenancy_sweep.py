"""Cross-team probes of every route, found by walking the URL resolver rather than listed by hand: a route added
later is probed the day it lands.

For a member of another team (signed in, or holding their team's API token) every team route answers a team's
object exactly as it answers a team or an object that does not exist, for every method; an object id of another
team under the caller's own team slug is answered as a missing id; every form action of the pages, posted with
another team's ids, changes nothing of that team; and afterwards no row of any team points at another team's rows.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.apps import apps as django_apps
from django.db import models as db_models
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils import timezone

from apps.alerts.models import (
    Alert,
    AlertKind,
    AlertRule,
    AlertState,
    NotificationChannel,
    NotificationDelivery,
)
from apps.alerts.services import create_silence
from apps.audit.models import AuditEvent
from apps.conversions.models import ConversionJob
from apps.deployments.models import Rollout, TuningJob
from apps.registry.models import RegisteredModel, UploadSession, VersionState
from apps.teams import services as team_services
from apps.teams.models import Membership, Team
from tests.conftest import bearer_client
from tests.support.models import make_version, serving_rows

pytestmark = pytest.mark.django_db

METHODS = ("get", "post", "put", "patch", "delete")
MISSING_ID = "987654321"
MISSING_UUID = "00000000-0000-4000-8000-000000000000"
GROUP = re.compile(r"\(\?P<(?P<name>\w+)>[^)]*\)|<(?:\w+:)?(?P<plain>\w+)>")

# Which object an id in a route names, by the path segment before it (the first match wins: a rollout's
# route also holds its deployment's).
ID_OWNERS = (
    ("/rollouts/", "rollout"),
    ("/alerts/rules/", "rule"),
    ("/alerts/channels/", "channel"),
    ("/alerts/silences/", "silence"),
    ("/alerts/events/", "alert"),
    ("/alerts/deliveries/", "delivery"),
    ("/conversion-jobs/", "job"),
    ("/conversions/", "job"),
    ("/uploads/", "upload"),
    ("/deployments/", "deployment"),
    ("/members/", "member"),
    ("/invitations/", "invitation"),
    ("/tokens/", "token"),
    ("/audit-events/", "event"),
    ("/tunings/", "tuning"),
)


def routes(patterns=None, prefix: str = "") -> Iterator[str]:
    """Every route of the platform as a path template (``^``/``$`` dropped, groups kept)."""
    for pattern in get_resolver().url_patterns if patterns is None else patterns:
        text = prefix + str(pattern.pattern).removeprefix("^").removesuffix("$")
        if isinstance(pattern, URLResolver):
            yield from routes(pattern.url_patterns, text)
        elif isinstance(pattern, URLPattern):
            yield text


def parameters(route: str) -> list[str]:
    return [m["name"] or m["plain"] for m in GROUP.finditer(route)]


def owner_of(route: str, name: str) -> str:
    """The object the parameter ``name`` of ``route`` names."""
    head = next(route[: m.start()] for m in GROUP.finditer(route) if name in (m["name"], m["plain"]))
    if name == "deployment_pk":
        return "deployment"
    for segment, kind in ID_OWNERS:
        if head.endswith(segment):
            return kind
    raise AssertionError(f"no object known for <{name}> in {route}: add it to ID_OWNERS")


def fill(route: str, team: str, ids: dict[str, str]) -> str:
    def value(match: re.Match) -> str:
        name = match["name"] or match["plain"]
        if name == "team_slug" or (name == "slug" and route.startswith("api/v1/teams/(?P<slug>")):
            return team
        if name in ("slug", "model_slug"):
            return ids["model_slug"]
        if name == "number":
            return "1"
        return ids[owner_of(route, name)]

    return "/" + GROUP.sub(value, route)


def team_routes() -> list[str]:
    found = []
    for route in routes():
        names = parameters(route)
        if "team_slug" in names or route.startswith("api/v1/teams/(?P<slug>"):
            found.append(route)
    return found


@pytest.fixture
def victim(team, owner, viewer, shared_host, instance, make_token):
    """Team vision with one of everything a team owns."""
    model = RegisteredModel.objects.create(team=team, name="Classifier", slug="classifier", created_by=owner)
    v1, v2 = make_version(model, 1), make_version(model, 2)
    deployment = serving_rows(team, owner, "scorer", instance)
    scorer_v2 = make_version(deployment.model, 2)
    rollout = Rollout.objects.create(
        deployment=deployment, stable_version=deployment.active_version, canary_version=scorer_v2,
        current_weight=10, created_by=owner,
    )  # fmt: skip
    token, _ = make_token()
    rule = AlertRule.objects.create(team=team, name="Errors", kind=AlertKind.ERROR_RATE, threshold=5)
    channel = NotificationChannel.objects.create(
        team=team, name="ops", kind="email", emails=["o@example.com"]
    )
    silence = create_silence(actor=owner, team=team, rule=rule, ends_at=timezone.now() + timedelta(hours=1))
    now = timezone.now()
    alert = Alert.objects.create(
        team=team, rule=rule, subject=f"deployment:{deployment.pk}", state=AlertState.FIRING, summary="x",
        active_since=now, fired_at=now, last_evaluated_at=now,
    )  # fmt: skip
    delivery = NotificationDelivery.objects.create(team=team, channel=channel, rule=rule, status="firing")
    delivery.alerts.add(alert)
    uploading = make_version(model, 3, state=VersionState.UPLOADING)
    upload = UploadSession.objects.create(version=uploading, filename="m.onnx", expected_size=10)
    job = ConversionJob.objects.create(version=v2, created_by=owner)
    tuning = TuningJob.objects.create(team=team, version=v1, budget_s=60, max_candidates=3)
    invitation = team_services.invite_member(actor=owner, team=team, user_identifier="ghost", role="viewer")
    ids = {
        "model_slug": model.slug,
        "deployment": str(deployment.pk),
        "rollout": str(rollout.pk),
        "token": str(token.pk),
        "rule": str(rule.pk),
        "channel": str(channel.pk),
        "silence": str(silence.pk),
        "alert": str(alert.pk),
        "delivery": str(delivery.pk),
        "upload": str(upload.pk),
        "job": str(job.pk),
        "member": str(Membership.objects.get(user=viewer).pk),
        "invitation": str(invitation.pk),
        "tuning": str(tuning.pk),
        "event": str(AuditEvent.objects.filter(team=team).first().pk),
        "version": str(v1.pk),
        "versions": (v1, v2),
    }
    return ids


def missing(ids: dict[str, str]) -> dict[str, str]:
    return {k: (MISSING_UUID if k == "upload" else MISSING_ID) for k in ids} | {
        "model_slug": ids["model_slug"]
    }


# --- what belongs to which team, found through foreign keys -------------------------------------------------
SHARED = {"fleet", "auth", "axes", "admin", "contenttypes", "sessions", "django_celery_beat", "gateway"}


def team_of(obj, depth: int = 0) -> int | None:
    """The team a row belongs to, following its foreign keys (None: a shared or unowned row)."""
    if isinstance(obj, Team):
        return obj.pk
    if depth > 4 or obj._meta.app_label in SHARED:
        return None
    if getattr(obj, "team_id", None):
        return obj.team_id
    for field in obj._meta.concrete_fields:
        if isinstance(field, db_models.ForeignKey) and field.related_model._meta.app_label not in SHARED:
            target = getattr(obj, field.name)
            if target is not None and (found := team_of(target, depth + 1)) is not None:
                return found
    return None


def project_models():
    return [m for m in django_apps.get_models() if m.__module__.startswith("apps.")]


def snapshot(team_pk: int) -> dict:
    """Every row of the team, field by field."""
    rows = {}
    for model in project_models():
        for obj in model.objects.all():
            if team_of(obj) == team_pk:
                rows[(model._meta.label, obj.pk)] = {
                    f.attname: getattr(obj, f.attname) for f in model._meta.concrete_fields
                }
    return rows


def cross_team_references() -> list[str]:
    """Rows whose foreign keys reach another team's rows than their own."""
    found = []
    for model in project_models():
        for obj in model.objects.all():
            own = team_of(obj)
            if own is None:
                continue
            for field in model._meta.concrete_fields:
                if not isinstance(field, db_models.ForeignKey) or field.related_model is Team:
                    continue
                target = getattr(obj, field.name)
                if target is not None and (theirs := team_of(target)) is not None and theirs != own:
                    found.append(f"{model._meta.label} {obj.pk}.{field.name} -> team {theirs} (own {own})")
            for field in model._meta.many_to_many:
                for target in getattr(obj, field.name).all():
                    if (theirs := team_of(target)) is not None and theirs != own:
                        found.append(
                            f"{model._meta.label} {obj.pk}.{field.name} -> team {theirs} (own {own})"
                        )
    return found


def probe(client, method: str, path: str) -> int:
    call = getattr(client, method)
    if method == "get":
        return call(path).status_code
    return (
        call(path, {}, format="json").status_code
        if hasattr(client, "credentials")
        else call(path).status_code
    )


def assert_as_missing(client, route: str, real: str, control: str, failures: list[str]) -> None:
    for method in METHODS:
        got, expected = probe(client, method, real), probe(client, method, control)
        if got != expected or 200 <= got < 300 or got >= 500:
            failures.append(f"{method.upper()} {real}: {got}, a missing one answers {expected}")


def test_the_probed_paths_name_real_objects(victim, owner, owner_client):
    """The probes below mean something only if their paths are right: the team's own owner reads each."""
    browser = Client()
    browser.force_login(owner)
    wrong = []
    for route in team_routes():
        path = fill(route, "vision", victim)
        status = (owner_client if route.startswith("api/") else browser).get(path).status_code
        if status not in (200, 400, 405):  # 400: found, but the GET lacks its parameters
            wrong.append(f"GET {path}: {status}")
    assert not wrong, "\n".join(wrong)


def test_every_team_route_answers_another_teams_objects_as_missing(
    victim, outsider, other_team, outsider_client
):
    before = snapshot(victim_team_pk := Team.objects.get(slug="vision").pk)
    _, speech_secret = team_services.create_token(actor=outsider, team=other_team, name="probe")
    browser = Client()
    browser.force_login(outsider)
    clients = {"api": [outsider_client, bearer_client(speech_secret)], "page": [browser]}
    found = team_routes()
    assert len(found) > 60, f"the resolver walk found only {len(found)} team routes"
    failures: list[str] = []
    for route in found:
        for client in clients["api" if route.startswith("api/") else "page"]:
            # Another team's object under its own slug, as a team that does not exist.
            real, control = fill(route, "vision", victim), fill(route, "no-such-team", victim)
            assert_as_missing(client, route, real, control, failures)
            if any(n not in ("team_slug", "slug", "model_slug", "number") for n in parameters(route)):
                # Another team's object id under the caller's own slug, as an id that does not exist.
                real, control = fill(route, "speech", victim), fill(route, "speech", missing(victim))
                assert_as_missing(client, route, real, control, failures)
    assert not failures, "\n".join(failures)
    assert snapshot(victim_team_pk) == before
    assert not cross_team_references()


def test_invitation_ids_of_another_team_are_answered_as_missing(victim, outsider_client, outsider):
    before = snapshot(Team.objects.get(slug="vision").pk)
    browser = Client()
    browser.force_login(outsider)
    failures: list[str] = []
    for route in routes():
        if "invitations/" not in route or "team_slug" in route or "<" not in route:
            continue
        client = outsider_client if route.startswith("api/") else browser
        real = "/" + GROUP.sub(victim["invitation"], route)
        control = "/" + GROUP.sub(MISSING_ID, route)
        assert_as_missing(client, route, real, control, failures)
    assert not failures, "\n".join(failures)
    assert snapshot(Team.objects.get(slug="vision").pk) == before


# Every form action the pages offer, and the fields that name an object.
def form_actions() -> list[str]:
    from pathlib import Path

    text = "".join(p.read_text() for p in Path("frontend/templates").rglob("*.html"))
    return sorted(set(re.findall(r'name="op" value="([a-z_]+)"', text)))


def test_page_actions_posted_with_another_teams_ids_change_nothing_of_it(victim, outsider):
    """The caller is owner of their own team; every page action of their team, posted with the other team's
    ids in every field that names an object, changes nothing of the other team and links nothing to it."""
    vision = Team.objects.get(slug="vision")
    before = snapshot(vision.pk)
    browser = Client()
    browser.force_login(outsider)
    actions = form_actions()
    assert len(actions) > 20, actions
    body_ids = {
        "rule": victim["rule"], "channel": victim["channel"], "silence": victim["silence"],
        "token": victim["token"], "membership": victim["member"], "invitation": victim["invitation"],
        "rollout": victim["rollout"], "deployment": victim["deployment"], "version": victim["version"],
        "model": "classifier", "team": "vision", "username": "olivia", "name": "probe", "role": "viewer",
        "previous": "1", "next": "2",
    }  # fmt: skip
    failures = []
    for route in team_routes():
        if route.startswith("api/"):
            continue
        path = fill(route, "speech", victim)
        for op in actions:
            status = browser.post(path, {"op": op, **body_ids}).status_code
            if status >= 500:
                failures.append(f"POST {path} op={op}: {status}")
    assert not failures, "\n".join(failures)
    assert snapshot(vision.pk) == before
    assert not cross_team_references()


def test_the_ownership_walk_sees_every_team_owned_model(victim):
    """The checks above are only as good as ``team_of``: every model of the team apps resolves to a team."""
    vision = Team.objects.get(slug="vision").pk
    owned = {label for label, _ in snapshot(vision)}
    for label in ("registry.RegisteredModel", "registry.ModelVersion", "deployments.Deployment",
                  "deployments.Rollout", "deployments.DeploymentInstance", "alerts.Silence",
                  "alerts.NotificationDelivery", "conversions.ConversionJob", "registry.UploadSession",
                  "teams.ApiToken", "teams.Membership", "teams.TeamInvitation"):  # fmt: skip
        assert label in owned, label
    # And a row pointing at another team's row is found.
    other = Team.objects.create(name="Other", slug="other")
    outsider_model = RegisteredModel.objects.create(team=other, name="X", slug="x")
    AlertRule.objects.create(
        team=other, name="bad", kind=AlertKind.ERROR_RATE, threshold=5,
        deployment_id=int(victim["deployment"]),
    )  # fmt: skip
    assert outsider_model.pk and any("alerts.AlertRule" in line for line in cross_team_references())
