"""Fixtures for monitoring tests: a READY version of the model whose failures Triton counts
(tests/monitoring/builders.py), rows for the metrics pages, two versions to compare and a recorded Triton; agents and versions come from the shared
fixtures (tests/support/plugin.py)."""

from __future__ import annotations

import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from django.utils import timezone

from apps.conversions.models import ConversionJob, JobState
from apps.registry.models import ModelVersion, RegisteredModel, VersionState
from tests.monitoring.builders import HOSTILE, reshaper_version, signature

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def make_reshaper_version(team, owner, artifact_root, tmp_path):
    def _make(slug: str = "reshaper") -> ModelVersion:
        model = RegisteredModel.objects.create(team=team, name=slug.title(), slug=slug, created_by=owner)
        return reshaper_version(model, owner, tmp_path)

    return _make


@pytest.fixture
def metrics_setup(team, owner):
    """A model with two versions served on one instance of a shared host, and a writer of minute rows."""
    from datetime import timedelta

    from django.utils import timezone

    from apps.fleet.models import Host, TritonInstance
    from apps.monitoring.models import ModelMetrics

    host = Host.objects.create(name="metrics-host", address="127.0.0.1")
    instance = TritonInstance.objects.create(
        host=host, name="cpu-0", http_port=18000, grpc_port=18001, metrics_port=18002, state="READY"
    )
    model = RegisteredModel.objects.create(team=team, name="Classifier", slug="classifier", created_by=owner)
    versions = [
        ModelVersion.objects.create(model=model, number=n, state=VersionState.READY, created_by=owner)
        for n in (1, 2)
    ]

    def write(version, minutes_ago: int, success: int, failure: int = 0, now=None, **fields) -> ModelMetrics:
        bucket = (now or timezone.now()).replace(second=0, microsecond=0) - timedelta(minutes=minutes_ago)
        return ModelMetrics.objects.create(
            bucket=bucket,
            team=team,
            model=model,
            version=version,
            instance=instance,
            success=success,
            failure=failure,
            failure_reasons={"BACKEND": failure} if failure else {},
            inferences=success + failure,
            executions=max(1, (success + failure) // 2),
            request_us=(success + failure) * 1500.0,
            queue_us=(success + failure) * 200.0,
            **fields,
        )

    return {"host": host, "instance": instance, "model": model, "versions": versions, "write": write}


class RecordedTriton(BaseHTTPRequestHandler):
    """Serves the recorded payloads with every counter multiplied by ``server.factor``."""

    def do_GET(self):  # noqa: N802 - http.server's name
        factor = self.server.factor
        if self.path == "/metrics":
            lines = []
            for line in (FIXTURES / "triton_metrics.txt").read_text().splitlines():
                if line.startswith(("nv_inference_request_success", "ge_inference_request_failure")):
                    name, value = line.rsplit(" ", 1)
                    line = f"{name} {float(value) * factor:g}"
                lines.append(line)
            body = ("\n".join(lines) + "\n").encode()
        elif self.path == "/v2/models/stats":
            body = (FIXTURES / "triton_stats.json").read_bytes()
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def recorded_triton():
    server = ThreadingHTTPServer(("127.0.0.1", 0), RecordedTriton)
    server.factor = 1
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def compared(metrics_setup):
    v1, v2 = metrics_setup["versions"]
    v1.signature = signature([3, 224, 224])
    v1.config_text = 'name: "vision__classifier"\nmax_batch_size: 8\ndynamic_batching { max_queue_delay_microseconds: 2000 }\n'
    v1.source_format, v1.sha256, v1.size_bytes, v1.source_filename = "onnx", "a" * 64, 1000, "resnet.onnx"
    v1.save()
    v2.signature = signature([3, 256, 256], dtype="FP16", extra=True)
    v2.config_text = f'name: "vision__classifier"\nmax_batch_size: 16\n# {HOSTILE}\ndynamic_batching {{ max_queue_delay_microseconds: 2000 }}\n'
    v2.source_format, v2.sha256, v2.size_bytes, v2.source_filename = "om", "b" * 64, 2500, "resnet.om"
    v2.save()
    started = timezone.now() - timedelta(hours=1)
    ConversionJob.objects.create(
        version=v1, state=JobState.SUCCEEDED, toolchain="onnx", options={"precision_mode": "fp32"},
        started_at=started, finished_at=started + timedelta(seconds=12),
    )  # fmt: skip
    ConversionJob.objects.create(
        version=v2, state=JobState.SUCCEEDED, toolchain="atc",
        options={"precision_mode": "allow_fp32_to_fp16", "soc_version": "Ascend310P3"},
        command=["atc", "--model=model.onnx", "--framework=5", "--soc_version=Ascend310P3"],
        started_at=started, finished_at=started + timedelta(seconds=42),
    )  # fmt: skip
    write = metrics_setup["write"]
    write(v1, 3, success=90, failure=10, p50_us=1000.0, p99_us=4000.0, quantile_requests=100)
    write(v1, 90, success=500)  # outside the hour
    write(v2, 2, success=198, failure=2, p50_us=2000.0, p99_us=6000.0, quantile_requests=200)
    return v1, v2
