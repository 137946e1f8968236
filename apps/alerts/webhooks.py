"""Webhook URLs are tenant input: the SSRF guard, and a POST that connects only to the addresses it checked.

``check_webhook_url`` runs when a channel is saved and again before every delivery: only http(s), no
credentials in the URL, and (unless ``ALERT_WEBHOOK_ALLOW_PRIVATE``) every address the host name resolves to
must be a global one - no loopback, private, link-local, shared, reserved or multicast destination. The
delivery then connects to one of exactly those addresses (the name is not resolved a second time), so a DNS
answer that changes between check and connect cannot point the request at the platform's network.
Redirects are not followed.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import json
import socket
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

from django.conf import settings
from django.core.exceptions import ValidationError

MAX_URL_LENGTH = 500
RESPONSE_EXCERPT_BYTES = 2048


class WebhookRefused(ValidationError):
    """The URL or its destination is not allowed (never retried)."""


@dataclass(frozen=True)
class WebhookTarget:
    scheme: str
    host: str
    port: int
    path: str
    addresses: tuple[str, ...]


def _check_address(address: str) -> None:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if not ip.is_global or ip.is_multicast:
        raise WebhookRefused(
            f"The webhook's host resolves to {ip}, a loopback, private, link-local or reserved address; "
            "webhooks must go to a public address."
        )


def check_webhook_url(url: str, *, resolve: bool = True) -> WebhookTarget:
    """Parse and check a webhook URL; with ``resolve``, also resolve its host and check every address."""
    if not isinstance(url, str) or not url or len(url) > MAX_URL_LENGTH:
        raise WebhookRefused(f"Give an http(s) URL of at most {MAX_URL_LENGTH} characters.")
    if any(ord(char) < 33 or ord(char) == 127 for char in url):
        raise WebhookRefused("The URL contains spaces or control characters.")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise WebhookRefused("Only http:// and https:// webhook URLs are allowed.")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise WebhookRefused(
            "Credentials in the URL are refused (they would show in lists and logs); "
            "put a secret in the path instead."
        )
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise WebhookRefused("The URL's port is not a number between 1 and 65535.") from None
    host = parts.hostname or ""
    if not host or port == 0:
        raise WebhookRefused("The URL has no host (or port 0).")
    path = parts.path or "/"
    if parts.query:
        path = f"{path}?{parts.query}"
    addresses: tuple[str, ...] = ()
    if resolve:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            raise WebhookRefused(f"The webhook's host {host!r} does not resolve.") from None
        addresses = tuple(dict.fromkeys(info[4][0] for info in infos))
        if not addresses:
            raise WebhookRefused(f"The webhook's host {host!r} does not resolve.")
        if not settings.ALERT_WEBHOOK_ALLOW_PRIVATE:
            for address in addresses:
                _check_address(address)
    elif not settings.ALERT_WEBHOOK_ALLOW_PRIVATE:
        with contextlib.suppress(ValueError):  # a name: checked when it is resolved
            _check_address(host.strip("[]"))
    return WebhookTarget(parts.scheme, host, port, path, addresses)


class _PinnedHTTPConnection(http.client.HTTPConnection):
    def __init__(self, target: WebhookTarget, address: str, timeout: float):
        super().__init__(target.host, target.port, timeout=timeout)
        self._address = address

    def connect(self):
        self.sock = socket.create_connection((self._address, self.port), self.timeout)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, target: WebhookTarget, address: str, timeout: float):
        self._tls = ssl.create_default_context()
        super().__init__(target.host, target.port, timeout=timeout, context=self._tls)
        self._address = address

    def connect(self):
        sock = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._tls.wrap_socket(sock, server_hostname=self.host)


@dataclass(frozen=True)
class WebhookResponse:
    status: int
    excerpt: str


def post_json(url: str, body: dict, *, timeout: float) -> WebhookResponse:
    """POST ``body`` as JSON to a checked destination. Raises WebhookRefused or OSError (connection)."""
    target = check_webhook_url(url)
    data = json.dumps(body).encode()
    last_error: OSError | None = None
    for address in target.addresses:
        connection_class = _PinnedHTTPSConnection if target.scheme == "https" else _PinnedHTTPConnection
        connection = connection_class(target, address, timeout)
        try:
            connection.request(
                "POST",
                target.path,
                body=data,
                headers={"Content-Type": "application/json", "User-Agent": "triton-ge-platform-alerts/1"},
            )
            response = connection.getresponse()
            excerpt = response.read(RESPONSE_EXCERPT_BYTES).decode("utf-8", "replace")
            return WebhookResponse(response.status, excerpt)
        except (OSError, http.client.HTTPException) as error:  # refused, timed out, TLS, garbled answer
            last_error = error if isinstance(error, OSError) else OSError(f"bad HTTP answer: {error!r}")
        finally:
            connection.close()
    raise last_error or OSError("no address to connect to")
