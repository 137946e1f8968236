"""The rendered HAProxy configuration, the slot pool and the runtime changes computed between two states."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import replace

import pytest

from apps.gateway.haproxy import GatewayError, GatewayState, Route, Server, Slots, render_config, write_files
from apps.gateway.runtime import in_flight, runtime_commands, runtime_plan
from apps.gateway.state import options

KEY_A, KEY_B = "a" * 48, "b" * 48
SLOTS = Slots(4, {"s0": "d1"})


def state(**changes) -> GatewayState:
    base = GatewayState(
        backends={"d1": (Server(KEY_A, "127.0.0.1", 8100), Server(KEY_B, "127.0.0.1", 8200))},
        checks={"d1": "vision__mlp/versions/3"},
        weights={("d1", KEY_A): 100, ("d1", KEY_B): 100},
        routes={"vision__mlp": Route("vision", "d1", 3)},
        tokens={"abcd1234:" + "0" * 64: "vision:32503680000"},
        limits={"vision": "5"},
    )
    return replace(base, **changes)


def test_config_strips_client_credentials_and_keys_before_forwarding(tmp_path):
    config = render_config(state(), SLOTS, replace(options(), directory=tmp_path))
    frontend = config.split("frontend inference", 1)[1].split("frontend grpc", 1)[0]
    # The client's instance-key header goes first; its Authorization header before the request is routed.
    assert frontend.index("del-header x-ge-instance-key") < frontend.index("use_backend")
    assert frontend.index("http-request del-header authorization") < frontend.index("use_backend")
    assert "http-send-name-header x-ge-instance-key" in config
    # Every slot is declared, checked with the path its owner has in checks.map.
    for slot in ("s0", "s1", "s2", "s3"):
        assert f"backend {slot}\n" in config
        assert f"uri-lf /v2/models/%[str({slot}),map({tmp_path}/checks.map,-)]/ready" in config
    # Only one rand() draw, in one rule.
    assert frontend.count("rand(") == 1
    # The token's hash is kept per connection; both cached variables are dropped before a new header is
    # hashed, in both frontends (tests/gateway/test_connection_tokens.py has the behaviour).
    for section in (frontend, config.split("frontend grpc", 1)[1]):
        lines = section.splitlines()
        index = {name: next(i for i, line in enumerate(lines) if name in line) for name in (
            "unset-var(sess.tokkey) if !auth_cached", "unset-var(sess.auth) if !auth_cached",
            "sha2(256),hex,lower if !auth_cached", "set-var(txn.tokval) var(sess.tokkey),map(",
        )}  # fmt: skip
        assert sorted(index.values()) == list(index.values()), index
    assert "    tune.bufsize 16384" in config  # a retry copies the whole buffer on every request
    assert "    noreuseport" in config  # a second HAProxy on one of these ports fails instead of sharing it
    # No token secret in clear anywhere: only hashes in the map; routes name the slot.
    write_files(state(), SLOTS, replace(options(), directory=tmp_path))
    assert (tmp_path / "tokens.map").read_text() == f"abcd1234:{'0' * 64} vision:32503680000\n"
    assert (tmp_path / "models.map").read_text() == "vision__mlp vision/d1/s0/3/-/0/0\n"
    assert (tmp_path / "checks.map").read_text() == "s0 vision__mlp/versions/3\n"
    assert Slots.read(tmp_path / "slots.map", 4) == SLOTS


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed")
def test_haproxy_accepts_the_rendered_configuration(tmp_path):
    write_files(state(), SLOTS, replace(options(), directory=tmp_path))
    result = subprocess.run(
        ["haproxy", "-c", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "WARNING" not in result.stderr, result.stderr


def test_runtime_commands_change_maps_and_servers_without_a_reload(tmp_path):
    o = replace(options(), directory=tmp_path)
    new = state(
        tokens={"ffff0000:" + "1" * 64: "vision:32503680000"},
        routes={"vision__mlp": Route("vision", "d1", 0)},
        checks={"d1": "vision__mlp"},
        weights={("d1", KEY_A): 0, ("d1", KEY_B): 100},
    )
    assert new.structure() == state().structure()
    commands = runtime_commands(state(), SLOTS, new, SLOTS, o)
    assert commands == [
        f"set map {tmp_path}/checks.map s0 vision__mlp",
        f"set server s0/{KEY_A} state maint",
        f"set map {tmp_path}/models.map vision__mlp vision/d1/s0/0/-/0/0",
        f"add map {tmp_path}/tokens.map ffff0000:{'1' * 64} vision:32503680000",
        f"del map {tmp_path}/tokens.map abcd1234:{'0' * 64}",
    ]


def test_a_server_back_from_maintenance_is_down_until_checked(tmp_path):
    o = replace(options(), directory=tmp_path)
    out = state(weights={("d1", KEY_A): 0, ("d1", KEY_B): 100})
    back = runtime_commands(out, SLOTS, state(), SLOTS, o)
    # Drained out of maintenance (no request meanwhile), then DOWN until `rise` checks pass.
    assert back == [
        f"set server s0/{KEY_A} weight 100",
        f"set server s0/{KEY_A} state drain",
        f"set server s0/{KEY_A} health down",
        f"set server s0/{KEY_A} state ready",
    ]
    # A weight change of a server in rotation keeps it UP.
    heavier = state(weights={("d1", KEY_A): 50, ("d1", KEY_B): 100})
    assert runtime_commands(state(), SLOTS, heavier, SLOTS, o) == [
        f"set server s0/{KEY_A} weight 50",
        f"set server s0/{KEY_A} state ready",
    ]


def test_a_new_deployment_takes_a_free_slot_and_its_servers_are_added_at_run_time(tmp_path):
    o = replace(options(), directory=tmp_path)
    key_c = "c" * 48
    new = state()
    new.backends["d2"] = (Server(key_c, "127.0.0.1", 8300),)
    new.weights[("d2", key_c)] = 100
    new.checks["d2"] = "vision__other/versions/1"
    new.routes["vision__other"] = Route("vision", "d2", 1)
    slots = SLOTS.assign(new.backends, (), chunk=4)
    assert slots == Slots(4, {"s0": "d1", "s1": "d2"})
    commands = runtime_commands(state(), SLOTS, new, slots, o)
    # The health-check path first, then the server, then the route that names the slot.
    assert commands == [
        f"add map {tmp_path}/checks.map s1 vision__other/versions/1",
        f"add server s1/{key_c} 127.0.0.1:8300 weight 100 check inter 500ms fastinter 100ms downinter 100ms "
        "rise 2 fall 2 maxconn 64",
        f"enable health s1/{key_c}",
        f"set server s1/{key_c} state ready",
        f"add map {tmp_path}/models.map vision__other vision/d2/s1/1/-/0/0",
    ]
    # Undeployed again: route first, then the server leaves: maintenance, and its requests in flight counted
    # (never deleted: HAProxy would hand its memory, and a client's connection to it, to the next server).
    plan = runtime_plan(new, slots, state(), SLOTS, o, set())
    assert [c.text for c in plan.commands] == [
        f"del map {tmp_path}/checks.map s1",
        f"del map {tmp_path}/models.map vision__other",
        f"set server s1/{key_c} state maint",
        "show stat s1 4 -1",
    ]
    assert plan.commands[-1].leaving == ("s1", (key_c,))
    # Parked, then wanted again (here at another port): back in rotation as if added, without an `add server`.
    moved = state()
    moved.backends["d2"] = (Server(key_c, "127.0.0.1", 8400),)
    moved.weights[("d2", key_c)] = 100
    moved.checks["d2"] = "vision__other/versions/1"
    moved.routes["vision__other"] = Route("vision", "d2", 1)
    back = [c.text for c in runtime_plan(state(), SLOTS, moved, slots, o, set(), {("s1", key_c)}).commands]
    assert back == [
        f"add map {tmp_path}/checks.map s1 vision__other/versions/1",
        f"set server s1/{key_c} addr 127.0.0.1 port 8400",
        f"set server s1/{key_c} weight 100",
        f"set server s1/{key_c} state ready",
        f"add map {tmp_path}/models.map vision__other vision/d2/s1/1/-/0/0",
    ]


def test_requests_in_flight_are_read_from_show_stat():
    stat = "# pxname,svname,qcur,qmax,scur,smax\ns1,BACKEND,0,0,3,3\ns1,aaaa,0,0,0,1\ns1,bbbb,2,2,1,1\n"
    assert in_flight(stat) == {"BACKEND": 3, "aaaa": 0, "bbbb": 3}
    # An error instead of a table: unknown (the caller counts the servers as busy).
    assert in_flight("Can't find backend.\n") is None


def test_slots_keep_their_owner_skip_unavailable_ones_and_grow_in_chunks(tmp_path):
    slots = Slots(2, {"s1": "d7"})
    assert slots.assign(["d7", "d8"], (), 2).owners == {"s1": "d7", "s0": "d8"}
    # A slot freed in this sync (or still draining) is not handed out: the pool grows instead.
    grown = slots.assign(["d7", "d8"], {"s0"}, 2)
    assert grown.size == 4 and grown.owners == {"s1": "d7", "s2": "d8"}
    # After the highest slot in use first, so a freed slot is reused as late as possible.
    assert Slots(4, {"s1": "d7"}).assign(["d7", "d9"], (), 4).owners == {"s1": "d7", "s2": "d9"}
    # Read back after a restart: the pool is rounded up to whole chunks; junk lines are skipped.
    (tmp_path / "slots.map").write_text("s5 d3\ns6 d3c\nbogus line\ns7 ../x\n")
    assert Slots.read(tmp_path / "slots.map", 4) == Slots(8, {"s5": "d3", "s6": "d3c"})
    assert Slots.read(tmp_path / "missing.map", 4) == Slots(4, {})


def test_canary_route_renders_the_split(tmp_path):
    slots = Slots(4, {"s0": "d1", "s2": "d1c"})
    route = Route("vision", "d1", 3, canary_backend="d1c", canary_version=4, canary_weight=30)
    assert route.render(slots) == "vision/d1/s0/3/s2/4/30"


def test_a_model_name_outside_the_platform_alphabet_is_refused(tmp_path):
    with pytest.raises(GatewayError):
        render_config(state(checks={"d1": "x/../y"}), SLOTS, replace(options(), directory=tmp_path))


def test_the_grpc_message_filter_is_only_on_the_slots_grpc_twins(tmp_path):
    # A Lua filter costs every call it is attached to (~150k instructions): refusals, server-level calls and
    # streams must not carry it; every model call's backend (a slot's twin) must.
    config = render_config(state(), SLOTS, replace(options(), directory=tmp_path))
    sections = {block.split("\n", 1)[0]: block for block in config.split("\n\n")}
    frontend = next(block for name, block in sections.items() if name == "frontend grpc")
    assert "filter lua." not in frontend
    for slot in SLOTS.names():
        assert "    filter lua.grpc_walk\n" in sections[f"backend g{slot}"]
    assert "filter lua." not in sections["backend grpc_any"]
