"""``make test-fast``'s guard (``tests/no_servers.py``) knows a server command from a short one."""

from __future__ import annotations

import pytest

from tests.no_servers import command_line, mark_needed


@pytest.mark.parametrize(
    ("args", "mark"),
    [
        (["/venv/bin/python", "-m", "celery", "-A", "serving_platform", "worker"], "servers"),
        (["/venv/bin/python", "-m", "gunicorn", "serving_platform.wsgi", "--bind", "127.0.0.1:0"], "servers"),
        (["/venv/bin/python", "-m", "hostagent", "--platform", "http://127.0.0.1:1"], "servers"),
        (["/venv/bin/python", "manage.py", "gateway"], "servers"),
        (["/usr/sbin/haproxy", "-W", "-db", "-f", "/tmp/gw/haproxy.cfg"], "servers"),
        ("haproxy -W -db -f '/tmp/a b/haproxy.cfg'", "servers"),
        (["/tmp/runtime/tritonserver", "--model-repository", "/tmp/repo"], "triton"),
        (["/usr/bin/chromium", "--headless"], "browser"),
        # Short commands that end before the test does.
        (["haproxy", "-c", "-q", "-f", "/tmp/gw/haproxy.cfg"], None),
        (["/venv/bin/python", "manage.py", "check"], None),
        (["/tmp/bin/atc", "--model=m.onnx", "--framework=5"], None),
        (["ldd", "/venv/lib/libtriton_python.so"], None),
        (["/venv/bin/python", "benchmarks/alerts.py", "--smoke"], None),
        # A server's name as an argument is not a server: a probe that checks it can execute tritonserver.
        (["/sandbox/python3", "-I", "-c", "import os", "/repo", "/run", "/runtime/tritonserver"], None),
        (["/usr/bin/ls", "/runtime/tritonserver"], None),
        (["/venv/bin/node", "/venv/playwright/driver/package/cli.js", "run-driver"], "browser"),
    ],
)
def test_a_server_command_needs_the_mark_that_keeps_it_out_of_the_fast_loop(args, mark):
    assert mark_needed(command_line(args)) == mark


GUARDED_TESTS = """
import subprocess
import sys
import threading


def test_starts_a_server_from_a_thread():
    def serve():
        try:
            subprocess.Popen([sys.executable, "-m", "hostagent", "--help"]).wait()
        except BaseException:
            pass  # the thread swallows what the guard raises; the run must fail anyway

    thread = threading.Thread(target=serve)
    thread.start()
    thread.join()


def test_runs_a_short_command():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
"""


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "two workers"])
def test_a_server_started_from_a_thread_fails_its_test_in_the_fast_loop(tmp_path, workers):
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "test_guarded.py").write_text(GUARDED_TESTS)
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.no_servers", "-p", "no:cacheprovider", "-p", "no:django",
         "-q", "--rootdir", str(tmp_path), "-c", "/dev/null", *workers, str(tmp_path / "test_guarded.py")],
        cwd=root, env={**__import__("os").environ, "PYTHONPATH": str(root)}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-2000:]
    assert "1 failed, 1 passed" in result.stdout, result.stdout[-3000:]
    assert "test_starts_a_server_from_a_thread" in result.stdout and "without @pytest.mark.servers" in (
        result.stdout
    )
