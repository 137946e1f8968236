"""The idle fleet's poll, answered before Django's middleware: ``GET /agent/v1/desired-state`` with an
``If-None-Match`` that still holds gets its 304 without the Django stack.

- A short poll (no ``wait``): one indexed query, then the 304.
- A long poll (``?wait=25``): held by the process's watcher (``apps.fleet.long_poll``) until the host's
  generation changes or the wait ends (then the 304). The held request uses no database connection of its
  own: the watcher reads every waiting host's generation in one query.

Every other request goes to Django through ``DatabaseSlots``, a pool of ``WEB_DATABASE_CONNECTIONS``
connections: a process with hundreds of threads for held polls opens that many PostgreSQL connections at
most.

It answers only the one case that needs nothing but the host's generation - a valid, unrevoked credential
whose ETag is current, from an agent speaking a served agent protocol; everything else (a change, a wrong or
revoked credential, a bad ``wait``, an agent protocol the platform refuses or a malformed one, any other
path) goes to the Django view, which applies every rule. Same answer as the view: a 304 with the ETag.
"""

from __future__ import annotations

import queue
import threading

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from apps.fleet import long_poll
from apps.fleet.models import CREDENTIAL_SCHEME, Host, hash_host_secret
from hostagent import protocol

PATH = "/agent/v1/desired-state"
_PREFIX = f"bearer {CREDENTIAL_SCHEME}_"


def _current_etag(credential_hash: str) -> str | None:
    table = Host._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT desired_generation FROM {table} WHERE credential_hash = %s AND revoked_at IS NULL",  # noqa: S608 - the table name is ours
            [credential_hash],
        )
        row = cursor.fetchone()
    return f'"{row[0]}"' if row else None


def _served(header: str | None) -> bool:
    """The agent speaks a protocol version the platform serves (the view refuses the others, and says why)."""
    try:
        protocol.check_agent_protocol(header)
    except protocol.ProtocolError:
        return False
    return True


class DatabaseSlots:
    """A small pool of database connections for a process with many threads. A request that goes to Django
    takes one of ``limit`` connections (waiting, holding none, while all are in use), uses it as its thread's
    connection, and gives it back when the server closes its response. Django's own ``close_old_connections``
    still runs at the start and end of every request (``DATABASE_CONN_MAX_AGE``, health checks, errors).

    Without it each of a process's threads keeps a connection of its own: hundreds of threads for held polls
    would be hundreds of PostgreSQL connections, and closing them instead would cost a reconnect on most
    requests. A thread that already has a connection of its own (a test, a management command) keeps it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        # Last in, first out: under light load the same few connections stay warm.
        self._free: queue.LifoQueue[BaseDatabaseWrapper | None] = queue.LifoQueue()
        for _ in range(limit):
            self._free.put(None)

    def _take(self) -> BaseDatabaseWrapper | None:
        if connections.all(initialized_only=True):
            return None  # this thread has its own connection: use it
        wrapper = self._free.get()
        if wrapper is None:
            wrapper = connections.create_connection(DEFAULT_DB_ALIAS)
            wrapper.inc_thread_sharing()  # handed from thread to thread, used by one at a time
        connections[DEFAULT_DB_ALIAS] = wrapper
        return wrapper

    def _give_back(self, wrapper: BaseDatabaseWrapper | None) -> None:
        if wrapper is None:
            return
        del connections[DEFAULT_DB_ALIAS]
        if (
            wrapper.in_atomic_block
        ):  # a request that left a transaction open: the next one must not inherit it
            wrapper.close()
        self._free.put(wrapper)

    def close_idle(self) -> None:
        """Close the connections no request is using (they reconnect when next taken)."""
        idle = []
        while True:
            try:
                idle.append(self._free.get_nowait())
            except queue.Empty:
                break
        for wrapper in idle:
            if wrapper is not None:
                wrapper.close()
            self._free.put(wrapper)

    def call(self, application, environ, start_response):
        wrapper = self._take()
        try:
            result = application(environ, start_response)
        except BaseException:
            self._give_back(wrapper)
            raise
        if isinstance(result, environ.get("wsgi.file_wrapper", ())):
            # A file streams without the database: give the connection back now, keep the server's sendfile.
            self._give_back(wrapper)
            return result
        return _ReleasedOnClose(result, lambda: self._give_back(wrapper))

    def query(self, function, *args):
        """``function(*args)`` on a pooled connection, outside a Django request."""
        wrapper = self._take()
        try:
            return function(*args)
        finally:
            connection.close_if_unusable_or_obsolete()
            self._give_back(wrapper)


_slots: DatabaseSlots | None = None
_slots_lock = threading.Lock()


def database_slots() -> DatabaseSlots:
    """The process's one ``DatabaseSlots``."""
    global _slots
    with _slots_lock:
        if _slots is None:
            _slots = DatabaseSlots(settings.WEB_DATABASE_CONNECTIONS)
        return _slots


class _ReleasedOnClose:
    """The response body, unchanged; ``close()`` (the server calls it after the last byte) gives the
    connection back, after Django's own ``request_finished`` handlers ran."""

    def __init__(self, result, release) -> None:
        self._result = result
        self._release = release

    def __iter__(self):
        return iter(self._result)

    def close(self) -> None:
        try:
            if hasattr(self._result, "close"):
                self._result.close()
        finally:
            release, self._release = self._release, None
            if release is not None:
                release()


class AgentPollFastPath:
    """WSGI middleware in front of the Django application (``serving_platform.wsgi``)."""

    def __init__(self, application) -> None:
        self.django = application
        self.slots = database_slots()

    def application(self, environ, start_response):
        return self.slots.call(self.django, environ, start_response)

    def __call__(self, environ, start_response):
        etag = environ.get("HTTP_IF_NONE_MATCH")
        authorization = environ.get("HTTP_AUTHORIZATION", "")
        if (
            etag
            and environ.get("PATH_INFO") == PATH
            and environ.get("REQUEST_METHOD") == "GET"
            and authorization[: len(_PREFIX)].lower() == _PREFIX
            and _served(environ.get(protocol.AGENT_PROTOCOL_WSGI_KEY))
        ):
            try:
                wait = long_poll.parse_wait(environ.get("QUERY_STRING", ""))
            except long_poll.BadWait:
                return self.application(environ, start_response)  # the view: 401 first, else the 400
            credential_hash = hash_host_secret(authorization.split(" ", 1)[1].strip())
            if wait:
                changed = long_poll.watcher().wait_for_change(credential_hash, etag, wait)
                if changed is False:
                    start_response("304 Not Modified", [("ETag", etag)])
                    return [b""]
                if changed:
                    environ[long_poll.HELD] = True
                    return self.application(environ, start_response)
                # None: this process holds as many polls as it may; answer it as a short poll.
            current = self.slots.query(_current_etag, credential_hash)
            if current is not None and current == etag:
                start_response("304 Not Modified", [("ETag", current)])
                return [b""]
        return self.application(environ, start_response)
