import os

from django.apps import AppConfig
from django.db.backends.signals import connection_created


def keep_sqlite_private(sender, connection, **kwargs) -> None:
    """The embedded default's SQLite file (and its -wal/-shm) is the platform's alone: 0600.

    SQLite creates it with the umask's mode (0644), and Triton's servers run as other users on the same
    machine. Checked on every new connection, so a database Django recreates (tests) is covered too.
    """
    if connection.vendor != "sqlite":
        return
    name = str(connection.settings_dict.get("NAME") or "")
    if not name or name == ":memory:" or "mode=memory" in name:
        return
    for path in (name, f"{name}-wal", f"{name}-shm"):
        try:
            if os.stat(path).st_mode & 0o077:
                os.chmod(path, 0o600)
        except FileNotFoundError:
            continue


class CoreConfig(AppConfig):
    name = "apps.core"
    label = "core"
    verbose_name = "Platform core"

    def ready(self) -> None:
        connection_created.connect(keep_sqlite_private, dispatch_uid="apps.core.keep_sqlite_private")
