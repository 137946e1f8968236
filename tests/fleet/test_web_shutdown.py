"""A web process that stops answers its held long polls at once (``serving_platform.gunicorn_hooks`` and
``GenerationWatcher.release_all``): before, a stop waited for the longest held poll (up to 30 s) and
``make run``'s Ctrl-C ended the web server with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from apps.fleet.long_poll import GenerationWatcher
from backend_ge.runtime import free_port
from hostagent.protocol import agent_protocol_headers
from tests.conftest import subprocess_database_url
from tests.fleet.helpers import DESIRED, etag_of, joined

ROOT = Path(__file__).resolve().parents[2]


def test_release_all_answers_every_held_poll_and_holds_no_new_one(monkeypatch):
    watcher = GenerationWatcher(interval=3600, max_waiters=10)  # no sweep during the test
    monkeypatch.setattr(watcher, "sweep", lambda waiters: None)
    answers: list[tuple[bool | None, float]] = []

    def hold() -> None:
        started = time.monotonic()
        answers.append((watcher.wait_for_change("h", '"1"', 20), time.monotonic() - started))

    threads = [threading.Thread(target=hold) for _ in range(3)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while watcher.waiting() < 3:
        assert time.monotonic() < deadline, "the polls were not held"
        time.sleep(0.01)
    assert watcher.release_all() == 3
    for thread in threads:
        thread.join(5)
    # Released, not changed: each is answered with the 304 its wait would have ended with.
    assert [changed for changed, _ in answers] == [False, False, False]
    assert max(took for _, took in answers) < 5
    started = time.monotonic()
    assert watcher.wait_for_change("h", '"1"', 20) is False and time.monotonic() - started < 1
    assert watcher.waiting() == 0


@pytest.mark.servers
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["graceful", "quick"])
def test_a_stopping_gunicorn_answers_its_held_polls_and_exits_promptly(stop, tmp_path):
    host, credential, _ = joined("lp-stop")
    etag = etag_of(host)
    port = free_port()
    env = os.environ | {"DATABASE_URL": subprocess_database_url(), "ALLOWED_HOSTS": "127.0.0.1"}
    log = (tmp_path / "gunicorn.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "serving_platform.wsgi",
         "--config", "python:serving_platform.gunicorn_hooks", "--bind", f"127.0.0.1:{port}",
         "--workers", "1", "--threads", "8", "--worker-class", "gthread", "--graceful-timeout", "30"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(f"{url}/healthz", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, (
                tmp_path / "gunicorn.log"
            ).read_text()
            time.sleep(0.2)
        answers: list[int] = []

        def hold() -> None:
            headers = {
                "Authorization": f"Bearer {credential}",
                "If-None-Match": etag,
                **agent_protocol_headers(),
            }
            answers.append(
                requests.get(url + DESIRED, headers=headers, params={"wait": "25"}, timeout=60).status_code
            )

        holders = [threading.Thread(target=hold) for _ in range(2)]
        for holder in holders:
            holder.start()
        time.sleep(1.5)  # both polls are held now (the fast path holds them before Django)
        assert answers == [], "the polls were not held"
        started = time.monotonic()
        server.send_signal(stop)
        server.wait(20)
        took = time.monotonic() - started
        for holder in holders:
            holder.join(10)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)
        log.close()
    assert answers == [304, 304], (tmp_path / "gunicorn.log").read_text()
    assert took < 10, f"gunicorn took {took:.1f} s to stop with 2 held polls"
