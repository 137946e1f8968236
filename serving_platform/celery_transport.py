"""Kombu's filesystem transport for the embedded default (``make run``), with its message files written whole.

Kombu's own transport creates a message's file and then writes it: a worker listing the queue folder in
between takes the empty file and dies on it (``JSONDecodeError``, an unrecoverable error for the consumer),
and with it every process of ``make run``. Seen on a loaded machine a few minutes after the start, when a beat
task and a worker poll met. It also moves each file it takes to the system's temporary folder, where other
users may read a task's arguments.

Here a message is written to a hidden temporary name in the queue folder and renamed into place (a rename is
atomic in one folder), so a reader sees a message whole or not at all; a taken message is moved to the
platform's own ``processed_folder`` (0700 with the rest of ``var/celery``) and deleted once read. A file that is
not JSON (written by something else) is set aside with a warning instead of stopping the worker.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path
from queue import Empty
from time import monotonic_ns

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.json import dumps, loads

log = logging.getLogger(__name__)

TEMPORARY_PREFIX = "."  # a name kombu's reader never takes: it needs "<stamp>_<uuid>.<queue>.msg"


class Channel(filesystem.Channel):
    def _put(self, queue, payload, **kwargs):
        # Sorted by name = in the order sent (one monotonic clock for every process of the machine).
        name = f"{monotonic_ns():020d}_{uuid.uuid4()}.{queue}.msg"
        folder = Path(self.data_folder_out)
        temporary = folder / f"{TEMPORARY_PREFIX}{name}.tmp"
        try:
            with open(temporary, "wb") as file:
                file.write(dumps(payload).encode())
            os.replace(temporary, folder / name)
        except OSError as exc:
            temporary.unlink(missing_ok=True)
            raise ChannelError(f"Cannot add a message to {folder}") from exc

    def _get(self, queue):
        wanted = f"{queue}.msg"
        inbox, taken = Path(self.data_folder_in), Path(self.processed_folder)
        for name in sorted(os.listdir(inbox)):
            if name.startswith(TEMPORARY_PREFIX) or name.partition(".")[2] != wanted:
                continue
            try:
                os.replace(inbox / name, taken / name)  # only one reader wins a message
            except OSError:
                continue
            try:
                payload = (taken / name).read_bytes()
            except OSError as exc:
                raise ChannelError(f"Cannot read the message {name}") from exc
            try:
                message = loads(payload.decode())
            except (UnicodeDecodeError, json.JSONDecodeError):
                log.warning("message file %s is not a message; kept aside as %s.broken", name, name)
                os.replace(taken / name, taken / f"{name}.broken")
                continue
            if not self.store_processed:
                (taken / name).unlink(missing_ok=True)
            return message
        raise Empty()


class Transport(filesystem.Transport):
    Channel = Channel
