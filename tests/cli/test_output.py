"""tgp's output without a platform: the upload progress is a bar on a terminal and plain lines in a log."""

from __future__ import annotations

import io
import sys

from tgp.cli import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_lines_per_tenth_otherwise(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    bar = Progress()
    for done in (0, 50, 100):
        bar(done, 100)
    bar.close()
    assert "Uploading" in terminal.getvalue() and "100%" in terminal.getvalue()
    assert "uploaded" not in terminal.getvalue()

    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    lines = Progress()
    for done in range(0, 101, 5):
        lines(done, 100)
    lines.close()
    assert log.getvalue().splitlines() == [f"uploaded {n} of 100 bytes ({n}%)" for n in range(0, 101, 10)]
