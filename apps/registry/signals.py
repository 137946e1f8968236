"""Signals of the registry, for apps that build on versions (apps above this one listen; this one never
imports them)."""

from __future__ import annotations

from dataclasses import dataclass

from django.dispatch import Signal


@dataclass(frozen=True)
class VersionUse:
    """Something that keeps a version (or a model) in use, as a receiver of ``version_retiring`` (or
    ``model_retiring``) describes it."""

    message: str  # "deployment #3 serves it (Serving)"
    target_type: str  # the object it names, so a page can link to it: "deployment"
    target_id: int


# Sent inside archive_version's / delete_version's transaction with the version row locked: kwargs
# ``version`` and ``action`` ("archive" | "delete"). Each receiver returns a list of VersionUse (empty when it
# does not use the version); any use refuses the action.
version_retiring = Signal()

# Sent inside delete_version's transaction once nothing uses the version (kwargs ``version``): receivers
# release the references their history rows keep to it (an undeployed deployment's last version) before the
# row goes.
version_deleting = Signal()

# Sent inside delete_model's transaction with the model's versions locked (kwargs ``model``): each receiver
# returns a list of VersionUse naming what keeps the model (a live deployment); any use refuses the delete.
model_retiring = Signal()

# Sent inside delete_model's transaction once nothing uses the model (kwargs ``model``): receivers remove the
# rows they own about it (an ended deployment's history) before the model's row goes, and return a dict of
# what they removed for the audit event's details.
model_deleting = Signal()

# Sent inside complete_upload's transaction once a version's source is in place and checked (kwargs ``actor``,
# ``version``, ``options``: the upload's conversion options). The conversions app starts the version's
# conversion; an exception from a receiver rolls the completion back.
version_uploaded = Signal()

# Sent to ask which version of a model its live deployment serves (kwargs ``model``): an ensemble step given
# as "the version serving" is pinned to it. A receiver returns that ModelVersion or None (not deployed).
serving_version = Signal()
