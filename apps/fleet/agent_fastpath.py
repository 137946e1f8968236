"""The idle fleet's poll, answered before Django's middleware: ``GET /agent/v1/desired-state`` with an
``If-None-Match`` that still holds gets its 304 for one indexed query.

Every agent polls every second, so this answer is most of the platform's agent traffic. It answers only the
one case that needs nothing but the host's generation - a valid, unrevoked credential whose ETag is current;
everything else (a change, a wrong or revoked credential, any other path) goes to the Django view, which
applies every rule. Same answer as the view: a 304 with the ETag.
"""

from __future__ import annotations

from django.db import connection

from apps.fleet.models import CREDENTIAL_SCHEME, Host, hash_host_secret

PATH = "/agent/v1/desired-state"
_PREFIX = f"bearer {CREDENTIAL_SCHEME}_"


def _current_etag(credential: str) -> str | None:
    table = Host._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT desired_generation FROM {table} WHERE credential_hash = %s AND revoked_at IS NULL",  # noqa: S608 - the table name is ours
            [hash_host_secret(credential)],
        )
        row = cursor.fetchone()
    return f'"{row[0]}"' if row else None


class AgentPollFastPath:
    """WSGI middleware in front of the Django application (``serving_platform.wsgi``)."""

    def __init__(self, application) -> None:
        self.application = application

    def __call__(self, environ, start_response):
        etag = environ.get("HTTP_IF_NONE_MATCH")
        authorization = environ.get("HTTP_AUTHORIZATION", "")
        if (
            etag
            and environ.get("PATH_INFO") == PATH
            and environ.get("REQUEST_METHOD") == "GET"
            and authorization[: len(_PREFIX)].lower() == _PREFIX
        ):
            try:
                current = _current_etag(authorization.split(" ", 1)[1].strip())
            finally:
                connection.close_if_unusable_or_obsolete()
            if current is not None and current == etag:
                start_response("304 Not Modified", [("ETag", current)])
                return [b""]
        return self.application(environ, start_response)
