"""Who a tritonserver runs as, and what that user may reach.

An agent running as root starts each instance's tritonserver (and so every python stub, where a tenant's
model is parsed) as a system user of its own, ``tge-<host>-<instance>``, created on demand. The user has
no home, no shell and no supplementary group but ``triton-ge``, the group that is granted traverse-only
access (a POSIX ACL entry ``g:triton-ge:--x``) on the directories above the fleet root that others
cannot enter. It reads its instance's repository (``root:<its group> 0750``) and the world-readable
runtime tree, and writes only its run directory. Names come from the platform's host and instance names
(lowercase letters, digits, hyphens), never from tenant input.

An agent that is not root cannot switch users: its servers run as the agent's own user (see README).
"""

from __future__ import annotations

import ctypes
import errno
import grp
import hashlib
import os
import pwd
import re
import signal
import struct
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

SHARED_GROUP = "triton-ge"
USER_PREFIX = "tge-"
_COMMENT = "Triton GE instance {} (serving platform)"
_COMMENT_RE = re.compile(r"^Triton GE instance \S+ \(serving platform\)$")
_NAME_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]*[a-z0-9])?$")
_MAX_NAME = 32  # useradd's limit


class SandboxError(RuntimeError):
    """The unprivileged user could not be set up, or cannot reach what its server needs."""


@dataclass(frozen=True)
class ServerUser:
    """The user (and groups) a tritonserver runs as."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    def popen_kwargs(self) -> dict:
        """For ``subprocess.Popen``: exactly these ids, none of the caller's supplementary groups."""
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups)}


def can_switch_users() -> bool:
    return os.geteuid() == 0


# --- starting a server as its user, with a /dev/shm of its own ------------------------------------------
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.unshare.argtypes = [ctypes.c_int]
_LIBC.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
_LIBC.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_CLONE_NEWNS = 0x00020000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000
_PR_SET_PDEATHSIG = 1


def _private_dev_shm() -> None:
    # The python backend creates its shared-memory regions (requests and tensors in flight) in /dev/shm
    # with mode 0644: in a mount namespace of its own, with a fresh tmpfs there, no other instance sees
    # them. Without CAP_SYS_ADMIN (e.g. an unprivileged container) this is skipped; the agent warns.
    if _LIBC.unshare(_CLONE_NEWNS) != 0:
        return
    # Private first: on a host whose mounts are shared (systemd), the tmpfs would otherwise appear there.
    if _LIBC.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        return
    _LIBC.mount(b"tmpfs", b"/dev/shm", b"tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, b"mode=1777")


def become(user: ServerUser, *, die_with_parent: bool = False) -> Callable[[], None]:
    """A ``preexec_fn`` that gives the child its own /dev/shm, then turns it into ``user`` (exactly its
    groups, umask 0077) and, optionally, has Linux SIGINT it when the launching thread ends."""

    def preexec() -> None:
        _private_dev_shm()
        os.setgroups(list(user.groups))
        os.setresgid(user.gid, user.gid, user.gid)
        os.setresuid(user.uid, user.uid, user.uid)
        os.umask(0o077)
        if die_with_parent:  # after the switch: changing user clears the parent-death signal
            _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGINT, 0, 0, 0)

    return preexec


def has_private_dev_shm(pid: int) -> bool:
    """Whether the process runs in a mount namespace other than ours (see :func:`become`)."""
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    except OSError:
        return False


def user_name(host: str, instance: str) -> str:
    """``tge-<host>-<instance>``, or ``tge-<digest>`` when that is too long for a user name."""
    name = f"{USER_PREFIX}{host}-{instance}"
    if len(name) <= _MAX_NAME and _NAME_RE.match(host) and _NAME_RE.match(instance):
        return name
    return USER_PREFIX + hashlib.sha256(f"{host}/{instance}".encode()).hexdigest()[:16]


def _run_admin(cmd: list[str], exists_code: int) -> None:
    # useradd/groupadd fail while another process holds /etc/passwd's lock (another agent on this machine
    # creating its users): retry a few times. "Already exists" means another agent won the race.
    for attempt in range(20):
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except OSError as exc:
            raise SandboxError(f"cannot run {cmd[0]}: {exc}") from None
        if result.returncode in (0, exists_code):
            return
        if attempt < 19 and result.returncode in (1, 10):  # can't update password/group file: locked
            time.sleep(0.1 + 0.05 * attempt)
            continue
        raise SandboxError(f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr.strip()}")


def ensure_group(name: str = SHARED_GROUP) -> int:
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        _run_admin(["groupadd", "--system", name], exists_code=9)
        return grp.getgrnam(name).gr_gid


def _nologin() -> str:
    for shell in ("/usr/sbin/nologin", "/sbin/nologin"):
        if os.path.exists(shell):
            return shell
    return "/bin/false"


def ensure_user(host: str, instance: str) -> ServerUser:
    """The instance's system user, created if missing. An existing account of that name that the platform
    did not create (another comment, a login shell, uid 0) is refused rather than used."""
    name = user_name(host, instance)
    shared = ensure_group()
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        _run_admin(
            ["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent",
             "--shell", _nologin(), "--user-group", "--comment", _COMMENT.format(f"{host}/{instance}"), name],
            exists_code=9,
        )  # fmt: skip
        entry = pwd.getpwnam(name)
    if entry.pw_uid == 0 or entry.pw_gid == 0 or not _COMMENT_RE.match(entry.pw_gecos):
        raise SandboxError(
            f"user {name!r} exists but was not created by the serving platform (uid {entry.pw_uid}, "
            f"comment {entry.pw_gecos!r}); remove it or rename the host/instance"
        )
    return ServerUser(name, entry.pw_uid, entry.pw_gid, (shared,))


# --- traverse-only access on the directories above the fleet root ----------------------------------------
_ACL_XATTR = "system.posix_acl_access"
_USER_OBJ, _USER, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_UNDEFINED_ID = 0xFFFFFFFF


def _read_acl(path: Path) -> list[tuple[int, int, int]]:
    try:
        raw = os.getxattr(path, _ACL_XATTR, follow_symlinks=False)
    except OSError as exc:
        if exc.errno != errno.ENODATA:
            raise
        mode = os.lstat(path).st_mode
        return [
            (_USER_OBJ, (mode >> 6) & 7, _UNDEFINED_ID),
            (_GROUP_OBJ, (mode >> 3) & 7, _UNDEFINED_ID),
            (_OTHER, mode & 7, _UNDEFINED_ID),
        ]
    (version,) = struct.unpack_from("<I", raw)
    if version != 2:
        raise SandboxError(f"{path}: unknown ACL version {version}")
    return list(struct.iter_unpack("<HHI", raw[4:]))


def grant_group_traverse(path: Path, gid: int) -> None:
    """Add ``g:<gid>:--x`` to the directory's access ACL (as ``setfacl -m`` would, mask recomputed)."""
    entries = [e for e in _read_acl(path) if not (e[0] == _GROUP and e[2] == gid)]
    existing = [e for e in _read_acl(path) if e[0] == _GROUP and e[2] == gid]
    perm = (existing[0][1] if existing else 0) | 1
    entries = [e for e in entries if e[0] != _MASK] + [(_GROUP, perm, gid)]
    mask = 0
    for tag, p, _ in entries:
        if tag in (_USER, _GROUP_OBJ, _GROUP):
            mask |= p
    entries.append((_MASK, mask, _UNDEFINED_ID))
    entries.sort(key=lambda e: (e[0], e[2] if e[0] in (_USER, _GROUP) else 0))
    raw = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)
    try:
        os.setxattr(path, _ACL_XATTR, raw, follow_symlinks=False)
    except OSError as exc:
        raise SandboxError(
            f"cannot grant group {gid} traverse access on {path} ({exc.strerror}); allow it by hand "
            f"(chmod o+x {path}, or setfacl -m g:{SHARED_GROUP}:x {path}) or move the fleet root"
        ) from None


def _traversable_by(path: Path, gid: int) -> bool:
    st = os.stat(path)
    if st.st_mode & 0o001:
        return True
    for tag, perm, ident in _read_acl(path):
        if tag == _GROUP and ident == gid:
            mask = next((p for t, p, _ in _read_acl(path) if t == _MASK), 7)
            return bool(perm & mask & 1)
    return st.st_gid == gid and bool(st.st_mode & 0o010)


def ensure_traversable(path: Path, gid: int) -> list[Path]:
    """Grant the group traverse-only access on each directory from ``/`` down to ``path`` that others
    cannot pass through; returns the directories it changed."""
    changed = []
    for directory in [*reversed(Path(path).resolve().parents), Path(path).resolve()]:
        if not _traversable_by(directory, gid):
            grant_group_traverse(directory, gid)
            changed.append(directory)
    return changed


# --- instance directories and the access check ----------------------------------------------------------
def prepare_instance_dirs(root: Path, repository: Path, user: ServerUser | None) -> None:
    """``root`` (the agent's: log, run dir) is traversable but not listable; the repository is readable by
    the instance's group only, and never writable by the server."""
    for directory in (root, repository):
        if directory.is_symlink():
            raise SandboxError(f"{directory} is a symbolic link; refused")
        directory.mkdir(parents=True, exist_ok=True)
    if user is None:
        root.chmod(0o700)
        repository.chmod(0o700)
        return
    root.chmod(0o711)
    os.chown(repository, os.geteuid(), user.gid, follow_symlinks=False)
    repository.chmod(0o750)


_PROBE = r"""
import importlib, importlib.util, os, sys
repository, run_dir, binary, backends = sys.argv[1:5]
private = sys.argv[5:]
problems = []
def check(what, fn):
    try:
        fn()
    except Exception as exc:
        problems.append(f"cannot {what}: {exc}")
check(f"list the repository {repository}", lambda: os.listdir(repository))
def write():
    probe = os.path.join(run_dir, ".access-probe")
    with open(probe, "w"):
        pass
    os.unlink(probe)
check(f"write into the run directory {run_dir}", write)
for path in (binary, os.path.join(backends, "python", "triton_python_backend_stub")):
    if not os.access(path, os.X_OK):
        problems.append(f"cannot execute {path}")
for module in ("numpy", "onnxruntime", "backend_ge.serving"):
    if module == "onnxruntime" and importlib.util.find_spec(module) is None:
        continue
    check(f"import {module}", lambda: importlib.import_module(module))
for path in private:
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            open(path, "rb").close()
    except OSError:  # refused (or a socket, a FIFO: nothing to read either)
        continue
    problems.append(f"can read {path} although it must not (make it 0600/0700, owned by the platform)")
print("\n".join(problems))
sys.exit(1 if problems else 0)
"""


def check_access(
    user: ServerUser,
    *,
    python: Path,
    repository: Path,
    run_dir: Path,
    binary: Path,
    backends: Path,
    env: Mapping[str, str],
    private: Iterable[Path] = (),
) -> None:
    """Run a probe as ``user`` with the server's interpreter and environment: it must list the repository,
    write its run directory, execute the server and the stub, import what a stub imports - and must not
    read any of the ``private`` paths. Raises SandboxError naming every problem."""
    cmd = [str(python), "-I", "-c", _PROBE, str(repository), str(run_dir), str(binary), str(backends)]
    cmd += [str(p) for p in private if os.path.lexists(p)]
    try:
        result = subprocess.run(
            cmd, env=dict(env), cwd="/", capture_output=True, text=True, timeout=120, **user.popen_kwargs()
        )
    except PermissionError as exc:
        raise SandboxError(
            f"user {user.name} cannot start {python} ({exc.strerror}): a directory above it is not "
            "traversable for that user"
        ) from None
    if result.returncode != 0:
        problems = result.stdout.strip().splitlines() or [f"fails the check: {result.stderr.strip()[-2000:]}"]
        raise SandboxError(f"tritonserver would run as user {user.name}, which " + "; ".join(problems))
