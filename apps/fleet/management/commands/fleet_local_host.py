"""``manage.py fleet_local_host``: the host of ``make run``, on the platform's own machine.

Run on the platform side (it opens the database): it adds the host and its CPU instances when they are missing,
as staff would, and when ``--credential-file`` does not hold the host's current credential it joins the host
and writes a new one there (mode 0600). ``python -m hostagent --platform http://127.0.0.1:8000
--credential-file FILE`` then runs the local agent over loopback, through the same agent API as any other host.
"""

from __future__ import annotations

from pathlib import Path

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from apps.fleet import pools, services
from apps.fleet.models import Host, Pool, TritonInstance, hash_host_secret
from hostagent import config as agent_config
from hostagent.client import save_credential


class Command(BaseCommand):
    help = "Add the local host and its instances if missing, and keep its agent's credential in a file."

    def add_arguments(self, parser):
        parser.add_argument("--name", default="local")
        parser.add_argument("--address", default="127.0.0.1")
        parser.add_argument(
            "--instance",
            metavar="NAME:HTTP:GRPC:METRICS",
            action="append",
            default=[],
            help="A CPU instance to create if the host has none by that name, e.g. cpu-0:8100:8101:8102.",
        )
        parser.add_argument(
            "--pool",
            default=None,
            help="A shared CPU pool to put the host in (created if missing), so deployments that ask for "
            "replicas rather than instances are placed on it.",
        )
        parser.add_argument(
            "--credential-file",
            default=None,
            help="Where the local agent's credential is kept (default: where `python -m hostagent` reads it with "
            "this environment, AGENT_CREDENTIAL_FILE or FLEET_ROOT/host-credential).",
        )

    def handle(self, *args, **options):
        host = Host.objects.filter(name=options["name"]).first()
        try:
            if host is None:
                host, _ = services.create_host(actor=None, name=options["name"], address=options["address"])
            for spec in options["instance"]:
                self._ensure_instance(host, spec)
            if options["pool"]:
                self._ensure_pool(host, options["pool"])
        except ValidationError as exc:
            raise CommandError("; ".join(exc.messages)) from None
        path = Path(options["credential_file"] or self._agents_credential_file())
        current = path.read_text().strip() if path.is_file() else ""
        if current and host.revoked_at is None and hash_host_secret(current) == host.credential_hash:
            self.stdout.write(f"host {host.name}: credential in {path} is current")
            return
        host, credential = services.join_host(services.issue_join_token(actor=None, host=host))
        save_credential(path, credential)
        self.stdout.write(f"host {host.name}: new credential written to {path}")

    def _ensure_pool(self, host: Host, name: str) -> None:
        """The host in the pool ``name`` (a shared CPU pool, created as staff would); a host already in
        another pool stays there."""
        if host.pool_id is not None:
            return
        pool = Pool.objects.filter(name=name).first() or pools.create_pool(actor=None, name=name)
        Host.objects.filter(pk=host.pk).update(labels={**host.labels, pools.POOL_LABEL: name}, pool=pool)
        self.stdout.write(f"host {host.name}: in pool {pool.name}")

    @staticmethod
    def _agents_credential_file() -> Path:
        """The file the local agent reads, by the agent's own rules for this environment."""
        try:
            return agent_config.load(["--platform", "http://127.0.0.1"]).credential_file
        except agent_config.ConfigError as exc:
            raise CommandError(f"the host agent's configuration: {exc}") from None

    def _ensure_instance(self, host: Host, spec: str) -> None:
        try:
            name, http, grpc, metrics = spec.split(":")
            ports = int(http), int(grpc), int(metrics)
        except ValueError:
            raise CommandError(
                f"--instance {spec!r}: expected NAME:HTTP:GRPC:METRICS, e.g. cpu-0:8100:8101:8102"
            ) from None
        if not TritonInstance.objects.filter(host=host, name=name).exists():
            services.create_instance(
                actor=None,
                host=host,
                name=name,
                http_port=ports[0],
                grpc_port=ports[1],
                metrics_port=ports[2],
            )
