"""Hosts joined the way an agent joins, for tests of the agent API (no agent process)."""

from __future__ import annotations

from django.test import Client

from apps.fleet import services
from apps.fleet.models import Host, TritonInstance

DESIRED = "/agent/v1/desired-state"


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
    return host, Client(HTTP_AUTHORIZATION=f"Bearer {credential}"), instance


def etag_of(host: Host) -> str:
    host.refresh_from_db()
    return f'"{host.desired_generation}"'
