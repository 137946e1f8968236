"""The rollout panel of the deployment page: the live rollout (steps, weight, both versions side by side with the
gates, charts from the rollout API) and its controls, or the start form. An htmx partial that polls itself:
every 2 s while a rollout is live, every 10 s otherwise (a rollout started elsewhere shows up), so the state
and the controls stay current without a reload. Actions post to the same URL and return the panel."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.shortcuts import get_object_or_404
from django.urls import reverse

from apps.deployments import rollouts
from apps.deployments.models import DeploymentState, Rollout, RolloutState
from apps.teams.models import Action
from frontend.deployments import DeploymentPageView

ACTIONS = {
    "pause": rollouts.pause,
    "resume": rollouts.resume,
    "promote": rollouts.promote_now,
    "abort": rollouts.abort,
}
ROLE_FIGURES = (
    ("requests_per_s", "Requests/s", "{:.1f}"),
    ("requests", "Requests (last check)", "{:d}"),
    ("success_rate", "Success rate", "{:.2%}"),
    # Not gated: requests the model refused as malformed are the caller's error (400), not the version's.
    ("client_errors", "Bad requests (400, not gated)", "{:d}"),
    ("p50_ms", "p50", "{:.1f} ms"),
    ("p99_ms", "p99", "{:.1f} ms"),
    ("queue_ms", "Queue time (mean)", "{:.2f} ms"),
)


def _shown(value, pattern: str) -> str:
    if value is None:
        return "–"
    return pattern.format(int(value) if pattern == "{:d}" else value)


def side_by_side(rollout: Rollout, check) -> list[dict]:
    """Rows of the two versions' latest judged (or waiting) figures, with the gate each row is held to."""
    figures = check.figures if check else {}
    canary, stable = figures.get("canary", {}), figures.get("stable", {})
    gates = {
        "success_rate": f"≥ {rollout.min_success_rate:.2%}",
        "p99_ms": " · ".join(
            part
            for part in (
                f"≤ {rollout.max_p99_ms:g} ms" if rollout.max_p99_ms is not None else "",
                f"≤ {rollout.max_p99_ratio:g}× stable" if rollout.max_p99_ratio is not None else "",
            )
            if part
        ),
        "requests": f"≥ {rollout.min_requests} to judge",
        "client_errors": "not judged",
    }
    failed = {gate["gate"] for gate in (check.failed_gates if check else [])}
    return [
        {
            "key": key,
            "label": label,
            "stable": _shown(stable.get(key), pattern),
            "canary": _shown(canary.get(key), pattern),
            "gate": gates.get(key, ""),
            "failed": key in failed or (key == "p99_ms" and "p99_ratio" in failed),
        }
        for key, label, pattern in ROLE_FIGURES
    ]


class RolloutPanelView(DeploymentPageView):
    template_name = "frontend/deployments/partials/rollout.html"

    def panel_context(self, deployment, error: str = "") -> dict:
        rollout = (
            deployment.rollouts.select_related("stable_version", "canary_version", "created_by")
            .order_by("-created_at", "-id")
            .first()
        )
        check = rollout.analyses.order_by("-checked_at", "-id").first() if rollout else None
        live = rollout is not None and rollout.is_live()
        steps = []
        if rollout is not None:
            for index, weight in enumerate(rollout.steps):
                if rollout.state == RolloutState.PROMOTED or index < rollout.current_step:
                    status = "done"
                elif index == rollout.current_step and live and rollout.step_started_at is not None:
                    status = "current"
                else:
                    status = "pending"
                steps.append({"weight": weight, "status": status})
        return {
            "deployment": deployment,
            "rollout": rollout,
            "live": live,
            "check": check,
            "steps": steps,
            "rows": side_by_side(rollout, check) if rollout else [],
            "can_change": self.can(Action.CHANGE),
            "can_start": deployment.state == DeploymentState.SERVING and not live,
            "canary_choices": deployment.model.versions.ready()
            .exclude(pk=deployment.active_version_id)
            .order_by("-number"),
            "api_url": reverse(
                "team-deployment-rollout-detail", args=[self.team.slug, deployment.pk, rollout.pk]
            )
            if rollout
            else "",
            "error": error,
        }

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context.update(self.panel_context(self.get_deployment()))
        return context

    def post(self, request, *args, **kwargs):
        self.require(Action.CHANGE)
        deployment = self.get_deployment()
        operation = request.POST.get("op", "")
        error = ""
        try:
            if operation == "start":
                canary = deployment.model.versions.filter(number=_int(request.POST.get("version"))).first()
                if canary is None:
                    raise ValidationError({"version": ["Pick a READY version to roll out."]})
                rollouts.start_rollout(
                    actor=request.user, deployment=deployment, canary=canary, **start_options(request.POST)
                )
            elif operation in ACTIONS:
                rollout = get_object_or_404(deployment.rollouts, pk=_int(request.POST.get("rollout")))
                ACTIONS[operation](actor=request.user, rollout=rollout)
            else:
                error = f"Unknown operation '{operation}'."
        except ValidationError as exc:
            error = " ".join(exc.messages)
        context = self.get_context_data(**kwargs)
        context.update(self.panel_context(self.get_deployment(), error))
        return self.render_to_response(
            context, status=200 if request.headers.get("HX-Request") or not error else 400
        )


def _int(value) -> int:
    return int(value) if isinstance(value, str) and value.isdigit() else 0


def _number(data, name: str, cast, default):
    raw = (data.get(name) or "").strip()
    if raw == "":
        return default
    try:
        return cast(raw)
    except ValueError:
        raise ValidationError({name: [f"{name.replace('_', ' ')}: '{raw}' is not a number."]}) from None


def start_options(data) -> dict:
    """The start form's fields (all optional) as start_rollout's options; bounds are checked there."""
    steps_text = (data.get("steps") or "").strip()
    options = {
        "step_interval_s": _number(data, "step_interval_s", int, 60),
        "min_success_rate": _number(data, "min_success_pct", float, 99.0) / 100,
        "max_p99_ms": _number(data, "max_p99_ms", float, None),
        "max_p99_ratio": _number(data, "max_p99_ratio", float, None),
        "min_requests": _number(data, "min_requests", int, 50),
        "max_failed_checks": _number(data, "max_failed_checks", int, 3),
        "traffic_deadline_s": _number(data, "traffic_deadline_s", int, 600),
    }
    if steps_text:
        try:
            options["steps"] = [int(part) for part in steps_text.replace(",", " ").split()]
        except ValueError:
            raise ValidationError(
                {"steps": [f"Steps: '{steps_text}' is not a list of percentages."]}
            ) from None
    return options
