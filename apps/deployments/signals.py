"""Signals of deployments, for apps that build on them (apps above this one listen; this one never imports
them), and for the rollout state machine (``apps.deployments.rollouts`` builds on ``services``, so
``services`` and the agents' ``reports`` announce what ends a rollout instead of writing rollout rows
themselves)."""

from django.dispatch import Signal

# Sent inside deploy_version's transaction, after the deployment row exists: kwargs deployment, actor.
deployment_created = Signal()

# Sent inside undeploy's transaction with the deployment locked and UNDEPLOYING, before its placements are
# decided: kwargs deployment, actor. Its live rollout is aborted.
deployment_undeploying = Signal()

# Sent inside a placement's report transaction with the deployment locked, when the canary failed to load
# beside the stable version: kwargs deployment, canary (the version), error. The rollout is rolled back.
canary_failed = Signal()
