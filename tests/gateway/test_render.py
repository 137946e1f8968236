"""The rendered HAProxy configuration and the runtime changes computed between two states."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import replace

import pytest

from apps.gateway.haproxy import (
    GatewayError,
    GatewayState,
    Server,
    render_config,
    runtime_commands,
    write_files,
)
from apps.gateway.state import options

KEY_A, KEY_B = "a" * 48, "b" * 48


def state(**changes) -> GatewayState:
    base = GatewayState(
        backends={"d1": (Server(KEY_A, "127.0.0.1", 8100), Server(KEY_B, "127.0.0.1", 8200))},
        checked_models={"d1": "vision__mlp"},
        weights={("d1", KEY_A): 100, ("d1", KEY_B): 100},
        routes={"vision__mlp": "vision/d1/3"},
        tokens={"abcd1234:" + "0" * 64: "vision:32503680000"},
        limits={"vision": "5"},
    )
    return replace(base, **changes)


def test_config_strips_client_credentials_and_keys_before_forwarding(tmp_path):
    config = render_config(state(), replace(options(), directory=tmp_path))
    frontend = config.split("frontend inference", 1)[1].split("frontend grpc", 1)[0]
    # The client's instance-key header goes first; its Authorization header before the request is routed.
    assert frontend.index("del-header x-ge-instance-key") < frontend.index("use_backend")
    assert frontend.index("http-request del-header authorization") < frontend.index("use_backend")
    assert "http-send-name-header x-ge-instance-key" in config
    assert "option httpchk GET /v2/models/vision__mlp/ready" in config
    # No token secret in clear anywhere: only hashes in the map.
    write_files(state(), replace(options(), directory=tmp_path))
    assert (tmp_path / "tokens.map").read_text() == f"abcd1234:{'0' * 64} vision:32503680000\n"


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed")
def test_haproxy_accepts_the_rendered_configuration(tmp_path):
    write_files(state(), replace(options(), directory=tmp_path))
    result = subprocess.run(
        ["haproxy", "-c", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "WARNING" not in result.stderr, result.stderr


def test_runtime_commands_change_maps_and_servers_without_a_reload(tmp_path):
    o = replace(options(), directory=tmp_path)
    new = state(
        tokens={"ffff0000:" + "1" * 64: "vision:32503680000"},
        routes={"vision__mlp": "vision/d1/0"},
        weights={("d1", KEY_A): 0, ("d1", KEY_B): 100},
    )
    assert new.structure() == state().structure()
    commands = runtime_commands(state(), new, o)
    assert commands == [
        f"del map {tmp_path}/tokens.map abcd1234:{'0' * 64}",
        f"add map {tmp_path}/tokens.map ffff0000:{'1' * 64} vision:32503680000",
        f"set map {tmp_path}/models.map vision__mlp vision/d1/0",
        f"set server d1/{KEY_A} state maint",
    ]


def test_a_model_name_outside_the_platform_alphabet_is_refused(tmp_path):
    with pytest.raises(GatewayError):
        render_config(state(checked_models={"d1": "x/../y"}), replace(options(), directory=tmp_path))
