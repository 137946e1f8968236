"""Upload a large model through the REST API on loopback and measure what it costs the server.

The script starts its own gunicorn (one sync worker, like production) on 127.0.0.1 against a throwaway
SQLite database and ARTIFACT_ROOT, creates a team, a model and an API token, then uploads ``--size`` bytes
(default 2 GiB) in chunks with the resumable upload API. Halfway through, the client drops the connection
in the middle of a chunk, asks the server for its offset (HEAD) and resumes from there. It reports:

- throughput in MB/s (bytes sent / time spent sending, and end to end including verification);
- the server worker's resident memory: before, peak (VmHWM) and the peak growth (target < 100 MiB);
- the offset the server reported after the drop, and that the sha256 matched at completion.

Usage: ``python benchmarks/upload.py [--size-mib 2048] [--chunk-mib 64] [--timeout 900] [--json FILE] [--smoke]``
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import smoke  # noqa: E402

MIB = 1024 * 1024
PIECE = MIB

SETUP = """
from apps.teams import services as teams
from apps.registry import services as registry
from django.contrib.auth import get_user_model
user = get_user_model().objects.create_user("bench", password="bench-password-unused")
team = teams.create_team(actor=user, name="Bench", slug="bench")
registry.create_model(actor=user, team=team, name="Big", slug="big")
token, secret = teams.create_token(actor=user, team=team, name="benchmark")
print("TOKEN=" + secret)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM of a process in bytes, from /proc/<pid>/status."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def worker_pid(master: int) -> int:
    children = Path(f"/proc/{master}/task/{master}/children").read_text().split()
    if len(children) != 1:
        raise RuntimeError(f"expected one gunicorn worker, found {children}")
    return int(children[0])


class Payload:
    """Deterministic pseudo-random bytes generated on the fly: no 2 GiB file on the client's disk."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.block = hashlib.shake_256(b"upload-benchmark").digest(PIECE)
        # An .om is sniffed only for size and "not a zip"; start like a real one anyway.
        self.block = b"IMOD" + self.block[4:]

    def piece(self, offset: int, length: int) -> bytes:
        start = offset % PIECE
        if start + length <= PIECE:
            return self.block[start : start + length]
        return (self.block[start:] + self.block * (length // PIECE + 1))[:length]

    def sha256(self) -> str:
        digest = hashlib.sha256()
        for offset in range(0, self.size, PIECE):
            digest.update(self.piece(offset, min(PIECE, self.size - offset)))
        return digest.hexdigest()


class Client:
    def __init__(self, port: int, token: str) -> None:
        self.port, self.token = port, token

    def call(self, method: str, path: str, body: dict | None = None, headers: dict | None = None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        data = json.dumps(body).encode() if body is not None else None
        all_headers = {"Authorization": f"Bearer {self.token}", **(headers or {})}
        if data is not None:
            all_headers["Content-Type"] = "application/json"
        conn.request(method, path, body=data, headers=all_headers)
        response = conn.getresponse()
        raw = response.read()
        conn.close()
        return response.status, dict(response.getheaders()), (json.loads(raw) if raw else None)

    def send_chunk(
        self, path: str, payload: Payload, offset: int, length: int, drop_after: int | None = None
    ):
        """PATCH one chunk, streaming it; with ``drop_after`` the socket is reset after that many bytes."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        conn.putrequest("PATCH", path)
        conn.putheader("Authorization", f"Bearer {self.token}")
        conn.putheader("Content-Type", "application/offset+octet-stream")
        conn.putheader("Upload-Offset", str(offset))
        conn.putheader("Content-Length", str(length))
        conn.endheaders()
        sent = 0
        while sent < length:
            n = min(PIECE, length - sent)
            if drop_after is not None and sent + n > drop_after:
                n = drop_after - sent
                if n:
                    conn.send(payload.piece(offset + sent, n))
                    sent += n
                # SO_LINGER 0: close with a reset, the way a dying client or network does.
                conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                conn.sock.close()
                return None, sent
            conn.send(payload.piece(offset + sent, n))
            sent += n
        response = conn.getresponse()
        body = json.loads(response.read() or b"null")
        conn.close()
        return response.status, body


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=2048)
    parser.add_argument("--chunk-mib", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=900, help="give up after this many seconds")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = smoke.parse_args(parser, size_mib=8, chunk_mib=2, timeout=120)
    deadline = time.monotonic() + args.timeout
    size, chunk = args.size_mib * MIB, args.chunk_mib * MIB

    work = Path(tempfile.mkdtemp(prefix="upload-bench-"))
    env = {
        **os.environ,
        "DEBUG": "1",
        "VAR_DIR": str(work / "var"),
        "DATABASE_URL": f"sqlite:///{work / 'db.sqlite3'}",
        "ARTIFACT_ROOT": str(work / "artifacts"),
        "CELERY_BROKER_URL": "filesystem://",
        "UPLOAD_MAX_BYTES": str(max(size, 8 * 1024**3)),
        "LOG_LEVEL": "WARNING",
    }
    env.pop("CELERY_RESULT_BACKEND", None)
    python = sys.executable
    server = None
    try:
        subprocess.run([python, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, check=True)
        setup = subprocess.run(
            [python, "manage.py", "shell", "-c", SETUP],
            cwd=ROOT,
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
        token = next(line[6:] for line in setup.stdout.splitlines() if line.startswith("TOKEN="))
        port = free_port()
        gunicorn = Path(python).with_name("gunicorn")
        server = subprocess.Popen(
            [
                str(gunicorn),
                "serving_platform.wsgi",
                "--bind",
                f"127.0.0.1:{port}",
                "--workers",
                "1",
                "--timeout",
                "600",
                "--log-level",
                "warning",
            ],
            cwd=ROOT,
            env=env,
            start_new_session=True,
        )
        client = Client(port, token)
        while True:
            try:
                if client.call("GET", "/healthz")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("the server did not start")
            time.sleep(0.2)
        worker = worker_pid(server.pid)
        # Warm up the code paths (imports, DB connection) so the baseline is the steady state.
        client.call("GET", "/api/v1/teams/bench/models/big/")
        baseline = proc_status(worker)

        payload = Payload(size)
        print(
            f"payload: {size / MIB:.0f} MiB in {chunk / MIB:.0f} MiB chunks; hashing it on the client ...",
            flush=True,
        )
        sha = payload.sha256()
        status, _, body = client.call(
            "POST",
            "/api/v1/teams/bench/models/big/uploads/",
            {"filename": "big.om", "size": size, "sha256": sha},
        )
        assert status == 201, body
        path = "/api/v1/teams/bench/uploads/" + body["id"] + "/"

        offset, sent_bytes, send_seconds, dropped_at, resumed_from = 0, 0, 0.0, None, None
        # Halfway, but off any chunk or piece boundary: the reset lands in the middle of a body.
        drop_point = size // 2 + 12_345
        started = time.monotonic()
        while offset < size:
            if time.monotonic() > deadline:
                raise TimeoutError("upload took longer than --timeout")
            length = min(chunk, size - offset)
            drop = None
            if dropped_at is None and offset < drop_point < offset + length:
                drop = drop_point - offset
            t0 = time.monotonic()
            status, answer = client.send_chunk(path, payload, offset, length, drop_after=drop)
            send_seconds += time.monotonic() - t0
            if status is None:
                sent_bytes += answer
                dropped_at = offset + answer
                time.sleep(0.5)  # let the server notice the reset and record what arrived
                code, headers, info = client.call("HEAD", path)
                resumed_from = int(headers["Upload-Offset"])
                print(
                    f"dropped the connection at byte {dropped_at}; server offset {resumed_from}", flush=True
                )
                offset = resumed_from
                continue
            if status != 200:
                raise RuntimeError(f"chunk at {offset} answered {status}: {answer}")
            sent_bytes += length
            offset = answer["offset"]
        t_complete = time.monotonic()
        status, _, version = client.call("POST", path + "complete/", {})
        finished = time.monotonic()
        after = proc_status(worker)
        assert status == 200, version
        figures = {
            "size_bytes": size,
            "chunk_bytes": chunk,
            "bytes_sent": sent_bytes,
            "send_mb_per_s": round(sent_bytes / send_seconds / 1e6, 1),
            "end_to_end_mb_per_s": round(size / (finished - started) / 1e6, 1),
            "complete_seconds": round(finished - t_complete, 2),
            "dropped_at": dropped_at,
            "dropped_at_percent": round(100 * dropped_at / size, 2) if dropped_at else None,
            "server_offset_after_drop": resumed_from,
            "sha256_verified": version["sha256"] == sha,
            "version_state": version["state"],
            "worker_rss_before_mib": round(baseline["VmRSS"] / MIB, 1),
            "worker_peak_rss_mib": round(after["VmHWM"] / MIB, 1),
            "worker_peak_growth_mib": round((after["VmHWM"] - baseline["VmRSS"]) / MIB, 1),
            "target_growth_mib": 100,
        }
        figures["meets_target"] = figures["worker_peak_growth_mib"] < 100 and figures["sha256_verified"]
        print(json.dumps(figures, indent=2))
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2) + "\n")
        # A smoke run judges what works, not what it costs: the checksum, not the memory growth.
        return 0 if figures["meets_target"] or (args.smoke and figures["sha256_verified"]) else 1
    finally:
        if server is not None and server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
