"""The real measurement of tuning candidates (``backend_ge.tuning``): each is loaded under a scratch model name
on a running tritonserver and driven with ``backend_ge.bench``."""

from __future__ import annotations

import json

from google.protobuf import json_format

from backend_ge import bench
from backend_ge.config import ModelConfig
from backend_ge.tuning import Candidate, Point


class TritonMeasure:
    """Measure candidates on a running tritonserver: each is loaded under ``scratch_name`` (a directory of
    the server's repository holding the version's files) with the candidate's config, and driven with
    ``backend_ge.bench`` at the requested concurrency. ``close()`` unloads the scratch model."""

    def __init__(
        self,
        server,
        scratch_name: str,
        base_config: ModelConfig,
        *,
        requests: int = 400,
        warmup: int = 5,
        per_stream: int = 25,
        inputs=None,
        timeout: float = 300.0,
    ) -> None:
        self.server = server
        self.scratch_name = scratch_name
        self.base_config = base_config
        self.requests = requests
        self.warmup = warmup
        self.per_stream = per_stream
        self.inputs = inputs
        self.timeout = timeout
        self.loaded: Candidate | None = None

    def config_json(self, candidate: Candidate) -> str:
        cfg = candidate.apply(self.base_config)
        cfg.name = self.scratch_name
        return json.dumps(json_format.MessageToDict(cfg, preserving_proto_field_name=True))

    def load(self, candidate: Candidate) -> None:
        if self.loaded == candidate:
            return
        self.server.load_model(self.scratch_name, config=self.config_json(candidate), timeout=self.timeout)
        self.loaded = candidate
        if self.inputs is None:
            self.inputs = bench.make_inputs(self.server.http_url, self.scratch_name, headers=self._headers())

    def __call__(self, candidate: Candidate, concurrency: int) -> Point:
        self.load(candidate)
        requests = max(self.requests, self.per_stream * concurrency)
        r = bench.run(
            self.server.http_url,
            self.scratch_name,
            concurrency=concurrency,
            requests=requests,
            inputs=self.inputs,
            warmup=self.warmup,
            timeout=self.timeout,
            headers=self._headers(),
        )
        return Point(
            candidate=candidate,
            concurrency=concurrency,
            throughput_rps=r["throughput_rps"],
            p50_ms=r["latency_ms"]["p50"],
            p99_ms=r["latency_ms"]["p99"],
            errors=r["errors"],
            avg_batch_size=r["server"]["avg_batch_size"],
            queue_us=r["server"]["queue_us"],
        )

    def _headers(self) -> dict[str, str]:
        """The instance key: an agent's server opens only its health API to callers without it."""
        keyed = getattr(self.server, "key_headers", None)
        return keyed() if keyed is not None else {}

    def close(self) -> None:
        if self.loaded is not None:
            try:
                self.server.unload_model(self.scratch_name)
            finally:
                self.loaded = None
