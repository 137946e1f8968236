"""Step 3: run every compiled ``.om`` through the pyACL executor directly, then through a real tritonserver
with the ``ge`` backend (dynamic batching on), and compare the outputs with onnxruntime on the same inputs."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from backend_ge import config as gc
from backend_ge.executors.base import ExecutorError
from backend_ge.npucheck.models import UNBATCHED_SUFFIX, CheckModel, compare, make_inputs
from backend_ge.npucheck.report import FAIL, PASS, StepResult
from backend_ge.runtime import TritonError, TritonServer

TRITON_REQUESTS = 8  # concurrent batch-1 requests per model: dynamic batching gets something to merge


@dataclass
class Compiled:
    """A model ATC compiled: the check's description, the .om, and the ONNX source used as the reference."""

    model: CheckModel
    om: Path
    source: Path
    signature: gc.ModelSignature


class Reference:
    """onnxruntime (CPU, fp32) on the ONNX file ATC compiled."""

    def __init__(self, source: Path) -> None:
        import onnxruntime as ort

        self._session = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
        self.output_names = [o.name for o in self._session.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.output_names, self._session.run(self.output_names, feeds), strict=True))


def _worst(checks: list[dict]) -> dict:
    bad = [c for c in checks if not c["ok"]]
    if bad:
        return bad[0]
    return max(checks, key=lambda c: c["worst_fraction_of_tolerance"])


def _describe(worst: dict, model: CheckModel) -> str:
    if "reason" in worst:
        return worst["reason"]
    return (
        f"max |diff| {worst['max_abs_diff']:.3g} (rtol {model.rtol:g}, atol {model.atol:g}; "
        f"{worst['worst_fraction_of_tolerance']:.0%} of the tolerance), cosine {worst['cosine']:.6f}"
    )


def check_executors(
    compiled: list[Compiled], device: int, acl_module, say: Callable[[str], None]
) -> list[StepResult]:
    """Every .om through ``AclExecutor`` at the model's check batches (non-gears exercise the padding).

    All executors stay open until the end: pyACL's ``init``/``finalize`` happen once per process.
    """
    from backend_ge.executors.acl import AclExecutor

    results: list[StepResult] = []
    stack = contextlib.ExitStack()
    try:
        for c in compiled:
            step, started = f"executor {c.model.name}", time.monotonic()
            try:
                executor = stack.enter_context(
                    AclExecutor(str(c.om), device_id=device, acl_module=acl_module)
                )
                if executor.batch_gears != list(c.model.gears):
                    raise ExecutorError(
                        f"the .om reports gears {executor.batch_gears}, compiled with {c.model.gears}"
                    )
                reference, checks = Reference(c.source), []
                for batch in c.model.check_batches:
                    feeds = make_inputs(c.signature, batch, seed=batch)
                    outputs, expected = executor.run(feeds), reference.run(feeds)
                    for name in reference.output_names:
                        checks.append(
                            {
                                "batch": batch,
                                "output": name,
                                **compare(outputs[name], expected[name], c.model.rtol, c.model.atol),
                            }
                        )
            except (ExecutorError, KeyError) as exc:
                results.append(StepResult(step, FAIL, time.monotonic() - started, str(exc)))
                continue
            worst = _worst(checks)
            summary = f"batches {','.join(map(str, c.model.check_batches))}: {_describe(worst, c.model)}"
            data = {"checks": checks, "tolerance": c.model.tolerance(), "gears": executor.batch_gears}
            results.append(
                StepResult(step, PASS if worst["ok"] else FAIL, time.monotonic() - started, summary, data)
            )
            say(f"  {step}: {summary}")
    finally:
        try:
            stack.close()
        except ExecutorError as exc:  # teardown: a leak or a driver error counts against every model
            for r in results:
                r.status, r.summary = FAIL, f"{r.summary}; teardown failed: {exc}"
    return results


def write_repository(root: Path, compiled: list[Compiled], device: int, bench_model: str) -> list[str]:
    """Triton configs next to the compiled .om files (ATC wrote them into ``<root>/<model>/1/``), plus the
    benchmark model once more without dynamic batching (the same files, linked)."""
    names = []
    for c in compiled:
        m = c.model
        common = {"max_batch_size": m.gears[-1], "device_ids": [device], "executor": "acl"}
        cfg = gc.generate_config(
            m.name,
            c.signature,
            preferred_batch_sizes=m.preferred_batch_sizes,
            max_queue_delay_us=m.max_queue_delay_us,
            **common,
        )
        gc.write_config(cfg, root / m.name / "config.pbtxt")
        names.append(m.name)
        if m.name == bench_model:
            plain = m.name + UNBATCHED_SUFFIX
            (root / plain / "1").mkdir(parents=True, exist_ok=True)
            for f in (root / m.name / "1").iterdir():
                link = root / plain / "1" / f.name
                if not link.exists():
                    os.symlink(f.resolve(), link)
            cfg = gc.generate_config(plain, c.signature, dynamic_batching=False, **common)
            gc.write_config(cfg, root / plain / "config.pbtxt")
            names.append(plain)
    return names


def start_triton(root: Path, workdir: Path, names: list[str]) -> tuple[TritonServer, dict[str, str]]:
    """A real tritonserver with the ``ge`` backend; returns it and ``{model: load error}``."""
    server = TritonServer(root, workdir=workdir, exit_timeout=10, die_with_parent=True)
    server.start(timeout=180)
    failures = {}
    for name in names:
        try:
            server.load_model(name, timeout=900)
        except TritonError as exc:
            failures[name] = str(exc)
    return server, failures


def check_triton_model(server: TritonServer, c: Compiled, load_error: str | None) -> StepResult:
    """``TRITON_REQUESTS`` concurrent batch-1 requests, each compared with onnxruntime on its input."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    step, started = f"triton {c.model.name}", time.monotonic()
    if load_error:
        return StepResult(step, FAIL, 0.0, load_error.splitlines()[0][:300], {"error": load_error})
    before = server.model_statistics(c.model.name)[0]
    reference = Reference(c.source)
    client = httpclient.InferenceServerClient(
        server.http_url, concurrency=TRITON_REQUESTS, network_timeout=600
    )
    feeds = [make_inputs(c.signature, 1, seed=100 + i) for i in range(TRITON_REQUESTS)]
    try:
        pending = []
        for feed in feeds:
            items = []
            for name, array in feed.items():
                item = httpclient.InferInput(name, list(array.shape), _wire(array))
                item.set_data_from_numpy(array)
                items.append(item)
            pending.append(client.async_infer(c.model.name, items))
        replies = [p.get_result(timeout=600) for p in pending]
    except InferenceServerException as exc:
        return StepResult(step, FAIL, time.monotonic() - started, f"inference failed: {exc}")
    finally:
        client.close()
    checks = []
    for feed, reply in zip(feeds, replies, strict=True):
        expected = reference.run(feed)
        for name in reference.output_names:
            checks.append(
                {"output": name, **compare(reply.as_numpy(name), expected[name], c.model.rtol, c.model.atol)}
            )
    after = server.model_statistics(c.model.name)[0]
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    worst = _worst(checks)
    batching = f"{TRITON_REQUESTS} requests in {executions} executions (dynamic batching)"
    summary = f"{batching}: {_describe(worst, c.model)}"
    data = {
        "checks": checks,
        "tolerance": c.model.tolerance(),
        "inferences": inferences,
        "executions": executions,
    }
    return StepResult(step, PASS if worst["ok"] else FAIL, time.monotonic() - started, summary, data)


def _wire(array: np.ndarray) -> str:
    from backend_ge import dtypes

    return dtypes.from_numpy(array.dtype).wire_name
