"""The embedded default's broker (``filesystem://``): a reader never takes a message before it is whole, only
one reader takes each, and a stray file in the queue folder does not stop a worker."""

from __future__ import annotations

import threading
from pathlib import Path
from queue import Empty

import pytest
from kombu import Connection

import serving_platform.celery  # noqa: F401 - the platform's Celery app sets the alias on import
from serving_platform.celery_transport import Transport


@pytest.fixture
def folders(tmp_path) -> dict[str, str]:
    names = {"data_folder_in": "queue", "data_folder_out": "queue", "processed_folder": "processed"}
    for name in set(names.values()):
        (tmp_path / name).mkdir()
    return {option: str(tmp_path / name) for option, name in names.items()} | {"store_processed": False}


def channel(folders):
    connection = Connection(transport=Transport, transport_options=folders)
    return connection, connection.default_channel


def test_the_platforms_filesystem_broker_is_the_atomic_one():
    """``filesystem://`` is ours once the platform's Celery app is imported (web, worker and beat import it)."""
    with Connection("filesystem://", transport_options={"data_folder_in": "/", "data_folder_out": "/"}) as c:
        assert isinstance(c.transport, Transport)


def test_messages_come_back_whole_in_order_and_once(folders):
    connection, chan = channel(folders)
    with connection:
        for n in range(3):
            chan._put("jobs", {"n": n, "body": "x" * 100})
        assert [chan._get("jobs")["n"] for _ in range(3)] == [0, 1, 2]
        with pytest.raises(Empty):
            chan._get("jobs")
    assert not list(Path(folders["processed_folder"]).iterdir()), "a read message is deleted"


def test_a_reader_racing_writers_never_sees_a_partial_message(folders):
    """Kombu's own transport creates the file and then writes it: a reader in between got an empty file and
    the worker died on it. Big payloads from two writers against one reader, bounded in count and time."""
    connection, chan = channel(folders)
    total, payload = 600, "y" * 256 * 1024
    received, errors = [], []

    def write(start: int) -> None:
        _, own = channel(folders)
        for n in range(start, total, 2):
            own._put("jobs", {"n": n, "body": payload})

    def read() -> None:
        deadline = threading.Event()
        threading.Timer(60, deadline.set).start()
        while len(received) < total and not deadline.is_set():
            try:
                message = chan._get("jobs")
            except Empty:
                continue
            except Exception as exc:  # noqa: BLE001 - the failure under test
                errors.append(exc)
                return
            if message["body"] != payload:
                errors.append(f"message {message['n']} arrived cut to {len(message['body'])} bytes")
            received.append(message["n"])
        deadline.set()

    with connection:
        threads = [threading.Thread(target=write, args=(s,)) for s in (0, 1)] + [
            threading.Thread(target=read)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
    assert not errors, errors[:3]
    assert sorted(received) == list(range(total))


def test_a_stray_file_in_the_queue_is_set_aside_and_the_next_message_still_comes(folders):
    queue = Path(folders["data_folder_in"])
    (queue / "0_stray.jobs.msg").write_bytes(b"")
    (queue / ".1_unfinished.jobs.msg.tmp").write_bytes(b'{"half": ')
    connection, chan = channel(folders)
    with connection:
        chan._put("jobs", {"n": 1})
        assert chan._get("jobs") == {"n": 1}
        with pytest.raises(Empty):
            chan._get("jobs")
    assert (Path(folders["processed_folder"]) / "0_stray.jobs.msg.broken").exists()
    assert (queue / ".1_unfinished.jobs.msg.tmp").exists(), "a file being written is never taken"
