"""Fixtures for conversions: versions with real source files, a fake ``atc`` that replays recorded ATC output,
and a real Celery worker process on a queue of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import onnx
import pytest
from django.db import connection

from apps.registry.models import ModelVersion, RegisteredModel, SourceFormat, VersionState
from backend_ge import examples
from tests.conftest import subprocess_database_url, wait_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def make_version(team, owner, artifact_root):
    """A version in state UPLOADED whose source dir holds the given files (name -> bytes)."""
    counter = {"n": 0}

    def _make(
        files: dict[str, bytes], source_format: str = SourceFormat.ONNX, serving_options=None, slug="resnet"
    ):
        counter["n"] += 1
        model, _ = RegisteredModel.objects.get_or_create(team=team, slug=slug, defaults={"name": slug})
        version = ModelVersion.objects.create(
            model=model,
            number=model.versions.count() + 1,
            state=VersionState.UPLOADED,
            source_format=source_format,
            source_filename=next(iter(files)),
            serving_options=serving_options
            if serving_options is not None
            else {
                "max_batch_size": 8,
                "preferred_batch_sizes": [4, 8],
                "max_queue_delay_us": 100,
                "instance_count": 1,
            },
            created_by=owner,
        )
        for name, data in files.items():
            path = version.source_dir() / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        return version

    return _make


@pytest.fixture
def mlp_bytes() -> bytes:
    return examples.build_mlp(sizes=(16, 32, 4)).SerializeToString()


WORKER_APP = "test-celery-worker"


def worker_env(artifact_root: Path, **extra) -> dict:
    """The environment of a worker subprocess: the test database, the test's artifact root, the test's PATH."""
    env = os.environ.copy()
    url = subprocess_database_url()
    # Named, so the teardown waits for the worker's sessions only (not the live server's or the test's own).
    env["DATABASE_URL"] = f"{url}?application_name={WORKER_APP}" if url.startswith("postgres") else url
    env["ARTIFACT_ROOT"] = str(artifact_root)
    env.setdefault("DEBUG", "1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


class Worker:
    """A real ``celery worker`` process consuming one private queue."""

    def __init__(self, queue: str, env: dict, pool: str = "solo", log_path: Path | None = None):
        self.queue = queue
        self.log_path = log_path
        self.log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "serving_platform",
                "worker",
                "--pool",
                pool,
                "--concurrency",
                "1",
                "-Q",
                queue,
                "--hostname",
                f"{queue}-{uuid.uuid4().hex[:4]}@localhost",
                "--loglevel",
                "INFO",
                "--without-heartbeat",
                "--without-gossip",
                "--without-mingle",
            ],  # fmt: skip
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        if self.log is not subprocess.DEVNULL:
            self.log.close()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""


def _set_routes(routes) -> None:
    from serving_platform.celery import app

    app.conf.task_routes = routes
    app.amqp.flush_routes()
    app.amqp.__dict__.pop("router", None)  # the router caches the routes it was built with


@pytest.fixture
def celery_queue():
    """Route conversions to a queue of this test only, so no other worker on the broker takes its jobs."""
    from serving_platform.celery import app

    queue = f"test-conversions-{uuid.uuid4().hex[:8]}"
    old = app.conf.task_routes
    _set_routes({"apps.conversions.tasks.*": {"queue": queue}})
    yield queue
    _set_routes(old)


@pytest.fixture
def start_worker(tmp_path, artifact_root, celery_queue):
    workers: list[Worker] = []

    def _start(pool: str = "solo", **env) -> Worker:
        worker = Worker(
            celery_queue,
            worker_env(artifact_root, **env),
            pool=pool,
            log_path=tmp_path / f"worker-{len(workers)}.log",
        )
        workers.append(worker)
        return worker

    yield _start
    for worker in workers:
        worker.stop()
    if workers and connection.vendor == "postgresql":
        # A worker's pool processes may outlive it by a moment; their sessions would block dropping the test DB.
        def sessions() -> int:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = %s",
                    [WORKER_APP],
                )
                return cursor.fetchone()[0]

        wait_for(lambda: sessions() == 0, 15, "the stopped workers' database sessions to end", interval=0.2)


def onnx_model_bytes(model: onnx.ModelProto) -> bytes:
    return model.SerializeToString()
