"""Public addresses follow their binds unless set: the settings module imported under a given environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("GATEWAY_PUBLIC_URL", "GATEWAY_PUBLIC_GRPC", "GATEWAY_METRICS_URL", "PLATFORM_PUBLIC_URL")
READ = (
    "import json, django; django.setup(); from django.conf import settings; "
    f"print(json.dumps({{n: getattr(settings, n) for n in {NAMES!r}}}))"
)
BINDS = ("WEB_BIND", "GATEWAY_BIND", "GATEWAY_GRPC_BIND", "GATEWAY_STATS_BIND", *NAMES)


def settings_under(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in BINDS}
    return subprocess.run(
        [sys.executable, "-c", READ],
        cwd=ROOT,
        env={
            **clean,
            "DEBUG": "1",
            "VAR_DIR": str(tmp_path),
            "DJANGO_SETTINGS_MODULE": "serving_platform.settings",
            **env,
        },
        capture_output=True,
        text=True,
        timeout=120,
    )


def public_addresses(tmp_path: Path, **env: str) -> dict[str, str]:
    result = settings_under(tmp_path, **env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_defaults_point_at_the_default_binds(tmp_path):
    assert public_addresses(tmp_path) == {
        "GATEWAY_PUBLIC_URL": "http://127.0.0.1:8080",
        "GATEWAY_PUBLIC_GRPC": "127.0.0.1:8081",
        "GATEWAY_METRICS_URL": "http://127.0.0.1:8404/metrics",
        "PLATFORM_PUBLIC_URL": "http://127.0.0.1:8000",
    }


def test_public_addresses_follow_their_binds(tmp_path):
    assert public_addresses(
        tmp_path,
        GATEWAY_BIND="127.0.0.1:9000",
        GATEWAY_GRPC_BIND="10.1.2.3:9001",
        GATEWAY_STATS_BIND="::1:9404",
        WEB_BIND="192.168.0.7:8008",
    ) == {
        "GATEWAY_PUBLIC_URL": "http://127.0.0.1:9000",
        "GATEWAY_PUBLIC_GRPC": "10.1.2.3:9001",
        "GATEWAY_METRICS_URL": "http://[::1]:9404/metrics",
        "PLATFORM_PUBLIC_URL": "http://192.168.0.7:8008",
    }


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::", "*", ""])
def test_a_bind_to_every_address_is_called_at_localhost(tmp_path, wildcard):
    addresses = public_addresses(
        tmp_path, GATEWAY_BIND=f"{wildcard}:9000", GATEWAY_GRPC_BIND=f"{wildcard}:9001"
    )
    assert addresses["GATEWAY_PUBLIC_URL"] == "http://localhost:9000"
    assert addresses["GATEWAY_PUBLIC_GRPC"] == "localhost:9001"


def test_an_explicit_public_address_wins_over_the_bind(tmp_path):
    addresses = public_addresses(
        tmp_path,
        GATEWAY_BIND="0.0.0.0:8080",
        GATEWAY_PUBLIC_URL="https://infer.example.com",
        GATEWAY_PUBLIC_GRPC="grpc.example.com:443",
        WEB_BIND="0.0.0.0:8000",
        PLATFORM_PUBLIC_URL="https://platform.example.com",
    )
    assert addresses["GATEWAY_PUBLIC_URL"] == "https://infer.example.com"
    assert addresses["GATEWAY_PUBLIC_GRPC"] == "grpc.example.com:443"
    assert addresses["PLATFORM_PUBLIC_URL"] == "https://platform.example.com"


@pytest.mark.parametrize(
    "bind", ["127.0.0.1", "127.0.0.1:0", "127.0.0.1:8080,::1:8080", "unix@/run/gw.sock:1", "host:http"]
)
def test_a_bind_no_client_address_derives_from_stops_startup_unless_the_public_address_is_set(tmp_path, bind):
    result = settings_under(tmp_path, GATEWAY_BIND=bind)
    assert result.returncode != 0
    assert f"GATEWAY_BIND={bind!r}: cannot derive a client address from it" in result.stderr
    assert "set the public address explicitly" in result.stderr
    addresses = public_addresses(tmp_path, GATEWAY_BIND=bind, GATEWAY_PUBLIC_URL="http://gw.internal:8080")
    assert addresses["GATEWAY_PUBLIC_URL"] == "http://gw.internal:8080"
