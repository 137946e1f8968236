"""Stream a directory as a zip without building it on disk or in memory."""

from __future__ import annotations

import zipfile
from collections.abc import Iterator
from pathlib import Path

PIECE = 1024 * 1024


class _Sink:
    """A write-only, unseekable file: zipfile then writes data descriptors and never seeks back."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.position = 0

    def write(self, data: bytes) -> int:
        self.buffer += data
        self.position += len(data)
        return len(data)

    def tell(self) -> int:
        return self.position

    def flush(self) -> None:
        pass

    def take(self) -> bytes:
        data = bytes(self.buffer)
        self.buffer.clear()
        return data


def zip_stream(root: Path) -> Iterator[bytes]:
    """Yield a zip of the regular files under ``root`` (stored, not compressed: weights do not compress)."""
    sink = _Sink()
    with zipfile.ZipFile(sink, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        for path in sorted(root.rglob("*")):
            if path.is_symlink() or not path.is_file():
                continue
            info = zipfile.ZipInfo.from_file(path, arcname=path.relative_to(root).as_posix())
            with open(path, "rb") as src, archive.open(info, "w", force_zip64=True) as dst:
                while piece := src.read(PIECE):
                    dst.write(piece)
                    yield sink.take()
            yield sink.take()
    yield sink.take()
