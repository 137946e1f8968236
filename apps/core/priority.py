"""Priority classes: what a caller's API token (or its team's default) says about how urgent its requests are.

Under saturation the gateway queues requests by class (HAProxy's ``set-priority-class``: a lower class is
served first once a server's ``maxconn`` is reached), and for a model whose config defines
``dynamic_batching.priority_levels`` the gateway sets Triton's int64 request parameter ``priority`` from the
class, so Triton's scheduler queues by class too. Triton's level 1 is the highest: ``interactive`` maps to
level 1, ``batch`` to the lowest level the model defines. Ensembles get no level (Triton does not pass a
request's priority to an ensemble's steps: server issue 6055).

No Django here: the gateway's rules render from these.
"""

from __future__ import annotations

INTERACTIVE = "interactive"
BATCH = "batch"
CLASSES = (INTERACTIVE, BATCH)
DEFAULT_CLASS = INTERACTIVE
CHOICES = [
    (INTERACTIVE, "interactive: served first when the model is saturated"),
    (BATCH, "batch: waits behind interactive requests when the model is saturated"),
]

# HAProxy's priority class of each (lower is dequeued first; HAProxy's default is 0).
GATEWAY_CLASS = {INTERACTIVE: 0, BATCH: 1}


def triton_level(priority_class: str, levels: int) -> int:
    """Triton's priority level for a class on a model with ``levels`` levels (0: the model has none)."""
    if levels <= 0:
        return 0
    return 1 if priority_class == INTERACTIVE else levels
