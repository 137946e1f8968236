"""The comparison page of two versions of one model: ``/teams/<team>/models/<model>/compare/?a=1&b=2&range=1h``.

Without ``a``/``b`` it compares the two newest versions. The rollout panel links here with its stable version
as ``a`` and its canary as ``b``. The payload is the comparison API's (``apps.monitoring.comparison``).
"""

from __future__ import annotations

from django.http import Http404

from apps.monitoring import rollups
from apps.monitoring.comparison import CompareError, check_numbers, compare_versions
from apps.registry.models import ModelVersion
from frontend.registry import ModelPageView


class VersionCompareView(ModelPageView):
    template_name = "frontend/registry/version_compare.html"

    def get(self, request, *args, **kwargs):
        context = self.get_context_data(**kwargs)
        model = context["model"]
        numbers = list(model.versions.order_by("-number").values_list("number", flat=True))
        context.update(numbers=numbers, ranges=list(rollups.RANGES), range=request.GET.get("range") or "1h")
        a, b = request.GET.get("a"), request.GET.get("b")
        if a is None and b is None:
            if len(numbers) < 2:
                context["error"] = "This model has one version: upload another to compare."
                return self.render_to_response(context)
            a, b = numbers[1], numbers[0]
        try:
            a, b = check_numbers(a, b)
            context["comparison"] = compare_versions(model, a, b, context["range"])
        except CompareError as exc:
            context["error"] = str(exc)
            return self.render_to_response(context, status=400)
        except ModelVersion.DoesNotExist as exc:
            raise Http404(str(exc)) from None
        context.update(a=a, b=b, serving_rows=serving_rows(context["comparison"]))
        return self.render_to_response(context)


def _ms(value) -> str:
    return "—" if value is None else f"{value:.2f} ms"


def _percent(value) -> str:
    return "—" if value is None else f"{value * 100:.2f} %"


def _relative(value) -> str:
    return "" if value is None else f"{value * 100:+.0f} %"


def serving_rows(comparison: dict) -> list[dict]:
    """The serving figures as table rows: label, both values, and b against a."""
    a, b = comparison["a"]["serving"], comparison["b"]["serving"]
    differences = comparison["differences"]
    return [
        {"label": "Requests", "a": str(a["requests"]), "b": str(b["requests"]), "diff": ""},
        {
            "label": "Requests/s",
            "a": f"{a['requests_per_second']:g}",
            "b": f"{b['requests_per_second']:g}",
            "diff": "",
        },
        {"label": "Failed", "a": str(a["failure"]), "b": str(b["failure"]), "diff": ""},
        {
            "label": "Error rate",
            "a": _percent(a["error_rate"]),
            "b": _percent(b["error_rate"]),
            "diff": _relative(differences["error_rate"]),
        },
        {
            "label": "p50",
            "a": _ms(a["p50_ms"]),
            "b": _ms(b["p50_ms"]),
            "diff": _relative(differences["p50_ms"]),
        },
        {
            "label": "p99",
            "a": _ms(a["p99_ms"]),
            "b": _ms(b["p99_ms"]),
            "diff": _relative(differences["p99_ms"]),
        },
        {"label": "Mean latency", "a": _ms(a["mean_ms"]), "b": _ms(b["mean_ms"]), "diff": ""},
        {"label": "Queue time", "a": _ms(a["queue_ms"]), "b": _ms(b["queue_ms"]), "diff": ""},
    ]
