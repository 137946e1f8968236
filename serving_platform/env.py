"""Typed readers for settings that come from the environment.

Each helper fails loudly with ImproperlyConfigured on a value it cannot read: a typo in a deployment's
environment must stop the process at start, not surface later as odd behaviour. Each variable is declared
once, with its type, default, minimum and meaning, in ``serving_platform.config_reference``; the helpers take
them from there, and the documentation's configuration reference is generated from the same list.
"""

from __future__ import annotations

import os

from django.core.exceptions import ImproperlyConfigured

from serving_platform.config_reference import DERIVED, VARIABLES, Variable

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_UNSET = object()
_HELPER_TYPES = {
    "env_str": ("str", "path", "url"),
    "env_bool": ("bool",),
    "env_int": ("int",),
    "env_list": ("list",),
}


def _declared(helper: str, name: str, default: object, minimum: int | None) -> tuple[object, int | None]:
    """The default and minimum of ``name``: its declaration's (serving_platform.config_reference).

    A declared variable takes both from its declaration, so the documented default is the one in force; only a
    DERIVED default (computed by settings from other settings) is passed by the caller. An undeclared name is
    read with the caller's default - settings never do that (a test checks), the helpers' own tests do.
    """
    var: Variable | None = VARIABLES.get(name)
    if var is None:
        if default is _UNSET:
            raise ImproperlyConfigured(f"{name} is not declared in serving_platform.config_reference")
        return default, minimum
    if var.type not in _HELPER_TYPES[helper]:
        raise ImproperlyConfigured(f"{name} is declared as {var.type}; {helper} cannot read it")
    if minimum is not None:
        raise ImproperlyConfigured(f"{name}: its minimum is declared in serving_platform.config_reference")
    if var.default is DERIVED:
        if default is _UNSET:
            raise ImproperlyConfigured(f"{name} has a derived default: pass it")
        return default, var.minimum
    if default is not _UNSET:
        raise ImproperlyConfigured(f"{name}: its default is declared in serving_platform.config_reference")
    return var.default, var.minimum


def env_str(name: str, default: str | None | object = _UNSET) -> str | None:
    """The variable's text; unset or empty gives the default."""
    default, _ = _declared("env_str", name, default, None)
    return os.environ.get(name) or default


def env_bool(name: str, default: bool | object = _UNSET) -> bool:
    default, _ = _declared("env_bool", name, default, None)
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean; use one of 1/0, true/false, yes/no, on/off")


def env_int(
    name: str, default: int | object = _UNSET, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    default, minimum = _declared("env_int", name, default, minimum)
    var = VARIABLES.get(name)
    if var is not None:
        if maximum is not None:
            raise ImproperlyConfigured(
                f"{name}: its maximum is declared in serving_platform.config_reference"
            )
        maximum = var.maximum
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


def env_list(name: str, default: list[str] | object = _UNSET) -> list[str]:
    default, _ = _declared("env_list", name, default, None)
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
