"""``manage.py hostagent --name NAME``: the agent of one inference host.

It registers the host, supervises the host's Triton + GE instances (start, restart after a crash with
backoff, quarantine, reconcile of loaded models), sends a heartbeat with the NPU inventory every 10 s, and
runs a Celery worker on the host's own queue ``host.<name>`` for deploy/switch/undeploy work. SIGTERM stops
the worker, then every instance gracefully (in-flight requests finish).
"""

from __future__ import annotations

import logging

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from apps.fleet import services
from apps.fleet.agent import HostAgent
from apps.fleet.models import TritonInstance
from backend_ge.runtime import TritonError
from backend_ge.sandbox import SandboxError
from serving_platform.celery import app as celery_app

log = logging.getLogger(__name__)


class Command(BaseCommand):
    help = "Run the host agent: Triton instance supervisor + Celery worker on host.<name>."

    def add_arguments(self, parser):
        parser.add_argument("--name", required=True, help="Host name (lowercase letters, digits, hyphens).")
        parser.add_argument(
            "--address", default="127.0.0.1", help="Address clients reach this host's instances at."
        )
        parser.add_argument(
            "--bind", default=None, help="Address tritonserver binds to (default: --address)."
        )
        parser.add_argument(
            "--ensure-instance",
            metavar="NAME:HTTP:GRPC:METRICS",
            action="append",
            default=[],
            help="Create this CPU instance if the host has none by that name (the embedded default uses it).",
        )
        parser.add_argument("--concurrency", type=int, default=4, help="Worker threads for host tasks.")

    def handle(self, *args, **options):
        try:
            host = services.register_host(name=options["name"], address=options["address"])
        except ValidationError as exc:
            raise CommandError(f"invalid host: {'; '.join(exc.messages)}") from None
        for spec in options["ensure_instance"]:
            self._ensure_instance(host, spec)
        try:
            agent = HostAgent(host, bind_address=options["bind"] or options["address"]).start()
        except (SandboxError, TritonError) as exc:
            # The runtime tree or an instance's unprivileged user is not usable: say what, and stop.
            raise CommandError(f"host agent for {host.name} cannot run its Triton instances: {exc}") from None
        self.stdout.write(f"host agent for {host.name}: {host.instances.count()} instance(s)")
        worker = celery_app.Worker(
            hostname=f"agent@{host.name}",
            queues=[f"host.{host.name}"],
            pool="threads",
            concurrency=options["concurrency"],
            loglevel="INFO",
            without_gossip=True,
            without_mingle=True,
        )
        try:
            worker.start()
        finally:
            log.info("stopping the instances of %s", host.name)
            agent.stop()

    def _ensure_instance(self, host, spec: str) -> None:
        try:
            name, http, grpc, metrics = spec.split(":")
            ports = int(http), int(grpc), int(metrics)
        except ValueError:
            raise CommandError(
                f"--ensure-instance {spec!r}: expected NAME:HTTP:GRPC:METRICS, e.g. cpu-0:8100:8101:8102"
            ) from None
        if TritonInstance.objects.filter(host=host, name=name).exists():
            return
        try:
            services.create_instance(
                actor=None,
                host=host,
                name=name,
                http_port=ports[0],
                grpc_port=ports[1],
                metrics_port=ports[2],
            )
        except ValidationError as exc:
            raise CommandError(f"--ensure-instance {spec!r}: {'; '.join(exc.messages)}") from None
