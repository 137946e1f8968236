"""Step 4: what the seed promises, measured on this host. ResNet-50 at the same concurrency without and with
dynamic batching (the seed: 125 -> 450 img/s), p50/p99 from the project's load generator, and the NPU's
AI-core use and device memory sampled from ``npu-smi info`` while the load runs."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from backend_ge import bench, npu_smi
from backend_ge.npucheck.environment import chip_for_device
from backend_ge.npucheck.models import SEED_IMG_S, UNBATCHED_SUFFIX, make_inputs
from backend_ge.npucheck.report import FAIL, PASS, StepResult
from backend_ge.npucheck.verify import Compiled
from backend_ge.runtime import TritonServer


class NpuSampler:
    """Reads ``npu-smi info`` every ``interval`` seconds in a thread; ``summary()`` for one device."""

    def __init__(self, device: int, interval: float) -> None:
        self.device, self.interval = device, interval
        self.samples: list[dict] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="npu-smi-sampler", daemon=True)

    def __enter__(self) -> NpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def _loop(self) -> None:
        while True:
            try:
                inventory = npu_smi.read_inventory()
                chip = chip_for_device(inventory.chips, self.device) if inventory else None
                if chip is not None:
                    self.samples.append(
                        {
                            "t": time.monotonic(),
                            "aicore_percent": chip.aicore_percent,
                            "memory_used_mb": chip.device_memory_used_mb,
                            "memory_total_mb": chip.device_memory_total_mb,
                        }
                    )
            except (npu_smi.NpuSmiError, ValueError) as exc:
                self.errors.append(str(exc))
            if self._stop.wait(self.interval):
                return

    def summary(self) -> dict:
        aicore = [s["aicore_percent"] for s in self.samples if s["aicore_percent"] is not None]
        memory = [s["memory_used_mb"] for s in self.samples]
        return {
            "samples": len(self.samples),
            "aicore_percent_max": max(aicore) if aicore else None,
            "aicore_percent_mean": round(sum(aicore) / len(aicore), 1) if aicore else None,
            "memory_used_mb_max": max(memory) if memory else None,
            "memory_total_mb": self.samples[-1]["memory_total_mb"] if self.samples else None,
            "errors": self.errors[:5],
        }


def _phase(
    server: TritonServer, model: str, inputs, concurrency: int, requests: int, device: int, interval: float
) -> dict:
    with NpuSampler(device, interval) as sampler:
        result = bench.run(
            server.http_url,
            model,
            concurrency=concurrency,
            requests=requests,
            inputs=inputs,
            warmup=2,
            timeout=1800,
        )
    result["npu"] = sampler.summary()
    return result


def run_benchmark(
    server: TritonServer,
    compiled: Compiled,
    *,
    device: int,
    concurrency: int,
    requests: int,
    min_speedup: float,
    interval: float,
    fake: bool,
    say: Callable[[str], None],
) -> StepResult:
    """Batch 1 (dynamic batching off) vs dynamic batching, both at ``concurrency`` with batch-1 requests."""
    step, started = f"benchmark {compiled.model.name}", time.monotonic()
    inputs = make_inputs(compiled.signature, 1, seed=0)
    phases = {}
    try:
        for key, model in (
            ("batch1", compiled.model.name + UNBATCHED_SUFFIX),
            ("dynamic_batching", compiled.model.name),
        ):
            say(f"  {key}: {requests} requests at concurrency {concurrency} on {model}")
            phases[key] = _phase(server, model, inputs, concurrency, requests, device, interval)
    except (bench.BenchError, OSError, queue.Empty) as exc:
        return StepResult(
            step, FAIL, time.monotonic() - started, f"load generation failed: {exc or type(exc).__name__}"
        )
    one, many = phases["batch1"], phases["dynamic_batching"]
    speedup = many["throughput_rps"] / one["throughput_rps"] if one["throughput_rps"] else 0.0
    problems = []
    if one["errors"] or many["errors"]:
        problems.append(f"{one['errors'] + many['errors']} failed requests")
    if many["server"]["avg_batch_size"] <= 1.0:
        problems.append("dynamic batching merged no requests (average batch 1.0)")
    if not fake and speedup < min_speedup:
        problems.append(f"speedup {speedup:.2f}x is below --min-speedup {min_speedup:g}x")
    npu = many["npu"]
    summary = (
        f"batch 1: {one['throughput_rps']:.0f} img/s (p50 {one['latency_ms']['p50']:.1f} ms, "
        f"p99 {one['latency_ms']['p99']:.1f} ms); dynamic batching c{concurrency}: "
        f"{many['throughput_rps']:.0f} img/s (p50 {many['latency_ms']['p50']:.1f} ms, "
        f"p99 {many['latency_ms']['p99']:.1f} ms, avg batch {many['server']['avg_batch_size']:.1f}) = "
        f"{speedup:.2f}x (seed: {SEED_IMG_S['batch1']:.0f} -> {SEED_IMG_S['dynamic_batching']:.0f} img/s, "
        f"{SEED_IMG_S['dynamic_batching'] / SEED_IMG_S['batch1']:.1f}x); AI-core max "
        f"{_or_na(npu['aicore_percent_max'])}%, memory max {_or_na(npu['memory_used_mb_max'])}/"
        f"{_or_na(npu['memory_total_mb'])} MB"
    )
    if fake:
        summary += " [FAKE: onnxruntime on this CPU, recorded npu-smi; not gated on speed]"
    if problems:
        summary = "; ".join(problems) + " | " + summary
    data = {
        "phases": phases,
        "speedup": speedup,
        "seed_img_s": SEED_IMG_S,
        "min_speedup": min_speedup,
        "concurrency": concurrency,
        "requests": requests,
        "gated_on_speed": not fake,
    }
    return StepResult(step, FAIL if problems else PASS, time.monotonic() - started, summary, data)


def _or_na(value) -> str:
    return "n/a" if value is None else str(value)
