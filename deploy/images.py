"""``make images``: build the platform image and the host-agent image from the Dockerfile with podman.

``BASE_IMAGE`` and ``AGENT_BASE_IMAGE`` keep the Dockerfile's public defaults (``python:3.11-slim-bookworm``; a
CANN base for NPU hosts). A base that is neither on this machine nor pullable - no registry answers - is
bootstrapped from Debian's own packages instead: ``mmdebstrap`` writes a minimal bookworm with python3 and its
venv module, ``podman import`` makes it ``localhost/triton-ge-base:bookworm``. Both images are printed with
their sizes at the end.

    .venv/bin/python deploy/images.py [--only platform|host-agent] [--rebuild-base]

This machine's podman needs two settings that no system file has to hold: ``runc`` (crun refuses hybrid
cgroups) and no default ulimits (setting RLIMIT_NOFILE is not permitted); ``containers_conf()`` writes them to a
file of the checkout's ``var/`` and points ``CONTAINERS_CONF`` at it unless the caller set one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLATFORM_IMAGE = "triton-ge-platform:latest"
AGENT_IMAGE = "triton-ge-host-agent:latest"
PUBLIC_BASE = "python:3.11-slim-bookworm"
DEBIAN_BASE = "localhost/triton-ge-base:bookworm"
# What the Dockerfile's stages need of a base: python3 3.11 with venv and pip's certificates, useradd (the
# platform's user, the agent's instance users) and the shared libpython that Triton's Python stub links.
DEBIAN_PACKAGES = ("python3", "python3-venv", "ca-certificates", "libpython3.11", "passwd")


# A service's log line at ERROR fails a stack's check (``make stack-check``, ``make play-check``), except
# PostgreSQL refusing a connection while it starts or stops: what its readiness probe (pg_isready) and the
# services waiting for it meet by design, which the server logs as FATAL (seen when it started slowly).
EXPECTED_REFUSALS = (
    "FATAL:  the database system is starting up",
    "FATAL:  the database system is shutting down",
)


def expected_refusal(line: str) -> bool:
    return any(refusal in line for refusal in EXPECTED_REFUSALS)


class BuildFailed(RuntimeError):
    pass


def say(message: str) -> None:
    print(f"images: {message}", flush=True)


def containers_conf() -> str:
    """The containers.conf podman runs with here (an operator's own CONTAINERS_CONF wins)."""
    if os.environ.get("CONTAINERS_CONF"):
        return os.environ["CONTAINERS_CONF"]
    path = ROOT / "var" / "podman" / "containers.conf"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "# Written by deploy/images.py for podman on this machine (see docs/operators/install.md).\n"
        '[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = "runc"\n'
    )
    os.environ["CONTAINERS_CONF"] = str(path)
    return str(path)


def podman(
    *args: str, check: bool = True, timeout: float = 3600, quiet: bool = True
) -> subprocess.CompletedProcess:
    containers_conf()
    command = ["podman", "--runtime", "runc", *args]
    if quiet:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    else:
        result = subprocess.run(command, text=True, timeout=timeout)
    if check and result.returncode != 0:
        detail = (result.stderr or "").strip()[-3000:] if quiet else "(see above)"
        raise BuildFailed(f"podman {' '.join(args[:2])} failed: {detail}")
    return result


def image_exists(image: str) -> bool:
    return podman("image", "exists", image, check=False).returncode == 0


def bootstrap_debian_base(rebuild: bool = False) -> str:
    """``localhost/triton-ge-base:bookworm`` from Debian's packages (kept: later builds reuse it)."""
    if image_exists(DEBIAN_BASE) and not rebuild:
        return DEBIAN_BASE
    if not shutil.which("mmdebstrap"):
        raise BuildFailed(
            "no registry answers and mmdebstrap is missing: install it (apt-get install mmdebstrap) or set "
            "BASE_IMAGE/AGENT_BASE_IMAGE to an image this machine has"
        )
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="triton-ge-base-") as tmp:
        tar = Path(tmp) / "base.tar"
        command = [
            "mmdebstrap", "--variant=minbase", "--include=" + ",".join(DEBIAN_PACKAGES),
            # No documentation, manual pages or translations in the image; apt's lists are fetched by the
            # Dockerfile's own `apt-get update` and removed again.
            "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*",
            "--dpkgopt=path-exclude=/usr/share/locale/*", "--dpkgopt=path-include=/usr/share/locale/locale.alias",
            "--customize-hook=rm -rf \"$1\"/var/lib/apt/lists/* \"$1\"/var/cache/apt/*",
            "bookworm", str(tar),
            "deb http://deb.debian.org/debian bookworm main",
            "deb http://deb.debian.org/debian bookworm-updates main",
            "deb http://deb.debian.org/debian-security bookworm-security main",
        ]  # fmt: skip
        say("no registry answers: bootstrapping the base from Debian's packages (mmdebstrap)")
        result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        if result.returncode != 0:
            raise BuildFailed(f"mmdebstrap failed: {result.stderr.strip()[-3000:]}")
        podman(
            "import",
            "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "--change", "CMD [\"/bin/bash\"]",
            str(tar), DEBIAN_BASE,
        )  # fmt: skip
    say(f"{DEBIAN_BASE}: bootstrapped in {time.monotonic() - started:.0f} s")
    return DEBIAN_BASE


def resolve_base(requested: str | None, rebuild_base: bool) -> str:
    """The image a stage builds on: the one asked for if this machine has it or can pull it; else Debian's."""
    image = requested or PUBLIC_BASE
    if image_exists(image):
        return image
    pulled = podman("pull", "--quiet", image, check=False, timeout=600)
    if pulled.returncode == 0:
        return image
    if requested:
        raise BuildFailed(
            f"base image {requested} is not here and cannot be pulled: {pulled.stderr.strip()[-500:]}"
        )
    say(
        f"{image} cannot be pulled ({pulled.stderr.strip().splitlines()[-1][:160] if pulled.stderr else 'no answer'})"
    )
    return bootstrap_debian_base(rebuild_base)


def ca_bundle() -> str | None:
    """The certificate authorities this machine trusts (BUILD_CA_BUNDLE, else the system's bundle): given to
    the build as a secret, so pip and npm reach the registries through a proxy with its own CA."""
    for candidate in (os.environ.get("BUILD_CA_BUNDLE"), ssl.get_default_verify_paths().cafile,
                      "/etc/ssl/certs/ca-certificates.crt"):  # fmt: skip
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def build(
    target: str, tag: str, build_args: dict[str, str], context: Path = ROOT, quiet: bool = False
) -> float:
    started = time.monotonic()
    args = ["build", "--network", "host", "--target", target, "-t", tag, "-f", str(context / "Dockerfile")]
    bundle = ca_bundle()
    if bundle:
        args += ["--secret", f"id=ca,src={bundle}"]
    for key, value in build_args.items():
        args += ["--build-arg", f"{key}={value}"]
    say(f"building {tag} (target {target}, {', '.join(f'{k}={v}' for k, v in build_args.items())})")
    podman(*args, str(context), quiet=quiet)
    return time.monotonic() - started


def size_mb(image: str) -> float:
    out = podman("image", "inspect", "--format", "{{.Size}}", image).stdout.strip()
    return int(out) / 1e6


def lean_check(image: str) -> list[str]:
    """What an image must not hold: compilers, the test suite, pip's or npm's caches."""
    script = (
        "for p in /usr/bin/gcc /usr/bin/cc /usr/bin/g++ /usr/bin/node /app/tests /root/.cache/pip /root/.npm "
        '/home/platform/.cache /app/frontend/node_modules; do [ -e "$p" ] && echo "$p"; done; true'
    )
    out = podman("run", "--rm", "--network", "host", "--entrypoint", "/bin/sh", image, "-c", script).stdout
    return out.split()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("platform", "host-agent"), help="Build one of the two images.")
    parser.add_argument("--rebuild-base", action="store_true", help="Bootstrap the Debian base again.")
    args = parser.parse_args(argv)
    if not shutil.which("podman"):
        print("images: podman is missing: install it (apt-get install podman runc)", file=sys.stderr)
        return 1
    try:
        built = []
        # Both stages' bases, whichever image is built: the requirements stage is on BASE_IMAGE.
        bases = {"BASE_IMAGE": resolve_base(os.environ.get("BASE_IMAGE") or None, args.rebuild_base)}
        bases["AGENT_BASE_IMAGE"] = resolve_base(os.environ.get("AGENT_BASE_IMAGE") or None, False)
        for target, tag in (("platform", PLATFORM_IMAGE), ("host-agent", AGENT_IMAGE)):
            if args.only in (None, target):
                built.append((tag, build(target, tag, bases)))
        for image, _ in built:
            extra = lean_check(image)
            if extra:
                raise BuildFailed(f"{image} is not lean: it holds {', '.join(extra)}")
        for image, seconds in built:
            say(f"{image}: {size_mb(image):.0f} MB, built in {seconds:.0f} s")
    except BuildFailed as exc:
        print(f"images: FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
