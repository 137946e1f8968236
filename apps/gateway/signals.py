"""Pokes: after a commit that changes what the gateway routes, it syncs at once instead of at its next tick.

Deployments, placements and tokens are written by other apps' services; their audit events and deployment
events are written in the same transactions, so listening to those rows covers deploy, switch, undeploy,
placement changes, token creation and revocation, and membership changes without touching those services.
"""

from __future__ import annotations

from django.db import transaction
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from apps.audit.models import AuditEvent
from apps.deployments.models import Deployment, DeploymentEvent, Rollout
from apps.deployments.scheduler import GONE
from apps.fleet.models import TritonInstance
from apps.gateway.services import poke_gateway
from apps.teams.models import ApiToken, Team

# A deployment's fields the gateway does not route by: the autoscaler saves its figures every few seconds for
# each deployment, which is no reason for a sync.
UNROUTED_FIELDS = frozenset({"scaling_memory", "updated_at", "last_cold_start_ms", "last_cold_start"})
# Events after which the deployment syncs on its own before the next full sync: a replica told to unload.
SYNC_AT_ONCE = frozenset({"replica_removed"})


@receiver(post_save, sender=DeploymentEvent, dispatch_uid="gateway-deployment-event")
def _poke_for_deployment(instance: DeploymentEvent, **kwargs) -> None:
    """A deployment's event names it: a deployment whose request is held syncs on its own at once, and so
    does one whose replica was told to unload (it drains at once: its room frees sooner for a wake-up)."""
    deployment_id, urgent = instance.deployment_id, instance.kind in SYNC_AT_ONCE
    transaction.on_commit(lambda: poke_gateway(deployment_id, urgent))


@receiver(post_save, sender=Deployment, dispatch_uid="gateway-deployment")
def _poke_for_saved_deployment(instance: Deployment, created=False, update_fields=None, **kwargs) -> None:
    """A deployment's own change (woken, asleep, switched) names it: it syncs alone, not every deployment
    with it (the autoscaler saves one at every wake-up and every sleep). A new one, or one undeploying, asks
    for a full sync, which also follows its replicas' drain."""
    if update_fields is not None and set(update_fields) <= UNROUTED_FIELDS:
        return
    if created or instance.state in GONE:
        transaction.on_commit(poke_gateway)
    else:
        deployment_id = instance.pk
        transaction.on_commit(lambda: poke_gateway(deployment_id))


@receiver(post_save, sender=AuditEvent, dispatch_uid="gateway-audit")
@receiver(post_save, sender=Rollout, dispatch_uid="gateway-rollout")  # a weight step is a map change
@receiver(post_save, sender=ApiToken, dispatch_uid="gateway-token")
@receiver(post_save, sender=Team, dispatch_uid="gateway-team")
@receiver(post_delete, sender=Team, dispatch_uid="gateway-team-deleted")
@receiver(post_delete, sender=TritonInstance, dispatch_uid="gateway-instance-deleted")
def _poke_after_commit(**kwargs) -> None:
    transaction.on_commit(poke_gateway)
