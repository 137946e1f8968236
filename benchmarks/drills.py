"""Network and restart drills: hosts in their own network namespaces (real agents and tritonservers), the
HAProxy gateway, the platform, each fault under gateway load from bounded real clients.

The drills are the suite's own (``tests/drills/``): this script runs them with pytest against a private
PostgreSQL server it starts for the run (``initdb``/``pg_ctl`` under a temp directory, on its own port) - one
of the drills restarts PostgreSQL in the middle of a deploy, which must never happen to a shared server - and
prints each drill's figures: requests sent and failed through the gateway, time to detect the fault, time to
converge after it, duplicate placements and rows lost (placements whose row disagrees with the Triton holding
them; reserved memory the beat had to repair).

    .venv/bin/python benchmarks/drills.py [--json drills.json] [--smoke]

Needs root (network namespaces, iptables), haproxy and PostgreSQL's server binaries
(``/usr/lib/postgresql/*/bin``). ``--smoke`` runs one drill (PostgreSQL restarted mid-deploy), as the test
suite does. Exit status: pytest's (a drill whose checks fail fails the run).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import smoke  # noqa: E402

SMOKE_DRILL = "test_postgres_restarted_mid_deploy"
COLUMNS = ("sent", "failed", "detect_s", "converge_s", "duplicate_placements", "rows_lost")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default="", help="write the figures to this file")
    parser.add_argument("-k", dest="select", default="", help="only the drills pytest -k selects")
    parser.add_argument("--timeout", type=float, default=1800, help="give up after this many seconds")
    return smoke.parse_args(parser, argv, select=SMOKE_DRILL, timeout=280)


def pg_bin() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    if not found:
        sys.exit("PostgreSQL's server binaries are not installed (apt install postgresql)")
    return Path(found[-1]).parent


def free_port() -> int:
    from backend_ge.runtime import free_port as pick

    return pick()


class PrivatePostgres:
    """A PostgreSQL server of this run alone: its own data directory and port, run as the ``postgres`` user
    when this script runs as root (PostgreSQL refuses root)."""

    def __init__(self, base: Path) -> None:
        self.bin = pg_bin()
        self.data = base / "pgdata"
        self.port = free_port()
        self.user = "postgres" if os.geteuid() == 0 else None
        base.chmod(0o755)
        if self.user:
            shutil.chown(base, self.user)

    def _run(self, *args: str) -> None:
        done = subprocess.run(args, capture_output=True, text=True, timeout=120, user=self.user)
        if done.returncode != 0:
            sys.exit(f"{' '.join(args[:2])} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")

    def start(self) -> PrivatePostgres:
        self._run(
            str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync"
        )
        options = f"-p {self.port} -k {self.data} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(str(self.bin / "pg_ctl"), "start", "-D", str(self.data), "-w", "-o", options,
                  "-l", str(self.data / "server.log"))  # fmt: skip
        return self

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/drills"

    def stop(self) -> None:
        subprocess.run([str(self.bin / "pg_ctl"), "stop", "-D", str(self.data), "-m", "immediate"],
                       capture_output=True, timeout=60, user=self.user)  # fmt: skip


def run_drills(args: argparse.Namespace, postgres: PrivatePostgres, figures: Path) -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND")}
    env.update(
        DATABASE_URL=postgres.url, DRILL_PG_DATA=str(postgres.data), DRILL_PG_BIN=str(postgres.bin),
        DRILL_FIGURES=str(figures), DEBUG="1",
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
    )  # fmt: skip
    command = [sys.executable, "-m", "pytest", "tests/drills", "-n", "0", "-p", "no:cacheprovider",
               "-p", "no:randomly", "-q", "-rs", "--durations=0"]  # fmt: skip
    if args.select:
        command += ["-k", args.select]
    try:
        return subprocess.run(command, cwd=ROOT, env=env, timeout=args.timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"the drills did not finish in {args.timeout:.0f} s")
        return 1


def show(rows: list[dict]) -> None:
    print()
    print(f"{'drill':44}" + "".join(f"{c:>22}" for c in COLUMNS))
    for row in rows:
        cells = "".join(f"{'-' if row.get(c) is None else row[c]!s:>22}" for c in COLUMNS)
        print(f"{row['name']:44}{cells}")
    for row in rows:
        extra = {k: v for k, v in row.items() if k not in ("name", *COLUMNS)}
        if extra:
            print(f"  {row['name']}: " + ", ".join(f"{k} {v}" for k, v in extra.items()))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0 or shutil.which("iptables") is None:
        print("the drills need root and iptables (network namespaces); nothing ran")
        return 1
    base = Path(tempfile.mkdtemp(prefix="drills-"))
    figures = base / "figures.jsonl"
    # The server's directory where the postgres user can reach it (a TMPDIR may be private to root).
    postgres = PrivatePostgres(Path(tempfile.mkdtemp(prefix="drills-pg-", dir="/tmp"))).start()
    started = time.monotonic()
    try:
        code = run_drills(args, postgres, figures)
    finally:
        postgres.stop()
    rows = [json.loads(line) for line in figures.read_text().splitlines()] if figures.exists() else []
    show(rows)
    print(f"drills run: {len(rows)} in {time.monotonic() - started:.0f} s; pytest exit {code}")
    if args.json:
        Path(args.json).write_text(json.dumps({"drills": rows}, indent=2) + "\n")
    shutil.rmtree(base, ignore_errors=True)
    shutil.rmtree(postgres.data.parent, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
