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
