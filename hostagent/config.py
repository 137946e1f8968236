"""The host agent's configuration: one typed object read from the command line and the environment.

Every option has a flag and an environment variable (the flag wins); a value that cannot be read stops the
agent at start with a message naming the option, as the platform's settings do - a typo in a host's
environment must not surface hours later as odd behaviour. ``python -m hostagent --help`` lists them all.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from backend_ge.served_config import MAX_INSTANCE_COUNT


class ConfigError(ValueError):
    """An option's value cannot be used; the message names the option and what it must be."""


@dataclass(frozen=True)
class Option:
    flag: str
    env: str
    kind: type  # str, int, float or Path; a tuple of Paths for ``private_paths``
    default: object
    help: str
    minimum: float | None = None


# The agent's options, in the order ``--help`` lists them. ``field`` names are AgentConfig's attributes.
OPTIONS: dict[str, Option] = {
    "platform": Option(
        "--platform", "PLATFORM_URL", str, "", "The platform's URL, e.g. https://platform.example.com."
    ),
    "join_token": Option(
        "--join-token",
        "AGENT_JOIN_TOKEN",
        str,
        "",
        "One-time join token from the host's page or POST /api/v1/hosts/ (used once, at the first start).",
    ),
    "root": Option(
        "--root",
        "FLEET_ROOT",
        Path,
        Path("var/fleet"),
        "Directory of this host's instances, runtime tree and download cache.",
    ),
    "credential_file": Option(
        "--credential-file",
        "AGENT_CREDENTIAL_FILE",
        Path,
        None,
        "Where the host credential is kept, mode 0600 (default: ROOT/host-credential).",
    ),
    "bind": Option(
        "--bind", "AGENT_BIND", str, "", "Address tritonserver binds to (default: the host's address)."
    ),
    "wait": Option(
        "--wait",
        "AGENT_PLATFORM_WAIT",
        float,
        120.0,
        "Seconds to wait for the platform to answer at start.",
        0,
    ),
    "start_timeout": Option(
        "--start-timeout",
        "FLEET_START_TIMEOUT",
        int,
        120,
        "Seconds a tritonserver may take to become live.",
        5,
    ),
    "restart_base_delay_ms": Option(
        "--restart-base-delay-ms",
        "FLEET_RESTART_BASE_DELAY_MS",
        int,
        1000,
        "First delay before restarting a crashed tritonserver; doubles per crash up to 60 s.",
        0,
    ),
    "max_crashes": Option(
        "--max-crashes",
        "FLEET_MAX_CRASHES",
        int,
        5,
        "Crashes within the crash window that quarantine an instance.",
        1,
    ),
    "crash_window": Option(
        "--crash-window", "FLEET_CRASH_WINDOW", int, 600, "Seconds over which crashes are counted.", 1
    ),
    "max_model_instances": Option(
        "--max-model-instances",
        "FLEET_MAX_MODEL_INSTANCES",
        int,
        8,
        "Model instances (python stub processes) one served model may run on this host.",
        1,
    ),
    "reconcile_interval_ms": Option(
        "--reconcile-interval-ms",
        "FLEET_RECONCILE_INTERVAL_MS",
        int,
        5000,
        "How often Triton is compared with the placements.",
        50,
    ),
    "parallel_loads": Option(
        "--parallel-loads",
        "FLEET_PARALLEL_LOADS",
        int,
        4,
        "Models one instance loads at the same time (after a restart, a burst of deploys or activations); "
        "tritonserver gets as many load threads. 1 loads one after another.",
        1,
    ),
    "poll_interval_ms": Option(
        "--poll-interval-ms",
        "FLEET_POLL_INTERVAL_MS",
        int,
        1000,
        "Pause between desired-state polls when the platform does not hold them.",
        100,
    ),
    "long_poll_wait": Option(
        "--long-poll-wait",
        "FLEET_LONG_POLL_WAIT",
        int,
        25,
        "Seconds the platform may hold a desired-state poll (0: short polls).",
        0,
    ),
    "heartbeat_interval": Option(
        "--heartbeat-interval",
        "AGENT_HEARTBEAT_INTERVAL",
        float,
        10.0,
        "Seconds between heartbeats (host facts, NPU inventory, log tails).",
        0.1,
    ),
    "private_paths": Option(
        "--private-path",
        "AGENT_PRIVATE_PATHS",
        tuple,
        (),
        "A file or directory on this host that tritonserver and the python stubs must not read (repeatable; "
        "the variable separates paths with ':'). The agent's credential, its download cache and the other "
        "instances' repositories are always private.",
    ),
    "port_range": Option(
        "--port-range",
        "AGENT_PORT_RANGE",
        str,
        "",
        "Ports this agent owns for the instances the platform makes from its inventory, FIRST-LAST "
        "(three per instance), e.g. 18100-18199. Empty: only hand-declared instances.",
    ),
    "log_level": Option("--log-level", "AGENT_LOG_LEVEL", str, "INFO", "DEBUG, INFO, WARNING or ERROR."),
}

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclass(frozen=True)
class AgentConfig:
    """Everything the agent reads at start; nothing else configures it."""

    platform: str
    join_token: str = ""
    root: Path = Path("var/fleet")
    credential_file: Path | None = None
    bind: str = ""
    wait: float = 120.0
    start_timeout: int = 120
    restart_base_delay_ms: int = 1000
    max_crashes: int = 5
    crash_window: int = 600
    max_model_instances: int = MAX_INSTANCE_COUNT
    reconcile_interval_ms: int = 5000
    parallel_loads: int = 4
    poll_interval_ms: int = 1000
    long_poll_wait: int = 25
    heartbeat_interval: float = 10.0
    private_paths: tuple[Path, ...] = ()
    port_range: str = ""
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root).absolute())
        if self.credential_file is None:
            object.__setattr__(self, "credential_file", self.root / "host-credential")
        object.__setattr__(self, "credential_file", Path(self.credential_file).absolute())
        object.__setattr__(self, "private_paths", tuple(Path(p).absolute() for p in self.private_paths))
        for name, option in OPTIONS.items():
            value = getattr(self, name)
            if option.minimum is not None and value < option.minimum:
                raise ConfigError(
                    f"{option.flag} ({option.env}) = {value} is below the minimum {option.minimum:g}"
                )
        if self.log_level.upper() not in LOG_LEVELS:
            raise ConfigError(
                f"--log-level ({OPTIONS['log_level'].env}) must be one of {', '.join(LOG_LEVELS)}"
            )
        if self.port_range and self.ports() is None:
            raise ConfigError(
                f"--port-range ({OPTIONS['port_range'].env}) = {self.port_range!r} is not FIRST-LAST with "
                "1 <= FIRST <= LAST <= 65535"
            )
        if self.platform and not self.platform.startswith(("http://", "https://")):
            raise ConfigError(
                f"--platform ({OPTIONS['platform'].env}) = {self.platform!r} is not an http(s) URL"
            )

    def ports(self) -> dict | None:
        """The port range as the heartbeat sends it (``hostagent.protocol.check_port_range``), or None."""
        first, _, last = self.port_range.partition("-")
        if not (first.strip().isdigit() and last.strip().isdigit()):
            return None
        first_port, last_port = int(first), int(last)
        return {"first": first_port, "last": last_port} if 1 <= first_port <= last_port <= 65535 else None

    @property
    def cache_dir(self) -> Path:
        """Downloaded versions of every team: the agent's alone (servers read their repository's copies)."""
        return self.root / "cache"

    def host_root(self, host_name: str) -> Path:
        return self.root / host_name


def _convert(option: Option, raw: str, source: str):
    if option.kind is tuple:
        return tuple(Path(p) for p in raw.split(":") if p.strip())
    try:
        return option.kind(raw)
    except ValueError:
        raise ConfigError(
            f"{source} = {raw!r} is not {'an integer' if option.kind is int else 'a number'}"
        ) from None


def parser() -> argparse.ArgumentParser:
    described = argparse.ArgumentParser(
        prog="python -m hostagent",
        description=(
            "The host agent of one inference host: joins the platform once with a join token, then supervises "
            "this host's Triton + GE instances over the agent API with its host credential only."
        ),
        epilog="Every option can also be set by the environment variable named in its help; the flag wins.",
    )
    for name, option in OPTIONS.items():
        default = option.default if not isinstance(option.default, tuple) else "none"
        described.add_argument(
            option.flag,
            dest=name,
            action="append" if option.kind is tuple else "store",
            default=None,
            metavar=name.upper(),
            help=f"{option.help} [env {option.env}; default {default}]",
        )
    return described


def load(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> AgentConfig:
    """The configuration from ``argv`` (flags) over ``environ``; ConfigError on a bad value.
    ``--help`` and unknown flags exit through argparse as usual."""
    environ = os.environ if environ is None else environ
    args = parser().parse_args(argv)
    values = {}
    for name, option in OPTIONS.items():
        flag_value = getattr(args, name)
        if flag_value is not None:
            if option.kind is tuple:
                values[name] = tuple(Path(p) for p in flag_value)
            else:
                values[name] = _convert(option, flag_value, option.flag)
        elif environ.get(option.env, "").strip():
            values[name] = _convert(option, environ[option.env].strip(), option.env)
    known = {f.name for f in fields(AgentConfig)}
    assert set(OPTIONS) == known, "every AgentConfig field has an option"
    if not values.get("platform"):
        raise ConfigError("Give the platform's URL: --platform URL or PLATFORM_URL.")
    return AgentConfig(**values)
