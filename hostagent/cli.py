"""``python -m hostagent --platform URL``: the agent of one inference host.

The first start exchanges the one-time join token staff got when they added the host (``--join-token`` or
``AGENT_JOIN_TOKEN``) for the host's credential, kept in ``--credential-file`` (mode 0600, default
``ROOT/host-credential``); later starts read it from there. Then it supervises the host's Triton + GE
instances until SIGTERM or SIGINT, which stop every instance gracefully (in-flight requests finish).
Exit codes: 0 after a signal, 2 for a bad option, 1 when the agent cannot run (no credential, refused, a
host that cannot run its instances), 3 when the platform does not serve this agent's protocol version
(``EXIT_PROTOCOL_REFUSED``: restarting cannot help until the agent or the platform is upgraded; tell the
service manager not to restart on it, e.g. systemd's ``RestartPreventExitStatus=3``).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from backend_ge.runtime import TritonError
from backend_ge.sandbox import SandboxError
from hostagent import config as agent_config
from hostagent.client import (
    CredentialRefused,
    PlatformClient,
    PlatformError,
    ProtocolRefused,
    join,
    load_credential,
)
from hostagent.supervisor import HostAgent

log = logging.getLogger("hostagent")

T = TypeVar("T")

EXIT_PROTOCOL_REFUSED = 3


class AgentFailed(RuntimeError):
    """The agent cannot run; the message says why and what to do."""


def _retry(wait: float, call: Callable[[], T]) -> T:
    """The platform may still be starting (``make run`` starts everything at once): retry until ``wait``."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return call()
        except (CredentialRefused, ProtocolRefused):
            raise
        except PlatformError as exc:
            if time.monotonic() >= deadline or "HTTP 4" in str(exc):
                raise
            log.info("waiting for the platform: %s", exc)
            time.sleep(1.0)


def _join(config: agent_config.AgentConfig, token: str) -> None:
    try:
        answer = _retry(config.wait, lambda: join(config.platform, token, config.credential_file))
    except ProtocolRefused:
        raise
    except PlatformError as exc:
        raise AgentFailed(str(exc)) from None
    print(f"joined {config.platform} as host {answer['host']}; credential kept in {config.credential_file}")


def _hello(config: agent_config.AgentConfig) -> tuple[PlatformClient, dict]:
    """The first call with the stored credential: who this host is (raises CredentialRefused on 401)."""
    client = PlatformClient(config.platform, load_credential(config.credential_file))
    try:
        return client, _retry(config.wait, lambda: client.heartbeat({}))
    except (CredentialRefused, ProtocolRefused):
        raise
    except PlatformError as exc:
        raise AgentFailed(str(exc)) from None


def connect(config: agent_config.AgentConfig) -> tuple[PlatformClient, dict]:
    """Join when needed, then say hello: (the client, who this host is)."""
    token = config.join_token
    credential_file: Path = config.credential_file
    if token and not credential_file.is_file():
        _join(config, token)
        token = ""  # used
    if not credential_file.is_file():
        raise AgentFailed(
            f"No host credential in {credential_file}: start once with --join-token (staff get one when "
            "they add the host, or from the host's page)."
        )
    try:
        return _hello(config)
    except CredentialRefused as exc:
        if not token:
            raise AgentFailed(f"{exc}. Ask staff for a new join token and start with --join-token.") from None
    # Re-enrolled (say after a revocation): the new join token replaces the refused credential.
    _join(config, token)
    try:
        return _hello(config)
    except CredentialRefused as again:
        raise AgentFailed(str(again)) from None


def run(config: agent_config.AgentConfig, stop: threading.Event) -> None:
    """Connect, start the supervisor, run until ``stop`` is set, then stop every instance gracefully."""
    client, hello = connect(config)
    agent = HostAgent(client, hello["host"], config, bind_address=config.bind or hello["address"])
    try:
        agent.start()
    except (SandboxError, TritonError) as exc:
        # The runtime tree or an instance's unprivileged user is not usable: say what, and stop.
        agent.stop()
        raise AgentFailed(f"host agent for {hello['host']} cannot run its Triton instances: {exc}") from None
    except ProtocolRefused:
        agent.stop()
        raise
    except PlatformError as exc:
        agent.stop()
        raise AgentFailed(f"host agent for {hello['host']}: {exc}") from None
    print(
        f"host agent for {hello['host']}: {len(agent.desired.all_instances())} instance(s), "
        f"platform {config.platform}",
        flush=True,
    )
    try:
        stop.wait()
    finally:
        log.info("stopping the instances of %s", hello["host"])
        agent.stop()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = agent_config.load(argv)
    except agent_config.ConfigError as exc:
        print(f"python -m hostagent: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        run(config, stop)
    except AgentFailed as exc:
        print(f"python -m hostagent: {exc}", file=sys.stderr)
        return 1
    except ProtocolRefused as exc:
        log.error("%s; exiting with code %d", exc, EXIT_PROTOCOL_REFUSED)
        return EXIT_PROTOCOL_REFUSED
    return 0
