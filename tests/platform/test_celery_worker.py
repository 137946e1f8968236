"""A real Celery worker process consumes the configured broker (Redis in CI, the filesystem transport in
the embedded default) and returns a task's result."""

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from serving_platform.celery import ping

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def worker():
    # A queue of its own, so a platform running on the same broker cannot take the test's task.
    queue = f"test-{uuid.uuid4().hex[:8]}"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "serving_platform",
            "worker",
            "--pool",
            "solo",
            "-Q",
            queue,
            "--hostname",
            f"{queue}@localhost",
            "--loglevel",
            "WARNING",
            "--without-heartbeat",
            "--without-gossip",
            "--without-mingle",
        ],
        cwd=ROOT,
        env=os.environ.copy(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    yield queue
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()


@pytest.mark.servers
def test_worker_round_trips_a_task(worker):
    result = ping.apply_async(queue=worker)
    assert result.get(timeout=60) == "pong"
