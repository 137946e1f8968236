"""The idle poll's 304 in front of Django answers only a current ETag of a valid, unrevoked credential; anything
else reaches the Django view, which applies every rule."""

from __future__ import annotations

import pytest

from apps.fleet import services
from apps.fleet.agent_fastpath import PATH, AgentPollFastPath
from hostagent.protocol import AGENT_PROTOCOL_VERSION, AGENT_PROTOCOL_WSGI_KEY

pytestmark = pytest.mark.django_db


def call(
    credential: str, etag: str, path: str = PATH, agent_protocol: str | None = str(AGENT_PROTOCOL_VERSION)
) -> tuple[str, str]:
    seen = {}

    def django(environ, start_response):
        start_response("200 OK", [])
        return [b"django"]

    def start_response(status, headers):
        seen["status"] = status

    app = AgentPollFastPath(django)
    environ = {
        "PATH_INFO": path,
        "REQUEST_METHOD": "GET",
        "HTTP_IF_NONE_MATCH": etag,
        "HTTP_AUTHORIZATION": f"Bearer {credential}",
    }
    if agent_protocol is not None:
        environ[AGENT_PROTOCOL_WSGI_KEY] = agent_protocol
    body = b"".join(app(environ, start_response))
    return seen["status"], body.decode()


def test_a_current_etag_gets_304_and_anything_else_goes_to_django(monkeypatch):
    from django.db import connection

    # Between requests the server recycles an old connection; inside the test's transaction it must stay.
    monkeypatch.setattr(connection, "close_if_unusable_or_obsolete", lambda: None)
    host, token = services.create_host(actor=None, name="fast", address="127.0.0.1")
    host, credential = services.join_host(token)
    etag = f'"{host.desired_generation}"'
    assert call(credential, etag)[0] == "304 Not Modified"
    assert call(credential, '"0"')[1] == "django"  # changed: the view sends the new state
    assert call(credential, etag, path="/agent/v1/heartbeat")[1] == "django"
    # An agent protocol the platform refuses, or a malformed header: the view answers 426 or 400.
    for spoken in (None, "0", str(AGENT_PROTOCOL_VERSION + 1), "1 ", "x1", "٣", "9" * 50):
        assert call(credential, etag, agent_protocol=spoken)[1] == "django", spoken
    assert call("hag_not-a-credential", etag)[1] == "django"  # the view answers 401
    services.notify_hosts([host.pk])
    assert call(credential, etag)[1] == "django"
    services.revoke_host(actor=None, host=host)
    assert call(credential, f'"{host.desired_generation + 1}"')[1] == "django"
