"""Fixtures for the tgp command line: a private config directory and a runner that calls the CLI in process
(``tgp.cli.main(argv)``) against the live server, as a pipeline would from outside."""

from __future__ import annotations

import io
import json
import sys
from dataclasses import dataclass

import pytest

from tgp import cli


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self):
        return json.loads(self.out)


@pytest.fixture
def tgp_home(tmp_path, monkeypatch):
    """XDG_CONFIG_HOME in the test's directory, and no TGP_* variables from the caller's environment."""
    home = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home))
    for name in ("TGP_URL", "TGP_TOKEN", "TGP_TEAM"):
        monkeypatch.delenv(name, raising=False)
    return home / "tgp"


@pytest.fixture
def tgp(tgp_home, capsys, monkeypatch):
    """Run ``tgp ARGS``; ``stdin`` text stands for a pipe into the command."""

    def run(*argv: str, stdin: str = "") -> Result:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        capsys.readouterr()
        code = cli.main(list(argv))
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


@pytest.fixture
def signed_in(tgp, live_server, make_token):
    """`tgp login` done with a maintainer-capable token of team vision (the owner's)."""
    _, secret = make_token(name="ci")
    result = tgp("login", "--url", live_server.url, stdin=secret + "\n")
    assert result.code == 0, result.err
    return secret
