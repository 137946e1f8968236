"""The host agent's side of the agent API: the platform URL and this host's credential are all it holds.

``PlatformClient`` makes the calls (join, heartbeat, desired state with ``If-None-Match``, instance and
placement reports, artifact downloads), each with the agent protocol's version (``X-Agent-Protocol``) and
each message checked against ``hostagent.protocol`` both ways: what the agent sends before it goes, what the
platform answers before the agent acts on it. A 426 (a version the platform does not serve) is
``ProtocolRefused``, never retried. ``DesiredState`` is
the last answer as plain objects whose attributes read like the platform's rows, so ``hostagent.placement``
says what it does without knowing where the answer came from. Nothing here touches a database or a broker.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import requests

from backend_ge import naming
from hostagent import protocol, tuning_protocol
from hostagent.protocol import API_PREFIX, PlacementReport
from hostagent.repository import RepositoryError

log = logging.getLogger(__name__)

# A long poll's client timeout is its wait plus this: the platform answers at the end of the wait.
LONG_POLL_GRACE = 15.0


class ArtifactDownloadError(RepositoryError):
    """The version's files could not be fetched from the platform (or did not match their sha256)."""


class PlatformError(RuntimeError):
    """The platform could not be reached or refused a call; the message says which and why."""


class CredentialRefused(PlatformError):
    """401: the host was revoked (or the credential is wrong). The agent takes no more work."""


class ProtocolRefused(PlatformError):
    """426: the platform does not serve this agent's protocol version; the message names both versions and
    which side to upgrade. Retrying cannot help: the agent or the platform must be upgraded."""


def _refused_protocol(platform: str, response: requests.Response) -> ProtocolRefused:
    return ProtocolRefused(
        f"{platform} refused this host agent, which speaks agent protocol {protocol.AGENT_PROTOCOL_VERSION} "
        f"(HTTP 426): {_reason(response)}"
    )


def _reason(response: requests.Response) -> str:
    try:
        return str(response.json()["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


def join(platform: str, token: str, credential_file: Path, timeout: float = 30) -> dict:
    """Exchange a join token for the host's credential and keep it in ``credential_file`` (mode 0600)."""
    try:
        response = requests.post(
            f"{platform.rstrip('/')}{API_PREFIX}/join",
            json={"join_token": token},
            headers=protocol.agent_protocol_headers(),
            timeout=timeout,
        )
    except requests.RequestException as exc:
        raise PlatformError(f"the platform at {platform} did not answer: {exc}") from None
    if response.status_code == 426:
        raise _refused_protocol(platform, response)
    if response.status_code != 201:
        raise PlatformError(f"joining {platform} failed (HTTP {response.status_code}): {_reason(response)}")
    answer = _checked(protocol.check_join_answer, response)
    save_credential(credential_file, answer["credential"])
    return answer


def _checked(check, response: requests.Response):
    """The answer's JSON through its protocol check: a platform that answers something else is an error the
    agent reports (and retries like any failed call), never a half-read state."""
    try:
        return check(response.json())
    except ValueError as exc:  # ProtocolError is a ValueError, and so is a body that is not JSON
        raise PlatformError(
            f"the platform's answer to {response.request.method} {response.url} does not fit "
            f"the agent protocol: {exc}"
        ) from None


def _check_desired_state(raw) -> dict:
    state = protocol.check_desired_state(raw)
    tuning_protocol.check_tunings(state)
    return state


def save_credential(path: Path, credential: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(credential + "\n")
    os.replace(tmp, path)


def load_credential(path: Path) -> str:
    return path.read_text().strip()


class PlatformClient:
    """Calls of one host's agent. Transient failures (connection errors, 5xx) are retried a few times with
    backoff; a 401 raises ``CredentialRefused`` at once, a 426 ``ProtocolRefused``."""

    def __init__(self, platform: str, credential: str, *, timeout: float = 30, retries: int = 3) -> None:
        self.base = platform.rstrip("/") + API_PREFIX
        self.platform = platform
        self.timeout = timeout
        self.retries = retries
        self._local = threading.local()
        self._credential = credential

    def _session(self) -> requests.Session:
        # One session per thread: the supervisor, reconcile, poll and heartbeat threads call concurrently.
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            session.headers["Authorization"] = f"Bearer {self._credential}"
            session.headers.update(protocol.agent_protocol_headers())
        return session

    def call(self, method: str, path: str, *, ok=(200,), **kwargs) -> requests.Response:
        kwargs.setdefault("timeout", self.timeout)
        delay = 0.2
        for attempt in range(self.retries + 1):
            try:
                response = self._session().request(method, self.base + path, **kwargs)
            except requests.RequestException as exc:
                error = f"{method} {path}: {exc.__class__.__name__}: {exc}"
            else:
                if response.status_code == 401:
                    raise CredentialRefused(
                        f"{self.platform} refused this host's credential: {_reason(response)}"
                    )
                if response.status_code == 426:
                    raise _refused_protocol(self.platform, response)
                if response.status_code in ok:
                    return response
                if response.status_code < 500:
                    raise PlatformError(f"{method} {path}: HTTP {response.status_code}: {_reason(response)}")
                error = f"{method} {path}: HTTP {response.status_code}: {_reason(response)}"
            if attempt < self.retries:
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        raise PlatformError(f"the platform at {self.platform} did not answer: {error}")

    # -- calls -------------------------------------------------------------------------------------------
    def heartbeat(self, body: dict) -> dict:
        protocol.check_heartbeat(body)
        return _checked(protocol.check_hello, self.call("POST", "/heartbeat", json=body))

    def desired_state(self, etag: str | None, wait: float = 0) -> tuple[str | None, dict | None]:
        """(etag, state), or (etag, None) when nothing changed since ``etag``.

        ``wait`` > 0 with an ``etag``: a long poll - the platform holds the call until the state changes or
        ``wait`` s have passed (it caps the wait); the client's timeout is longer than the wait."""
        headers = {"If-None-Match": etag} if etag else {}
        kwargs = {}
        if wait > 0 and etag:
            wait = round(min(wait, 3600.0), 3)
            kwargs = {"params": {"wait": f"{wait:g}"}, "timeout": wait + LONG_POLL_GRACE}
        response = self.call("GET", "/desired-state", ok=(200, 304), headers=headers, **kwargs)
        if response.status_code == 304:
            return etag, None
        return response.headers.get("ETag"), _checked(_check_desired_state, response)

    def report_instance(self, instance_id: int, fields: dict) -> None:
        protocol.check_instance_report(fields)
        self.call("POST", f"/instances/{instance_id}/state", json=fields)

    def report_placement(self, placement_id: int, report: PlacementReport) -> tuple[bool, dict | None]:
        """(accepted, the placement as it is now)."""
        body = report.body()
        protocol.check_placement_report(body)
        response = self.call("POST", f"/placements/{placement_id}/report", json=body)
        return _checked(protocol.check_placement_answer, response)

    def report_tuning(self, job_id: int, body: dict) -> tuple[bool, bool]:
        """(accepted, cancel): a report the platform did not accept (the job ended there) ends the run."""
        tuning_protocol.check_tuning_report(body)
        response = self.call("POST", f"/tunings/{job_id}/report", json=body, ok=(200, 404, 409))
        if response.status_code != 200:
            return False, True
        return _checked(tuning_protocol.check_tuning_answer, response)

    def report_final_counts(self, instance_id: int, counts: dict) -> None:
        self.call("POST", f"/instances/{instance_id}/final-counts", json=counts)

    def download_version(self, version: VersionSpec, cache_root: Path) -> Path:
        """The version's files in ``cache_root/<version id>``, each checked against the manifest's sha256.

        One download per version at a time, across threads and processes (a lock file per version): two
        instances placing the same version, or two agents sharing a cache, never replace a directory another
        one is reading. A cached copy is used only while every file is there with its manifest size; a file
        lost from the cache is downloaded again."""
        if not version.files:
            raise ArtifactDownloadError(f"{version}: the platform has no converted files for it")
        cache_root.mkdir(parents=True, exist_ok=True)
        with open(cache_root / f".lock-{version.pk}", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return self._download_locked(version, cache_root)

    def _download_locked(self, version: VersionSpec, cache_root: Path) -> Path:
        target = cache_root / str(version.pk)
        marker = target / ".manifest-sha256"
        fingerprint = hashlib.sha256(
            repr(sorted((f["path"], f["sha256"]) for f in version.files)).encode()
        ).hexdigest()
        if marker.is_file() and marker.read_text() == fingerprint and _cached_files_intact(target, version):
            return target
        tmp = cache_root / f".tmp-{version.pk}-{uuid.uuid4().hex[:8]}"
        try:
            for entry in version.files:
                relative = Path(entry["path"])
                if relative.is_absolute() or ".." in relative.parts:
                    raise ArtifactDownloadError(f"{version}: refusing manifest path {entry['path']!r}")
                destination = tmp / relative
                destination.parent.mkdir(parents=True, exist_ok=True)
                digest = hashlib.sha256()
                try:
                    response = self.call(
                        "GET", f"/versions/{version.pk}/files/{relative.as_posix()}", stream=True, timeout=60
                    )
                except (CredentialRefused, ProtocolRefused):
                    raise
                except PlatformError as exc:
                    raise ArtifactDownloadError(f"{version}: download of {relative} failed: {exc}") from None
                with response, destination.open("wb") as handle:
                    for chunk in response.iter_content(1 << 20):
                        digest.update(chunk)
                        handle.write(chunk)
                if digest.hexdigest() != entry["sha256"]:
                    raise ArtifactDownloadError(
                        f"{version}: {relative} does not match its sha256; download discarded"
                    )
            (tmp / marker.name).write_text(fingerprint)
            if target.exists():
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return target


def _cached_files_intact(target: Path, version: VersionSpec) -> bool:
    """Every manifest file is in the cache with its size (a cheap check; the sha256 was verified at download)."""
    for entry in version.files:
        try:
            if (target / entry["path"]).stat().st_size != entry.get("size", -1):
                return False
        except OSError:
            return False
    return True


# -- the desired state as objects ------------------------------------------------------------------------
@dataclass(eq=False)
class VersionSpec:
    pk: int
    number: int
    label: str
    model_name: str
    config_text: str
    signature: dict
    instance_limit: int
    files: list[dict] | None
    # An ensemble's steps (Triton names of the same team's models): all its config may call.
    steps: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.label

    def __eq__(self, other) -> bool:
        return isinstance(other, VersionSpec) and other.pk == self.pk

    def __hash__(self) -> int:
        return hash(self.pk)


@dataclass(eq=False)
class InstanceSpec:
    """One instance of this host as the platform wants it (its ports, devices, flags, key and commands)."""

    pk: int
    name: str
    label: str
    http_port: int
    grpc_port: int
    metrics_port: int
    device_ids: list[int]
    executor: str
    latency_summaries: bool
    desired_state: str
    state: str
    restarts: int
    crash_times: list[str]
    pid: int | None
    command: str
    command_seq: int
    api_key: str

    def __str__(self) -> str:
        return self.label

    @classmethod
    def from_json(cls, entry: dict) -> InstanceSpec:
        return cls(pk=entry["id"], **{k: v for k, v in entry.items() if k != "id"})


@dataclass(eq=False)
class InstanceRef:
    pk: int
    label: str

    def __str__(self) -> str:
        return self.label


@dataclass(eq=False)
class DeploymentSpec:
    """The deployment of one placement, as far as the agent needs it."""

    pk: int
    model_name: str
    undeploy: bool
    target_version: VersionSpec | None
    active_version: VersionSpec | None
    canary: VersionSpec | None

    def triton_model_name(self) -> str:
        return self.model_name

    @property
    def target_version_id(self) -> int | None:
        return self.target_version.pk if self.target_version else None


@dataclass(eq=False)
class PlacementSpec:
    pk: int
    instance_id: int
    instance: InstanceRef
    deployment: DeploymentSpec
    generation: int
    applied_generation: int
    state: str
    served_version: VersionSpec | None
    canary_version: VersionSpec | None
    keep_model: bool

    def is_applied(self) -> bool:
        return self.applied_generation == self.generation

    @property
    def undeploy(self) -> bool:
        return self.deployment.undeploy

    @property
    def canary_version_id(self) -> int | None:
        return self.canary_version.pk if self.canary_version else None


@dataclass(frozen=True)
class TuningSpec:
    """A tuning job this host runs (``hostagent.tuning_runner``): its version's candidates measured under
    ``scratch_name`` on one instance."""

    pk: int
    instance_id: int
    version: VersionSpec
    p99_ms: float
    rate_rps: float | None
    budget_s: int
    max_candidates: int
    max_instances: int
    gears: tuple[int, ...]
    cancel: bool

    @property
    def scratch_name(self) -> str:
        return naming.tuning_name(self.version.model_name, self.pk)

    @classmethod
    def from_json(cls, entry: dict, version: VersionSpec) -> TuningSpec:
        return cls(
            pk=entry["id"],
            instance_id=entry["instance"],
            version=version,
            p99_ms=entry["objective"]["p99_ms"],
            rate_rps=entry["objective"].get("rate_rps"),
            budget_s=entry["budget_s"],
            max_candidates=entry["max_candidates"],
            max_instances=entry["max_instances"],
            gears=tuple(entry["gears"]),
            cancel=entry["cancel"],
        )


@dataclass
class DesiredState:
    """The last desired state, replaced by each fetch and patched by the answers to this agent's reports."""

    generation: int = 0
    instances: dict[int, InstanceSpec] = field(default_factory=dict)
    placements: dict[int, PlacementSpec] = field(default_factory=dict)
    versions: dict[int, VersionSpec] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # placement -> (generation, monotonic time this agent first had that decision): a load's queued time.
    seen: dict[int, tuple[int, float]] = field(default_factory=dict)
    tunings: dict[int, TuningSpec] = field(default_factory=dict)

    def seen_at(self, placement_id: int, generation: int) -> float | None:
        with self.lock:
            seen = self.seen.get(placement_id)
        return seen[1] if seen is not None and seen[0] == generation else None

    def _note_seen(self) -> None:
        now = time.monotonic()
        self.seen = {
            pk: self.seen[pk] if self.seen.get(pk, (None,))[0] == p.generation else (p.generation, now)
            for pk, p in self.placements.items()
        }

    def replace(self, raw: dict) -> None:
        versions = {
            int(key): VersionSpec(
                pk=v["id"],
                **{
                    k: v[k]
                    for k in (
                        "number",
                        "label",
                        "model_name",
                        "config_text",
                        "signature",
                        "instance_limit",
                        "files",
                    )
                },
                steps=tuple(v.get("steps") or ()),
            )
            for key, v in raw["versions"].items()
        }
        with self.lock:
            self.versions = versions  # only what is placed now: nothing piles up over months
            self.generation = raw["generation"]
            self.instances = {e["id"]: InstanceSpec.from_json(e) for e in raw["instances"]}
            fresh = {e["id"]: self._placement(e) for e in raw["placements"]}
            for pk, placement in fresh.items():
                local = self.placements.get(pk)
                # A report answered after this state was read is newer: keep what it said.
                if (
                    local is not None
                    and local.generation == placement.generation
                    and local.applied_generation > placement.applied_generation
                ):
                    fresh[pk] = local
            self.placements = fresh
            self._note_seen()
            self.tunings = {
                e["id"]: TuningSpec.from_json(e, versions[e["version"]])
                for e in raw.get("tunings", [])
                if e["version"] in versions
            }

    def update_placement(self, entry: dict | None, placement_id: int) -> None:
        with self.lock:
            if entry is None:
                self.placements.pop(placement_id, None)
            elif all(
                entry[key] is None or entry[key] in self.versions
                for key in ("target", "served", "canary", "canary_target", "active", "target_version")
            ):
                self.placements[entry["id"]] = self._placement(entry)

    def _placement(self, entry: dict) -> PlacementSpec:
        def version(key: str) -> VersionSpec | None:
            return self.versions.get(entry[key]) if entry.get(key) else None

        return PlacementSpec(
            pk=entry["id"],
            instance_id=entry["instance"],
            instance=InstanceRef(entry["instance"], entry["label"]),
            deployment=DeploymentSpec(
                pk=entry["deployment"],
                model_name=entry["model_name"],
                undeploy=entry["undeploy"],
                target_version=version("target_version"),
                active_version=version("active"),
                canary=version("canary_target"),
            ),
            generation=entry["generation"],
            applied_generation=entry["applied_generation"],
            state=entry["state"],
            served_version=version("served"),
            canary_version=version("canary"),
            keep_model=entry["keep_model"],
        )

    def placement(self, placement_id: int) -> PlacementSpec | None:
        with self.lock:
            return self.placements.get(placement_id)

    def placements_on(self, instance_id: int) -> list[PlacementSpec]:
        with self.lock:
            return sorted(
                (p for p in self.placements.values() if p.instance_id == instance_id), key=lambda p: p.pk
            )

    def tunings_on(self, instance_id: int) -> list[TuningSpec]:
        with self.lock:
            return sorted(
                (t for t in self.tunings.values() if t.instance_id == instance_id), key=lambda t: t.pk
            )

    def all_tunings(self) -> list[TuningSpec]:
        with self.lock:
            return sorted(self.tunings.values(), key=lambda t: t.pk)

    def instance(self, instance_id: int) -> InstanceSpec | None:
        with self.lock:
            return self.instances.get(instance_id)

    def all_instances(self) -> list[InstanceSpec]:
        with self.lock:
            return sorted(self.instances.values(), key=lambda i: i.pk)
