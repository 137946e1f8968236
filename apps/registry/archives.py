"""Safe extraction of uploaded archives (.zip, .tar, .tar.gz).

An uploaded archive is hostile until proven otherwise. Every member is checked before anything is written:
no absolute names, no ``..``, no links, devices or fifos, no duplicate names, a cap on the member count,
on the total unpacked size and on the compression ratio. Files are written into a fresh temporary directory
next to the destination (same filesystem, so the final ``rename`` is atomic) with ``O_EXCL | O_NOFOLLOW``,
and the temporary directory is removed on any failure: a rejected archive leaves nothing on disk.

This module does not import Django, so it can be used (and tested) on its own.
"""

from __future__ import annotations

import os
import shutil
import stat
import tarfile
import uuid
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

_PIECE = 1024 * 1024


class ArchiveRejected(ValueError):
    """The archive (or one member, named in ``entry``) is unsafe or unusable."""

    def __init__(self, message: str, entry: str = "") -> None:
        self.entry = entry
        super().__init__(message)


@dataclass(frozen=True)
class Limits:
    """Caps that keep one upload from exhausting disk, inodes or time."""

    max_members: int = 2000
    max_unpacked_bytes: int = 16 * 1024**3
    # Real weights barely compress (~1.1x); a ratio this high on a sizeable member is a bomb.
    max_ratio: int = 200
    ratio_floor_bytes: int = 16 * 1024**2


@dataclass(frozen=True)
class _Member:
    name: str
    is_dir: bool
    size: int
    compressed: int


def archive_kind(path: Path) -> str | None:
    """'zip' or 'tar' by content (never by the file name), None for anything else."""
    if zipfile.is_zipfile(path):
        return "zip"
    try:
        with tarfile.open(path, "r:*") as tf:
            tf.next()
        return "tar"
    except (tarfile.TarError, OSError, EOFError):
        return None


def check_member_name(name: str) -> str:
    """The member's normalized relative POSIX path; raises ArchiveRejected for anything that could escape."""
    shown = name if len(name) <= 200 else name[:200] + "..."
    if not name or "\x00" in name:
        raise ArchiveRejected("an archive member has an empty or NUL-containing name", shown)
    if "\\" in name:
        raise ArchiveRejected(f"archive member '{shown}' has a backslash in its name", shown)
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise ArchiveRejected(f"archive member '{shown}' has an absolute path", shown)
    parts = [p for p in PurePosixPath(name).parts if p not in ("", ".")]
    if ".." in parts:
        raise ArchiveRejected(f"archive member '{shown}' points outside the archive ('..')", shown)
    if not parts:
        raise ArchiveRejected(f"archive member '{shown}' has no usable name", shown)
    return "/".join(parts)


def _zip_members(zf: zipfile.ZipFile, limits: Limits) -> list[_Member]:
    infos = zf.infolist()
    if len(infos) > limits.max_members:
        raise ArchiveRejected(
            f"the archive has {len(infos)} members; at most {limits.max_members} are allowed "
            f"(the first over the limit is '{infos[limits.max_members].filename}')",
            infos[limits.max_members].filename,
        )
    members = []
    for info in infos:
        mode = info.external_attr >> 16
        kind = stat.S_IFMT(mode)
        if kind == stat.S_IFLNK:
            raise ArchiveRejected(f"archive member '{info.filename}' is a symbolic link", info.filename)
        if kind and kind not in (stat.S_IFREG, stat.S_IFDIR):
            raise ArchiveRejected(
                f"archive member '{info.filename}' is a device, fifo or socket entry", info.filename
            )
        if info.flag_bits & 0x1:
            raise ArchiveRejected(f"archive member '{info.filename}' is encrypted", info.filename)
        members.append(
            _Member(check_member_name(info.filename), info.is_dir(), info.file_size, info.compress_size)
        )
    return members


def _tar_members(tf: tarfile.TarFile, limits: Limits) -> Iterator[tuple[_Member, tarfile.TarInfo]]:
    count = 0
    # next() one by one rather than getmembers(): a 10-million-member tar is refused after the cap,
    # not after reading every header.
    while (info := tf.next()) is not None:
        count += 1
        if count > limits.max_members:
            raise ArchiveRejected(
                f"the archive has more than {limits.max_members} members (the first over the limit is "
                f"'{info.name}')",
                info.name,
            )
        if info.issym():
            raise ArchiveRejected(f"archive member '{info.name}' is a symbolic link", info.name)
        if info.islnk():
            raise ArchiveRejected(f"archive member '{info.name}' is a hard link", info.name)
        if info.ischr() or info.isblk() or info.isfifo() or info.isdev():
            raise ArchiveRejected(f"archive member '{info.name}' is a device or fifo entry", info.name)
        if not (info.isfile() or info.isdir()):
            raise ArchiveRejected(f"archive member '{info.name}' has an unsupported type", info.name)
        yield _Member(check_member_name(info.name), info.isdir(), info.size, info.size), info


class _Budget:
    """Counts bytes actually written: declared sizes in headers can lie."""

    def __init__(self, limits: Limits, archive_size: int) -> None:
        self.limits = limits
        self.archive_size = max(archive_size, 1)
        self.total = 0

    def charge(self, member: _Member, written: int, extra: int) -> None:
        self.total += extra
        limits = self.limits
        if self.total > limits.max_unpacked_bytes:
            raise ArchiveRejected(
                f"the archive unpacks to more than {limits.max_unpacked_bytes} bytes (stopped at '{member.name}')",
                member.name,
            )
        if written > member.size:
            raise ArchiveRejected(
                f"archive member '{member.name}' is larger than its header says", member.name
            )
        if written > limits.ratio_floor_bytes and written > limits.max_ratio * max(member.compressed, 1):
            raise ArchiveRejected(
                f"archive member '{member.name}' expands more than {limits.max_ratio}x: a decompression bomb",
                member.name,
            )
        if self.total > limits.ratio_floor_bytes and self.total > limits.max_ratio * self.archive_size:
            raise ArchiveRejected(
                f"the archive expands more than {limits.max_ratio}x (at '{member.name}'): a decompression bomb",
                member.name,
            )


def _write_member(root: Path, member: _Member, source: BinaryIO, budget: _Budget, seen: set[str]) -> None:
    if member.name in seen:
        raise ArchiveRejected(f"archive member '{member.name}' appears twice", member.name)
    seen.add(member.name)
    target = root.joinpath(*member.name.split("/"))
    if member.is_dir:
        target.mkdir(parents=True, exist_ok=True)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    # O_EXCL|O_NOFOLLOW: never write through something that already exists (we create no links, but
    # a directory member and a file member with the same name must not alias).
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except (FileExistsError, IsADirectoryError, NotADirectoryError):
        raise ArchiveRejected(
            f"archive member '{member.name}' collides with another member", member.name
        ) from None
    written = 0
    with os.fdopen(fd, "wb") as out:
        while piece := source.read(_PIECE):
            written += len(piece)
            budget.charge(member, written, len(piece))
            out.write(piece)


def extract_archive(archive: Path, destination: Path, limits: Limits | None = None) -> Path:
    """Extract ``archive`` into ``destination`` (which must not exist) atomically; returns ``destination``.

    Raises :class:`ArchiveRejected` naming the offending member; on any failure nothing is left behind.
    """
    limits = limits or Limits()
    kind = archive_kind(archive)
    if kind is None:
        raise ArchiveRejected("not a zip or tar archive")
    destination.parent.mkdir(parents=True, exist_ok=True)
    tmp = destination.parent / f".extract-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        budget = _Budget(limits, archive.stat().st_size)
        seen: set[str] = set()
        if kind == "zip":
            with zipfile.ZipFile(archive) as zf:
                members = _zip_members(zf, limits)
                for member, info in zip(members, zf.infolist(), strict=True):
                    with zf.open(info) as src:
                        _write_member(tmp, member, src, budget, seen)
        else:
            with tarfile.open(archive, "r:*") as tf:
                for member, info in _tar_members(tf, limits):
                    if member.is_dir:
                        _write_member(tmp, member, _Empty(), budget, seen)
                        continue
                    with tf.extractfile(info) as src:
                        _write_member(tmp, member, src, budget, seen)
        os.rename(tmp, destination)
    except ArchiveRejected:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError, RuntimeError, ValueError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ArchiveRejected(f"the archive is damaged or unreadable: {exc}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return destination


class _Empty:
    def read(self, _n: int) -> bytes:
        return b""


def unwrap_single_directory(root: Path) -> Path:
    """Archives are often made of one top-level folder; look inside it when that is all there is."""
    entries = [p for p in root.iterdir() if not p.name.startswith("__MACOSX")]
    if len(entries) == 1 and entries[0].is_dir() and not entries[0].is_symlink():
        return entries[0]
    return root
