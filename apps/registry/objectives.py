"""A model's latency objective: what tuning measures a version's serving configs against
(``backend_ge.tuning.Objective``)."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import transaction

from apps.audit.services import record
from apps.registry.models import RegisteredModel
from backend_ge import tuning


def set_latency_objective(
    *, actor, model: RegisteredModel, p99_ms: float | None, rate_rps: float | None = None
) -> RegisteredModel:
    """Set (or, with ``p99_ms`` None, clear) the model's latency objective: p99 within ``p99_ms`` at
    ``rate_rps`` requests/s, or without a rate the most throughput with p99 within ``p99_ms``. Out of
    bounds is a ValidationError naming the field."""
    if p99_ms is None:
        if rate_rps is not None:
            raise ValidationError(
                {"objective_rate_rps": ["A rate needs a p99 objective: set objective_p99_ms too."]}
            )
    else:
        try:
            tuning.Objective(p99_ms=p99_ms, rate_rps=rate_rps)
        except tuning.TuningError as exc:
            raise ValidationError({f"objective_{exc.field}": [exc.message]}) from None
    with transaction.atomic():
        before = {"p99_ms": model.objective_p99_ms, "rate_rps": model.objective_rate_rps}
        model.objective_p99_ms, model.objective_rate_rps = p99_ms, rate_rps
        model.save(update_fields=["objective_p99_ms", "objective_rate_rps", "updated_at"])
        after = {"p99_ms": p99_ms, "rate_rps": rate_rps}
        if before != after:
            record(
                actor=actor,
                team=model.team,
                action="model.objective_changed",
                target=model,
                details={"from": before, "to": after},
            )
    return model
