"""The platform's own Prometheus metrics at ``/metrics``, and ``/metrics/targets.json`` for Prometheus'
file-based service discovery of every Triton instance.

Request counts and latencies are counted in-process by a middleware; everything that is state (conversion
jobs, instances, scrape failures) is read from the database when Prometheus scrapes, so every web process
reports the same numbers and nothing is lost when a process restarts.
"""

from __future__ import annotations

import hmac
import ipaddress
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from functools import lru_cache
from urllib.parse import urlsplit

from django.conf import settings
from django.db.models import Count, DurationField, ExpressionWrapper, F, Q, Sum
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseForbidden, JsonResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from apps.conversions.models import ConversionJob, JobState
from apps.fleet.models import InstanceState, TritonInstance
from apps.monitoring.models import ScrapeState

# No auto-describe: it would run the database collector at import time.
REGISTRY = CollectorRegistry(auto_describe=False)

API_REQUESTS = Counter(
    "platform_http_requests",
    "HTTP requests served, by route name (not the raw path: ids would explode the label set)",
    ["method", "route", "status"],
    registry=REGISTRY,
)
API_LATENCY = Histogram(
    "platform_http_request_duration_seconds",
    "Time to answer an HTTP request, by route name",
    ["method", "route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=REGISTRY,
)
# Conversions run from seconds (ONNX checks) to hours (large ATC compiles).
CONVERSION_BUCKETS = (5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200)


def route_name(request: HttpRequest) -> str:
    match = getattr(request, "resolver_match", None)
    if match is None:
        return "unmatched"
    return match.view_name or match.route or "unnamed"


class RequestMetricsMiddleware:
    """Counts every request and its latency under the name of the route that served it."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        started = time.perf_counter()
        response = self.get_response(request)
        route = route_name(request)
        method = request.method if request.method in _METHODS else "other"
        API_REQUESTS.labels(method, route, str(response.status_code)).inc()
        API_LATENCY.labels(method, route).observe(time.perf_counter() - started)
        return response


_METHODS = {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"}


class DatabaseCollector(Collector):
    """State gauges read from the database at scrape time."""

    def collect(self) -> Iterator:
        jobs = GaugeMetricFamily("platform_conversion_jobs", "Conversion jobs by state", labels=["state"])
        counts = dict(ConversionJob.objects.values_list("state").annotate(n=Count("pk")).order_by())
        for state in JobState.values:
            jobs.add_metric([state], counts.get(state, 0))
        yield jobs

        yield self._conversion_durations(ConversionJob, JobState)

        instances = GaugeMetricFamily(
            "platform_triton_instances", "Triton instances by state", labels=["state"]
        )
        counts = dict(TritonInstance.objects.values_list("state").annotate(n=Count("pk")).order_by())
        for state in InstanceState.values:
            instances.add_metric([state], counts.get(state, 0))
        yield instances

        failures = CounterMetricFamily(
            "platform_metrics_scrape_failures",
            "Failed scrapes of a Triton instance's metrics or statistics",
            labels=["host", "instance"],
        )
        consecutive = GaugeMetricFamily(
            "platform_metrics_scrape_consecutive_failures",
            "Scrapes of the instance that failed in a row (0: the last one worked)",
            labels=["host", "instance"],
        )
        for host, name, total, row in ScrapeState.objects.values_list(
            "instance__host__name", "instance__name", "total_failures", "consecutive_failures"
        ):
            failures.add_metric([host, name], total)
            consecutive.add_metric([host, name], row)
        yield failures
        yield consecutive

    @staticmethod
    def _conversion_durations(job_model, states) -> HistogramMetricFamily:
        duration = ExpressionWrapper(F("finished_at") - F("started_at"), output_field=DurationField())
        finished = job_model.objects.filter(
            state__in=[states.SUCCEEDED, states.FAILED], started_at__isnull=False, finished_at__isnull=False
        ).annotate(duration=duration)
        aggregates = {
            f"le_{b}": Count("pk", filter=Q(duration__lte=timedelta(seconds=b))) for b in CONVERSION_BUCKETS
        }
        aggregates["total"] = Count("pk")
        aggregates["sum"] = Sum("duration")
        result = finished.aggregate(**aggregates)
        buckets = [(str(float(b)), result[f"le_{b}"]) for b in CONVERSION_BUCKETS]
        buckets.append(("+Inf", result["total"]))
        total = result["sum"]
        family = HistogramMetricFamily(
            "platform_conversion_job_duration_seconds", "Run time of finished conversion jobs"
        )
        family.add_metric([], buckets, sum_value=total.total_seconds() if total else 0.0)
        return family


REGISTRY.register(DatabaseCollector())


@lru_cache(maxsize=16)
def _networks(entries: tuple[str, ...]) -> tuple:
    return tuple(ipaddress.ip_network(entry, strict=False) for entry in entries)


def check_metrics_access(request: HttpRequest) -> None:
    """A Bearer ``METRICS_TOKEN``, or a client address in ``METRICS_ALLOWED_IPS`` (addresses or networks).

    A wrong token is a 403; anyone else gets a 404, so the endpoint does not advertise itself.
    ``REMOTE_ADDR`` only: a forwarded-for header is what a client would forge.
    """
    header = request.headers.get("Authorization", "")
    token = settings.METRICS_TOKEN
    if header.startswith("Bearer "):
        if token and hmac.compare_digest(header[7:].strip().encode(), token.encode()):
            return
        raise PermissionError("wrong metrics token")
    try:
        address = ipaddress.ip_address(request.META.get("REMOTE_ADDR", ""))
    except ValueError:
        raise Http404 from None
    if any(address in network for network in _networks(tuple(settings.METRICS_ALLOWED_IPS))):
        return
    raise Http404


def metrics_view(request: HttpRequest) -> HttpResponse:
    try:
        check_metrics_access(request)
    except PermissionError as exc:
        return HttpResponseForbidden(str(exc))
    return HttpResponse(generate_latest(REGISTRY), content_type=CONTENT_TYPE_LATEST)


def targets_view(request: HttpRequest) -> HttpResponse:
    """Prometheus ``file_sd_configs`` JSON: one target group per Triton instance with host/instance labels."""
    try:
        check_metrics_access(request)
    except PermissionError as exc:
        return HttpResponseForbidden(str(exc))
    groups = [
        {
            "targets": [f"{instance.host.address}:{instance.metrics_port}"],
            "labels": {"host": instance.host.name, "instance": instance.name, "__metrics_path__": "/metrics"},
        }
        for instance in TritonInstance.objects.select_related("host").order_by("host__name", "name")
    ]
    # The inference gateway's HAProxy exporter (per frontend, backend = deployment, and server counters).
    gateway = urlsplit(settings.GATEWAY_METRICS_URL)
    groups.append(
        {
            "targets": [gateway.netloc],
            "labels": {"job": "gateway", "__metrics_path__": gateway.path or "/metrics"},
        }
    )
    return JsonResponse(groups, safe=False)
