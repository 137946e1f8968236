"""Typed readers for settings that come from the environment.

Each helper fails loudly with ImproperlyConfigured on a value it cannot read: a typo in a deployment's
environment must stop the process at start, not surface later as odd behaviour.
"""

from __future__ import annotations

import os

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean; use one of 1/0, true/false, yes/no, on/off")


def env_int(name: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name}={value} is below the minimum {minimum}")
    if maximum is not None and value > maximum:
        raise ImproperlyConfigured(f"{name}={value} is above the maximum {maximum}")
    return value


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None:
        return list(default)
    return [item.strip() for item in raw.split(",") if item.strip()]


# A listener bound to one of these answers on every address of the machine, loopback included; none of them
# is an address a client can call.
WILDCARD_HOSTS = frozenset({"", "*", "0.0.0.0", "::", "[::]"})


def address_of_bind(name: str, bind: str) -> str:
    """The ``host:port`` a client calls to reach a listener bound to ``bind`` (the value of setting ``name``).

    A specific address is kept (a bare IPv6 address gets its brackets); a wildcard bind (``0.0.0.0``, ``::``,
    ``*`` or no host) becomes ``localhost``, which reaches it from the same machine - anything else needs the
    public setting that derives from it. A bind that is not one ``host:port`` (a list, a port range, a unix
    socket) stops the process: say the public address instead.
    """
    host, sep, port = bind.strip().rpartition(":")
    if (
        not sep
        or not port.isdigit()
        or not 0 < int(port) < 65536
        or "," in host
        or "@" in host
        or "/" in host
    ):
        raise ImproperlyConfigured(
            f"{name}={bind!r}: cannot derive a client address from it (expected one host:port); "
            "set the public address explicitly"
        )
    if host in WILDCARD_HOSTS:
        host = "localhost"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"
