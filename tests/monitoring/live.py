"""Requests straight to a live instance (with its key) and the counts the rollups wrote."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from django.db.models import Sum

from apps.fleet.models import TritonInstance
from apps.monitoring.models import ModelMetrics
from tests.monitoring.builders import infer_body
from tests.support.servers import instance_key_headers


def post(url: str, body: dict) -> int:
    headers = {"Content-Type": "application/json", **instance_key_headers(url.split("://", 1)[1])}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def send(instance: TritonInstance, model: str, ok: int, failing: int) -> None:
    url = f"{instance.endpoint_url()}/v2/models/{model}/infer"
    codes = [post(url, infer_body(1)) for _ in range(ok)] + [post(url, infer_body(2)) for _ in range(failing)]
    assert codes == [200] * ok + [500] * failing


def totals(version) -> dict:
    return ModelMetrics.objects.filter(version=version).aggregate(
        success=Sum("success"), failure=Sum("failure"), inferences=Sum("inferences")
    )
