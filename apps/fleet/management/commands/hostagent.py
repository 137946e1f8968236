"""``manage.py hostagent --platform URL``: the agent of one inference host.

It holds the platform's URL and this host's credential, nothing else - no database, no broker. The first start
exchanges the one-time join token staff got when they added the host (``--join-token`` or ``AGENT_JOIN_TOKEN``)
for the host's credential, kept in ``--credential-file`` (mode 0600, default ``FLEET_ROOT/host-credential``);
later starts read it from there. Then it supervises the host's Triton + GE instances (start, restart after a
crash with backoff, quarantine, reconcile of loaded models), polls the desired state every second and sends a
heartbeat with the NPU inventory every 10 s, all over the agent API (``/agent/v1/``). SIGTERM stops every
instance gracefully (in-flight requests finish).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from apps.fleet.agent import HostAgent
from apps.fleet.agent_client import (
    CredentialRefused,
    PlatformClient,
    PlatformError,
    join,
    load_credential,
)
from backend_ge.runtime import TritonError
from backend_ge.sandbox import SandboxError

log = logging.getLogger(__name__)


class Command(BaseCommand):
    help = (
        "Run the host agent: supervises this host's Triton instances, talks to the platform over /agent/v1/."
    )
    # No system checks: they are the platform's business, and some would open the database.
    requires_system_checks = []

    def add_arguments(self, parser):
        parser.add_argument(
            "--platform",
            default=settings.PLATFORM_URL,
            help="The platform's URL, e.g. https://platform.example.com (env PLATFORM_URL).",
        )
        parser.add_argument(
            "--join-token",
            default=settings.AGENT_JOIN_TOKEN,
            help="One-time join token from the host's page or POST /api/v1/hosts/ (env AGENT_JOIN_TOKEN).",
        )
        parser.add_argument(
            "--credential-file",
            default=str(settings.AGENT_CREDENTIAL_FILE),
            help="Where the host credential is kept, mode 0600 (env AGENT_CREDENTIAL_FILE; default "
            "FLEET_ROOT/host-credential).",
        )
        parser.add_argument(
            "--bind", default=None, help="Address tritonserver binds to (default: the host's address)."
        )
        parser.add_argument(
            "--wait", type=float, default=120.0, help="Seconds to wait for the platform to answer at start."
        )

    def handle(self, *args, **options):
        platform = options["platform"]
        if not platform:
            raise CommandError("Give the platform's URL: --platform URL or PLATFORM_URL.")
        credential_file = Path(options["credential_file"])
        token = options["join_token"]
        if token and not credential_file.is_file():
            self._join(platform, token, credential_file, options["wait"])
            token = ""  # used
        if not credential_file.is_file():
            raise CommandError(
                f"No host credential in {credential_file}: start once with --join-token (staff get one when "
                "they add the host, or from the host's page)."
            )
        try:
            client, hello = self._hello(platform, credential_file, options["wait"])
        except CredentialRefused as exc:
            if not token:
                raise CommandError(
                    f"{exc}. Ask staff for a new join token and start with --join-token."
                ) from None
            # Re-enrolled (say after a revocation): the new join token replaces the refused credential.
            self._join(platform, token, credential_file, options["wait"])
            try:
                client, hello = self._hello(platform, credential_file, options["wait"])
            except CredentialRefused as again:
                raise CommandError(str(again)) from None
        agent = HostAgent(
            client,
            hello["host"],
            bind_address=options["bind"] or hello["address"],
            credential_file=credential_file,
        )
        try:
            agent.start()
        except (SandboxError, TritonError) as exc:
            # The runtime tree or an instance's unprivileged user is not usable: say what, and stop.
            raise CommandError(
                f"host agent for {hello['host']} cannot run its Triton instances: {exc}"
            ) from None
        except PlatformError as exc:
            raise CommandError(f"host agent for {hello['host']}: {exc}") from None
        self.stdout.write(
            f"host agent for {hello['host']}: {len(agent.desired.all_instances())} instance(s), platform {platform}"
        )
        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        try:
            stop.wait()
        finally:
            log.info("stopping the instances of %s", hello["host"])
            agent.stop()

    def _join(self, platform: str, token: str, credential_file: Path, wait: float) -> None:
        try:
            answer = self._retry(wait, lambda: join(platform, token, credential_file))
        except PlatformError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"joined {platform} as host {answer['host']}; credential kept in {credential_file}")

    def _hello(self, platform: str, credential_file: Path, wait: float) -> tuple[PlatformClient, dict]:
        """The first call with the stored credential: who this host is (raises CredentialRefused on 401)."""
        client = PlatformClient(platform, load_credential(credential_file))
        try:
            return client, self._retry(wait, lambda: client.heartbeat({}))
        except CredentialRefused:
            raise
        except PlatformError as exc:
            raise CommandError(str(exc)) from None

    @staticmethod
    def _retry(wait: float, call):
        """The platform may still be starting (``make run`` starts everything at once): retry until ``wait``."""
        deadline = time.monotonic() + wait
        while True:
            try:
                return call()
            except CredentialRefused:
                raise
            except PlatformError as exc:
                if time.monotonic() >= deadline or "HTTP 4" in str(exc):
                    raise
                log.info("waiting for the platform: %s", exc)
                time.sleep(1.0)
