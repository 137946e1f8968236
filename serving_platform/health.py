"""Liveness and readiness probes.

``/healthz`` answers as long as the process serves requests. ``/readyz`` also proves the database and the
Celery broker answer, with the detail of each check, so an orchestrator only routes traffic to a web
process that can do its work.
"""

from __future__ import annotations

import time

from django.conf import settings
from django.db import connection
from django.http import JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from serving_platform.celery import app as celery_app


def _timed(check) -> dict:
    started = time.monotonic()
    try:
        detail = check()
        result = {"ok": True, **(detail or {})}
    except Exception as exc:  # every failure must become a readable probe result, not a 500
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    result["ms"] = round((time.monotonic() - started) * 1000, 1)
    return result


def _check_database() -> dict:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        cursor.fetchone()
    return {"vendor": connection.vendor}


def _check_broker() -> dict:
    with celery_app.connection_for_write(url=settings.CELERY_BROKER_URL) as conn:
        conn.ensure_connection(max_retries=1, timeout=2)
        return {
            "transport": conn.transport_cls
            if isinstance(conn.transport_cls, str)
            else conn.transport.driver_type
        }


@never_cache
@require_GET
def healthz(request):
    return JsonResponse({"status": "ok"})


@never_cache
@require_GET
def readyz(request):
    checks = {"database": _timed(_check_database), "broker": _timed(_check_broker)}
    ready = all(check["ok"] for check in checks.values())
    return JsonResponse(
        {"status": "ready" if ready else "unavailable", "checks": checks}, status=200 if ready else 503
    )
