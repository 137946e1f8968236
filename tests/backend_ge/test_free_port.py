"""free_port(): the ports a test gives a gateway, an agent's tritonserver and the others never repeat."""

from __future__ import annotations

import socket

from backend_ge.runtime import free_port


def test_free_port_never_hands_out_the_same_port_twice():
    # The kernel picks at random among ~14,000 ports: 2,000 raw picks repeat one about 140 times.
    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)


def test_a_handed_out_port_can_be_bound():
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        assert s.getsockname()[1] == port
