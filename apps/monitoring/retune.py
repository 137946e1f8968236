"""Whether a serving version's traffic has moved away from the point its serving settings were tuned at.

The tuned point is the tuning job's measurement of the config the version serves (``TuningJob``: the job
that created the version, or a job of the version itself that found its own config best): the most
throughput that config served within the objective, with the batch size and queue time Triton reported
there. The live figures are the version's scraped rollups of the last ``WINDOW`` (every instance it served
on). It suggests re-tuning, with the figures side by side, when

- the request rate is above what the tuned config served within the objective (``RATE_ABOVE``), or
- live p99 exceeds the objective's, or
- requests wait in the queue much longer than at the tuned point (``QUEUE_ABOVE``, at least ``QUEUE_MIN_MS``), or
- a batched config sees far less traffic than it was tuned for and far smaller batches (``RATE_BELOW``,
  ``BATCH_BELOW``): its queue delay buys nothing at that rate.

It only suggests: a serving config changes through a new version and a rollout, never here. Below
``MIN_REQUESTS`` in the window there is too little traffic to say anything.
"""

from __future__ import annotations

from datetime import timedelta

from django.db.models import F, Sum
from django.utils import timezone

from apps.deployments.tuning_models import TuningJob, TuningState
from apps.monitoring.models import ModelMetrics
from apps.registry.models import ModelVersion
from backend_ge import config as gc
from backend_ge.tuning import Candidate, Objective, Point, TuningError

ADVICE_STATES = [
    ("untuned", "No finished tuning measured this version's config"),
    ("quiet", "Too little traffic to compare"),
    ("steady", "Live traffic is near the tuned point"),
    ("retune", "Re-tuning suggested"),
]
WINDOW = timedelta(minutes=15)
MIN_REQUESTS = 200
RATE_ABOVE = 1.2
RATE_BELOW = 0.25
BATCH_BELOW = 0.5
QUEUE_ABOVE = 2.0
QUEUE_MIN_MS = 1.0


def _own_config(version: ModelVersion) -> Candidate | None:
    try:
        return Candidate.from_config(gc.parse_config(version.config_text))
    except (gc.ConfigError, TuningError):
        return None


def tuned_job(version: ModelVersion) -> TuningJob | None:
    """The tuning whose points describe the config this version serves."""
    done = TuningJob.objects.filter(state=TuningState.SUCCEEDED).order_by("-finished_at", "-pk")
    job = done.filter(derived_version=version).first()
    if job is not None:
        return job
    own = _own_config(version)
    for job in done.filter(version=version)[:5]:
        if own is not None and (job.result or {}).get("recommended") == own.as_dict():
            return job
    return None


def tuned_point(job: TuningJob, candidate: Candidate) -> dict | None:
    """The candidate's best point within the job's objective (the tuned operating point)."""
    objective = Objective(job.objective["p99_ms"], job.objective.get("rate_rps"))
    best = None
    for raw in job.points:
        try:
            point = Point.from_dict({k: v for k, v in raw.items() if k != "at_s"})
        except TuningError:
            continue
        better = best is None or point.throughput_rps > best.throughput_rps
        if point.candidate == candidate and objective.met_by(point) and better:
            best = point
    if best is None:
        return None
    return {
        "throughput_rps": round(best.throughput_rps, 2),
        "p99_ms": round(best.p99_ms, 3),
        "avg_batch_size": round(best.avg_batch_size, 2),
        "queue_ms": round(best.queue_us / 1000, 3),
        "concurrency": best.concurrency,
    }


def live_figures(version: ModelVersion, now=None) -> dict:
    now = now or timezone.now()
    sums = ModelMetrics.objects.filter(version=version, bucket__gte=now - WINDOW, bucket__lt=now).aggregate(
        success=Sum("success"),
        failure=Sum("failure"),
        inferences=Sum("inferences"),
        executions=Sum("executions"),
        queue_us=Sum("queue_us"),
        weight=Sum("quantile_requests"),
        p99_w=Sum(F("p99_us") * F("quantile_requests")),
    )
    requests = (sums["success"] or 0) + (sums["failure"] or 0)
    weight = sums["weight"] or 0
    return {
        "requests": requests,
        "rate_rps": round(requests / WINDOW.total_seconds(), 3),
        "avg_batch_size": round(sums["inferences"] / sums["executions"], 2) if sums["executions"] else None,
        "queue_ms": round((sums["queue_us"] or 0) / requests / 1000, 3) if requests else None,
        "p99_ms": round(sums["p99_w"] / weight / 1000, 3) if weight and sums["p99_w"] is not None else None,
        "window_s": int(WINDOW.total_seconds()),
    }


def advice(version: ModelVersion, now=None) -> dict:
    """``{"state": "untuned" | "quiet" | "steady" | "retune", "reasons", "live", "tuned", "tuning"}``."""
    job = tuned_job(version)
    candidate = _own_config(version)
    live = live_figures(version, now)
    base = {"state": "untuned", "reasons": [], "live": live, "tuned": None, "tuning": job.pk if job else None}
    point = tuned_point(job, candidate) if job is not None and candidate is not None else None
    if point is None:
        return base
    base["tuned"] = point
    if live["requests"] < MIN_REQUESTS:
        return {**base, "state": "quiet"}
    reasons = []
    rate, tuned_rate = live["rate_rps"], point["throughput_rps"]
    if rate > RATE_ABOVE * tuned_rate:
        reasons.append(
            f"traffic of {rate:.1f} requests/s is above the {tuned_rate:.1f} the tuned config served within "
            "the objective"
        )
    objective_ms = job.objective["p99_ms"]
    if live["p99_ms"] is not None and live["p99_ms"] > objective_ms:
        reasons.append(f"live p99 {live['p99_ms']:.1f} ms exceeds the objective's {objective_ms:g} ms")
    queue = live["queue_ms"]
    if queue is not None and queue > max(QUEUE_ABOVE * point["queue_ms"], point["queue_ms"] + QUEUE_MIN_MS):
        reasons.append(
            f"requests wait {queue:.2f} ms in the queue against {point['queue_ms']:.2f} ms at the tuned point"
        )
    batch = live["avg_batch_size"]
    if (
        candidate.dynamic_batching
        and batch is not None
        and rate < RATE_BELOW * tuned_rate
        and batch < BATCH_BELOW * point["avg_batch_size"]
    ):
        reasons.append(
            f"traffic of {rate:.1f} requests/s forms batches of {batch:.1f} against {point['avg_batch_size']:.1f} "
            f"at the tuned {tuned_rate:.1f} requests/s: the queue delay buys little at this rate"
        )
    return {**base, "state": "retune" if reasons else "steady", "reasons": reasons}
