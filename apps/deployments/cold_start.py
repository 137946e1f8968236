"""Where a cold start's time goes: the hops from the request held at the gateway to its release.

A cold start is timed by the parts that see each hop, each with its own clock, and put together when the
gateway records the release (``apps.deployments.autoscaling.record_cold_start``):

* the gateway's Lua action writes when it began holding the request (``held_at``, epoch ms) with its wake-up
  signal, and how long it held it (``held_ms``) once the request went on;
* the platform notes when it saw the signal and placed the replica (``wake``: ``signal_at``, ``placed_at``)
  and when the agent's report that the version loaded arrived and was recorded (``arrived_at``,
  ``reported_at``);
* the agent reports its own steps (``hostagent.protocol.LOAD_TIMINGS``): queued, files, Triton's load, the
  footprint and smoke inference, and the total from having the decision to sending the report;
* the gateway notes when it put the deployment's first server into rotation (``routed_at``).

The agent's steps are durations on its own clock: when it received the decision is the report's arrival less
its total (the report's transit is taken as nil), never a comparison of two machines' clocks. The "reported"
hop is the agent's time outside its steps (its "started" report) plus the platform's recording of the report. Pure functions; the figures are stored by
``autoscaling`` with the deployment's cold-start figure.
"""

from __future__ import annotations

# (key, what the hop is), in order; each is a duration in ms and together they make the held time.
HOPS = (
    ("signal_ms", "held -> wake-up seen by the platform"),
    ("placed_ms", "seen -> replica placed"),
    ("received_ms", "placed -> agent has the decision"),
    ("queued_ms", "agent: decision -> load started"),
    ("files_ms", "agent: files ready in the repository"),
    ("load_ms", "agent: Triton's load"),
    ("smoke_ms", "agent: footprint and smoke inference"),
    ("reported_ms", "agent's report -> recorded by the platform"),
    ("routed_ms", "recorded -> in the gateway's rotation"),
    ("released_ms", "in rotation -> held request released"),
    ("held_ms", "held at the gateway (the cold start)"),
)
AGENT_STEPS = ("queued_ms", "files_ms", "load_ms", "smoke_ms")


def _between(later: float | None, earlier: float | None) -> int | None:
    if later is None or earlier is None:
        return None
    return max(0, round(later - earlier))


def breakdown(marks: dict, held_ms: int, routed_at_ms: float | None = None) -> dict[str, int]:
    """The hops of one cold start from its ``marks`` (epoch ms: held_at, signal_at, placed_at, reported_at;
    the agent's ``timings``), the gateway's hold and when the gateway routed it. A hop whose ends are not
    both known is left out (e.g. a wake-up seen by an older gateway without ``held_at``)."""
    held_at = marks.get("held_at")
    released_at = held_at + held_ms if held_at is not None else None
    timings = marks.get("timings") or {}
    arrived_at, reported_at = marks.get("arrived_at"), marks.get("reported_at")
    total = timings.get("total_ms")
    received_at = arrived_at - total if arrived_at is not None and total is not None else None
    agent_rest = total - sum(timings.get(step, 0) for step in AGENT_STEPS) if total is not None else None
    hops = {
        "signal_ms": _between(marks.get("signal_at"), held_at),
        "placed_ms": _between(marks.get("placed_at"), marks.get("signal_at")),
        "received_ms": _between(received_at, marks.get("placed_at")),
        **{step: timings.get(step) for step in AGENT_STEPS},
        "reported_ms": _between(reported_at + agent_rest, arrived_at)
        if None not in (reported_at, agent_rest, arrived_at)
        else None,
        "routed_ms": _between(routed_at_ms, reported_at),
        "released_ms": _between(released_at, routed_at_ms if routed_at_ms else None),
        "held_ms": max(0, int(held_ms)),
    }
    return {key: value for key, value in hops.items() if value is not None}


def held_at_ms(value: int) -> int:
    """The gateway's ``wakeups.map`` value: epoch ms (an older Lua action wrote epoch seconds)."""
    return value * 1000 if value < 10**11 else value
