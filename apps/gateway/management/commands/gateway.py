"""``manage.py gateway``: run HAProxy (master-worker) as the inference gateway and keep it in sync."""

from __future__ import annotations

import signal
import threading

from django.core.management.base import BaseCommand, CommandError

from apps.gateway.haproxy import GatewayError
from apps.gateway.services import find_haproxy, run_gateway


class Command(BaseCommand):
    help = "Run the inference gateway (HAProxy) and keep its routes, tokens and limits in sync with the database."

    def add_arguments(self, parser):
        parser.add_argument(
            "--interval", type=float, default=None, help="Seconds between syncs (default: setting)."
        )

    def handle(self, *args, **options):
        try:
            find_haproxy()
        except GatewayError as exc:
            raise CommandError(str(exc)) from None
        stop = threading.Event()

        def _stop(signum, frame):
            stop.set()

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        try:
            run_gateway(stop, options["interval"])
        except GatewayError as exc:
            raise CommandError(str(exc)) from None
