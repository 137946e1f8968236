"""Gunicorn server hooks of the platform's web processes (``gunicorn -c python:serving_platform.gunicorn_hooks``).

A web process holds agents' long polls for up to ``AGENT_LONG_POLL_MAX_WAIT`` s (``apps.fleet.long_poll``). On a
stop, gunicorn waits for every request in flight - the held polls included - and a quick stop (SIGINT, SIGQUIT)
joins the request threads at exit, so without these hooks a stop took as long as the longest held poll (up to
30 s; ``make run``'s Ctrl-C ended it with SIGKILL). Here a stopping worker answers its held polls at once:
a graceful stop (SIGTERM) still lets every other request finish.
"""

from __future__ import annotations

import signal


def _release_held_polls() -> None:
    from apps.fleet import long_poll  # Django is set up in the worker by now

    long_poll.watcher().release_all()


def post_worker_init(worker) -> None:
    """Wrap the worker's SIGTERM handler (installed before this hook runs): release, then stop gracefully."""
    graceful = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame) -> None:
        _release_held_polls()
        if callable(graceful):
            graceful(signum, frame)

    signal.signal(signal.SIGTERM, on_term)


def worker_int(worker) -> None:
    """SIGINT or SIGQUIT: gunicorn exits the worker right after this hook."""
    _release_held_polls()
