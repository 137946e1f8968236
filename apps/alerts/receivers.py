"""A team gets the default alert rules with its deployment (in the deployment's transaction)."""

from __future__ import annotations

from django.dispatch import receiver

from apps.alerts import services
from apps.deployments.signals import deployment_created


@receiver(deployment_created, dispatch_uid="alerts-default-rules")
def create_default_rules(sender, *, deployment, actor, **kwargs) -> None:
    services.ensure_default_rules(actor=actor, team=deployment.team)
