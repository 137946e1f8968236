"""Create the demo admin user and team for the embedded default (``make run``). Idempotent."""

from __future__ import annotations

import secrets

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.utils.text import slugify

from apps.teams import services
from apps.teams.models import Membership, Role, Team


class Command(BaseCommand):
    help = "Create (or keep) the demo admin user and demo team; prints the credentials."

    def handle(self, *args, **options):
        User = get_user_model()
        password_file = settings.VAR_DIR / "demo_password"
        username = settings.DEMO_USERNAME
        user = User.objects.filter(username=username).first()
        if settings.DEMO_PASSWORD:
            password = settings.DEMO_PASSWORD
        elif password_file.exists():
            password = password_file.read_text().strip()
        else:
            password = secrets.token_urlsafe(12)
            password_file.write_text(password)
            password_file.chmod(0o600)
        if user is None:
            user = User.objects.create_superuser(
                username=username, email=f"{username}@localhost", password=password
            )
        elif settings.DEMO_PASSWORD or not user.has_usable_password():
            user.set_password(password)
            user.save(update_fields=["password"])

        slug = slugify(settings.DEMO_TEAM)[:50]
        team = Team.objects.filter(slug=slug).first()
        if team is None:
            team = services.create_team(actor=user, name=settings.DEMO_TEAM, slug=slug)
        elif not Membership.objects.filter(team=team, user=user).exists():
            Membership.objects.create(team=team, user=user, role=Role.OWNER)

        shown = password if user.check_password(password) else "(unchanged; set DEMO_PASSWORD to reset it)"
        self.stdout.write(
            self.style.SUCCESS(
                f"Demo login: username '{username}', password '{shown}', team '{team.name}' ({team.slug})"
            )
        )
