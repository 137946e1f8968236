"""What ``make test-fast`` promises, checked while it runs: no test there starts a server process.

Loaded with ``-p tests.no_servers``. A test that starts tritonserver, HAProxy, gunicorn, a Celery worker or
beat, a host agent, the gateway command, a development server or Chromium without the mark that keeps it out
of the fast loop (``triton``, ``servers`` or ``browser``) fails, naming the command and the mark it needs.
Short commands (``haproxy -c``, a fake ``atc``, ``ldd``) stay allowed: they end before the test does.
"""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest

# Any of these marks keeps a test out of make test-fast (a test with Triton and HAProxy may carry one).
OUT_OF_THE_FAST_LOOP = ("triton", "servers", "browser")
# manage.py commands that serve until stopped.
MANAGE_SERVERS = {"gateway", "runserver", "celery"}
# Programs (or ``python -m`` modules) that serve until stopped.
PROGRAM_SERVERS = {"tritonserver": "triton", "gunicorn": "servers", "celery": "servers", "haproxy": "servers",
                   "hostagent": "servers"}  # fmt: skip

_violations: list[str] = []
_original_init = subprocess.Popen.__init__
_current: list[pytest.Item] = []


def mark_needed(argv: list[str]) -> str | None:
    """The mark a test that runs ``argv`` needs, or None for a command that is not a server."""
    if not argv:
        return None
    program, rest = os.path.basename(argv[0]), argv[1:]
    if program.startswith("python"):  # what it runs: -m module, or a script; -c code is a short check
        for index, word in enumerate(rest):
            if word == "-c":
                return None
            if word == "-m" and index + 1 < len(rest):
                program, rest = rest[index + 1], rest[index + 2 :]
                break
            if not word.startswith("-"):
                program, rest = os.path.basename(word), rest[index + 1 :]
                break
        else:
            return None
    if program == "manage.py":
        return "servers" if rest and rest[0] in MANAGE_SERVERS else None
    if program == "haproxy" and "-c" in rest:  # a configuration check, not a proxy
        return None
    if program in PROGRAM_SERVERS:
        return PROGRAM_SERVERS[program]
    if "chrom" in program or (program == "node" and "run-driver" in rest):  # Chromium, or Playwright's driver
        return "browser"
    return None


def command_line(args) -> list[str]:
    """Popen's ``args`` as a list of strings, whatever form it was given in."""
    if isinstance(args, str):
        try:
            return shlex.split(args)
        except ValueError:  # unbalanced quotes: the words are enough to recognise a program
            return args.split()
    if isinstance(args, bytes | os.PathLike):
        return [os.fsdecode(args)]
    return [os.fsdecode(part) for part in args]


def _checked_init(self, args, *rest, **kwargs):
    argv = command_line(args)
    needed = mark_needed(argv)
    item = _current[-1] if _current else None
    if (
        needed
        and item is not None
        and not any(item.get_closest_marker(mark) for mark in OUT_OF_THE_FAST_LOOP)
    ):
        message = (
            f"{item.nodeid} starts a server ({' '.join(argv[:4])} ...) without @pytest.mark.{needed}: "
            "mark it so that make test-fast leaves it out"
        )
        _violations.append(message)
        pytest.fail(message, pytrace=False)
    _original_init(self, args, *rest, **kwargs)


def pytest_configure(config) -> None:
    subprocess.Popen.__init__ = _checked_init


def pytest_unconfigure(config) -> None:
    subprocess.Popen.__init__ = _original_init


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current.append(item)
    item.stash[_seen_before] = len(_violations)
    try:
        yield
    finally:
        _current.pop()


_seen_before = pytest.StashKey[int]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # A server started from a thread fails only that thread, which pytest does not see: the test's own report
    # fails instead (a report is what reaches the controller when the tests run in several processes).
    outcome = yield
    report = outcome.get_result()
    new = _violations[item.stash.get(_seen_before, len(_violations)) :]
    if report.when == "call" and report.passed and new:
        report.outcome = "failed"
        report.longrepr = "\n".join(new)


def pytest_sessionfinish(session, exitstatus) -> None:
    if _violations and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    if _violations:
        terminalreporter.section("servers started in the fast loop")
        for line in _violations:
            terminalreporter.write_line(line)
