"""Signals of deployments, for apps that build on them (apps above this one listen; this one never imports
them)."""

from django.dispatch import Signal

# Sent inside deploy_version's transaction, after the deployment row exists: kwargs deployment, actor.
deployment_created = Signal()
