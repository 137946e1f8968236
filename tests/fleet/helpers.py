"""Hosts joined the way an agent joins, for tests of the agent API (no agent process)."""

from __future__ import annotations

from django.test import Client

from apps.fleet import services
from apps.fleet.models import Host, TritonInstance
from hostagent import protocol

DESIRED = "/agent/v1/desired-state"
# The agent protocol header every agent sends, as a test client's or WSGI environ's key.
AGENT_HEADERS = {protocol.AGENT_PROTOCOL_WSGI_KEY: str(protocol.AGENT_PROTOCOL_VERSION)}


def agent_client(credential: str | None = None) -> Client:
    """A test client that calls the agent API as an agent of this protocol version does (with the host's
    credential, when given)."""
    if credential is None:
        return Client(**AGENT_HEADERS)
    return Client(HTTP_AUTHORIZATION=f"Bearer {credential}", **AGENT_HEADERS)


def joined(name: str, port: int = 18100) -> tuple[Host, str, TritonInstance]:
    """A host created by staff and joined with its token, with one instance: (host, credential, instance)."""
    host, token = services.create_host(actor=None, name=name, address="127.0.0.1")
    host, credential = services.join_host(token)
    instance = services.create_instance(
        actor=None, host=host, name="cpu-0", http_port=port, grpc_port=port + 1, metrics_port=port + 2
    )
    host.refresh_from_db()
    return host, credential, instance


def joined_client(name: str, port: int = 18100) -> tuple[Host, Client, TritonInstance]:
    """As ``joined``, with a test client that sends the host's credential."""
    host, credential, instance = joined(name, port)
    return host, agent_client(credential), instance


def etag_of(host: Host) -> str:
    host.refresh_from_db()
    return f'"{host.desired_generation}"'
