"""The opt-in hot-path measurements of a stub (``GE_PROFILE_DIR``): counters, cProfile, flushing."""

from __future__ import annotations

import json
import os
import pstats
import types

import pytest

from backend_ge import profiling, serving


class FakeModel:
    """What ``profiling.instrument`` needs of a GeModel: a name, ``execute`` and the executor call."""

    name = "team/mlp"

    def __init__(self) -> None:
        self.executor_calls = 0

    def _run(self, feeds):
        self.executor_calls += 1
        return [sum(i * i for i in range(20_000))]  # measurable thread CPU

    def execute(self, requests):
        outputs = self._run({})
        sum(i for i in range(5_000))  # the backend's own work around the executor call
        return [outputs] * len(requests)


def test_timing_counts_calls_requests_and_splits_executor_time(tmp_path):
    model = FakeModel()
    execute = profiling.instrument(model, tmp_path / "timing")
    assert execute([1]) == [[sum(i * i for i in range(20_000))]]
    execute([1, 2])
    model.profile_recorder.flush()
    files = list((tmp_path / "timing").iterdir())
    assert [f.name for f in files] == [f"team_mlp-{os.getpid()}.json"]
    counters = json.loads(files[0].read_text())
    assert counters["calls"] == 2 and counters["requests"] == 3
    assert model.executor_calls == 2
    assert 0 < counters["executor_cpu_ns"] < counters["execute_cpu_ns"]
    assert 0 < counters["executor_wall_ns"] < counters["execute_wall_ns"]


def test_errors_from_execute_still_count_and_propagate(tmp_path):
    model = FakeModel()

    def failing(requests):
        raise RuntimeError("boom")

    model.execute = failing
    execute = profiling.instrument(model, tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        execute([1])
    assert model.profile_recorder.counters["calls"] == 1


def test_cprofile_writes_stats_that_name_the_hot_path(tmp_path):
    model = FakeModel()
    execute = profiling.instrument(model, tmp_path, mode="cprofile")
    execute([1, 2])
    model.profile_recorder.flush()
    (path,) = tmp_path.glob("*.prof")
    functions = {name for _, _, name in pstats.Stats(str(path)).stats}
    assert {"execute", "_run"} <= functions


def test_unknown_mode_is_refused_with_the_choices(tmp_path):
    with pytest.raises(ValueError, match="timing, cprofile"):
        profiling.instrument(FakeModel(), tmp_path, mode="perf")


def test_closing_a_model_flushes_its_counters(tmp_path):
    model = FakeModel()
    execute = profiling.instrument(model, tmp_path)
    execute([1])
    closed = []
    stand_in = types.SimpleNamespace(
        profile_recorder=model.profile_recorder,
        executor=types.SimpleNamespace(close=lambda: closed.append(1)),
    )
    serving.GeModel.close(stand_in)
    assert closed == [1]
    (path,) = tmp_path.glob("*.json")
    assert json.loads(path.read_text())["requests"] == 1


@pytest.mark.triton
def test_a_served_model_writes_its_counters_when_the_variable_is_set(
    example_repository, tmp_path, monkeypatch
):
    """The switch reaches the stub through tritonserver's environment (the GE_ prefix) and model.py."""
    import numpy as np

    from backend_ge.bench import RawHttpClient
    from backend_ge.runtime import TritonServer, load_all

    monkeypatch.setenv(profiling.PROFILE_DIR_ENV, str(tmp_path / "counters"))
    server = TritonServer(
        example_repository, workdir=tmp_path / "triton", exit_timeout=5, die_with_parent=True
    )
    server.start(timeout=120)
    try:
        assert not load_all(server, ["mlp"])
        client = RawHttpClient(server.http_url, "mlp", {"input": np.ones((2, 256), np.float32)})
        try:
            for _ in range(3):
                status, body, _ = client.infer()
                assert status == 200, body[:300]
        finally:
            client.close()
    finally:
        server.stop(timeout=30)  # unloading flushes what the last second counted
    (path,) = (tmp_path / "counters").glob("mlp-*.json")
    counters = json.loads(path.read_text())
    assert counters["requests"] == 3 and counters["calls"] == 3
    assert 0 < counters["executor_cpu_ns"] <= counters["execute_cpu_ns"]
