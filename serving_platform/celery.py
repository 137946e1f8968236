"""The platform's Celery app.

Queues: ``default`` (housekeeping), ``conversions`` (ATC/ONNX jobs), and one ``host.<name>`` queue per
inference host, consumed only by that host's agent so work for a host runs on that host.
"""

from __future__ import annotations

import os

from celery import Celery
from kombu import Queue
from kombu.transport import TRANSPORT_ALIASES

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "serving_platform.settings")

# ``filesystem://`` (the embedded default) with message files written whole: see celery_transport.
TRANSPORT_ALIASES["filesystem"] = "serving_platform.celery_transport:Transport"

app = Celery("serving_platform")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.task_queues = (Queue("default"), Queue("conversions"))
app.autodiscover_tasks()


def host_queue(host_name: str) -> str:
    """The queue a host's agent consumes."""
    return f"host.{host_name}"


@app.task(name="serving_platform.ping")
def ping() -> str:
    """Round-trip check used by the readiness smoke test: proves a worker consumes the broker."""
    return "pong"
