"""A small client of the platform's REST API, for pipelines and for the ``tgp`` command line.

It speaks HTTP only (``httpx``) and imports nothing of the platform: a CI job installs it and ships a model
with a few calls::

    from tgp.client import Client

    client = Client.from_config()                  # TGP_URL / TGP_TOKEN, or what `tgp login` stored
    version = client.upload("model.onnx", model="classifier")
    version = client.wait_for_version("classifier", version["number"], timeout=600)
    client.deploy("classifier", version=version["number"], instances=[3])

Every failure the platform reports raises :class:`ApiError` with the platform's own message; a wait that
runs out raises :class:`TimedOut`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

CHUNK_BYTES = 8 * 1024 * 1024  # the browser uploader's chunk size: a lost chunk costs little to resend
OFFSET_HEADER = "Upload-Offset"
# A dropped connection is retried from the server's offset this many times in a row before giving up.
UPLOAD_RETRIES = 5

ProgressCallback = Callable[[int, int], None]


class TgpError(Exception):
    """Something went wrong; ``str()`` is the message to show."""


class ApiError(TgpError):
    """The platform answered with an error: ``status`` and its JSON body (``error``, ``message``, ``fields``)."""

    def __init__(self, status: int, message: str, body: Any = None):
        super().__init__(message)
        self.status = status
        self.body = body


class TimedOut(TgpError):
    """A wait ran out before the platform reached the state asked for."""


class Failed(TgpError):
    """What was waited for ended badly (a conversion failed, a rollout rolled back)."""


# --- configuration: the platform's URL, the token and the team -----------------------------------------


def config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "tgp"


def _write_private(path: Path, data: dict) -> None:
    """Write JSON readable by its owner only (0600, in a 0700 directory): the file holds an API token."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    # A file left by an older umask or by hand keeps its mode through O_CREAT: set it explicitly.
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle, indent=2)
    os.replace(tmp, path)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise TgpError(f"Cannot read {path}: {exc}") from None


@dataclass
class Config:
    """Where and as whom to call the platform. The environment (TGP_URL, TGP_TOKEN, TGP_TEAM) wins over the
    file `tgp login` writes, so a pipeline needs no file at all."""

    url: str = ""
    token: str = ""
    team: str = ""
    path: Path = field(default_factory=lambda: config_dir() / "config.json")

    @classmethod
    def load(cls) -> Config:
        config = cls()
        stored = _read_json(config.path)
        config.url = os.environ.get("TGP_URL") or stored.get("url", "")
        config.token = os.environ.get("TGP_TOKEN") or stored.get("token", "")
        config.team = os.environ.get("TGP_TEAM") or stored.get("team", "")
        return config

    def save(self) -> Path:
        _write_private(self.path, {"url": self.url, "token": self.token, "team": self.team})
        return self.path


# --- resumable uploads: what lets a second run continue the first one's upload ---------------------------


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while piece := handle.read(1024 * 1024):
            digest.update(piece)
    return digest.hexdigest()


class UploadJournal:
    """Open uploads by (platform, team, model, file digest, size), so that an upload a killed process left
    half done resumes from the server's offset instead of starting over."""

    def __init__(self, path: Path | None = None):
        self.path = path or config_dir() / "uploads.json"

    @staticmethod
    def key(url: str, team: str, model: str, sha256: str, size: int) -> str:
        return f"{url.rstrip('/')}|{team}|{model}|{sha256}|{size}"

    def get(self, key: str) -> str | None:
        return _read_json(self.path).get(key)

    def put(self, key: str, upload_url: str) -> None:
        entries = _read_json(self.path)
        entries[key] = upload_url
        _write_private(self.path, entries)

    def forget(self, key: str) -> None:
        entries = _read_json(self.path)
        if entries.pop(key, None) is not None:
            _write_private(self.path, entries)


def _message(response: httpx.Response) -> tuple[str, Any]:
    """The platform's error message (``{"error", "message", "fields"}``), or the status line."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("message"):
        return str(body["message"]), body
    if isinstance(body, dict) and body.get("detail"):
        return str(body["detail"]), body
    text = response.text.strip()[:300]
    return f"HTTP {response.status_code} {response.reason_phrase}" + (f": {text}" if text else ""), body


class Client:
    """The platform's management API for one team, as the token's user."""

    def __init__(
        self,
        url: str,
        token: str,
        team: str = "",
        *,
        timeout: float = 60.0,
        transport: httpx.BaseTransport | None = None,
        journal: UploadJournal | None = None,
    ):
        if not url:
            raise TgpError("No platform URL: run `tgp login --url URL` or set TGP_URL.")
        if not token:
            raise TgpError("No API token: run `tgp login` or set TGP_TOKEN.")
        self.url = url.rstrip("/")
        self.token = token
        self._team = team
        self.journal = journal or UploadJournal()
        self.http = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {token}", "Accept": "application/json"},
            timeout=timeout,
            transport=transport,
        )

    @classmethod
    def from_config(cls, config: Config | None = None, **kwargs) -> Client:
        config = config or Config.load()
        return cls(config.url, config.token, config.team, **kwargs)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- plumbing ------------------------------------------------------------------------------------
    def request(self, method: str, path: str, **kwargs) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            # Name what was called: the gateway's address (infer) is not the platform's.
            raise TgpError(f"Cannot reach {exc.request.url}: {exc}") from None
        if response.status_code >= 400:
            message, body = _message(response)
            raise ApiError(response.status_code, message, body)
        if response.status_code == 204 or not response.content:
            return None
        return response.json()

    def _all(self, path: str, **params) -> list[dict]:
        """Every row of a paginated list."""
        rows: list[dict] = []
        params = {"page_size": 500, **params}
        page = 1
        while True:
            body = self.request("GET", path, params={**params, "page": page})
            if isinstance(body, list):
                return body
            rows.extend(body["results"])
            if not body.get("next"):
                return rows
            page += 1

    def me(self) -> dict:
        return self.request("GET", "/api/v1/me/")

    @property
    def team(self) -> str:
        """The team to act in: the one given, else the token's team (a token belongs to exactly one)."""
        if not self._team:
            teams = [t["slug"] for t in self.me()["teams"]]
            if len(teams) != 1:
                raise TgpError(
                    f"Name the team with --team or TGP_TEAM (this account is in {len(teams)}: "
                    f"{', '.join(teams) or 'none'})."
                )
            self._team = teams[0]
        return self._team

    def _team_path(self, rest: str) -> str:
        return f"/api/v1/teams/{self.team}/{rest}"

    # --- models and versions -------------------------------------------------------------------------
    def list_models(self) -> list[dict]:
        return self._all(self._team_path("models/"))

    def create_model(self, name: str, *, slug: str = "", task_type: str = "", description: str = "") -> dict:
        body: dict[str, Any] = {"name": name, "description": description}
        if slug:
            body["slug"] = slug
        if task_type:
            body["task_type"] = task_type
        return self.request("POST", self._team_path("models/"), json=body)

    def set_objective(self, model: str, p99_ms: float | None, rate_rps: float | None = None) -> dict:
        """Set the model's latency objective (``p99_ms`` None clears it)."""
        body = {"objective_p99_ms": p99_ms, "objective_rate_rps": rate_rps}
        return self.request("PATCH", self._team_path(f"models/{quote(model, safe='')}/"), json=body)

    def serving_settings(self, model: str, number: int) -> dict:
        """A version's serving settings (the fields ``derive_version`` takes), as its config API reports them."""
        config = self.request("GET", self._team_path(f"models/{model}/versions/{number}/config/"))
        if not config.get("serving"):
            raise TgpError(f"{model} v{number} has no serving settings of its own (an ensemble?)")
        return config["serving"]

    def derive_version(self, model: str, number: int, serving: dict, *, note: str = "") -> dict:
        path = self._team_path(f"models/{model}/versions/{number}/config/derive/")
        return self.request("POST", path, json={"serving": serving, "note": note})

    # --- tuning jobs --------------------------------------------------------------------------------
    def start_tuning(self, model: str, number: int, **options) -> dict:
        body = {"model": model, "version": number, **{k: v for k, v in options.items() if v is not None}}
        return self.request("POST", self._team_path("tunings/"), json=body)

    def get_tuning(self, job_id: int) -> dict:
        return self.request("GET", self._team_path(f"tunings/{job_id}/"))

    def list_tunings(self, model: str | None = None) -> list[dict]:
        return self._all(self._team_path("tunings/"), **({"model": model} if model else {}))

    def cancel_tuning(self, job_id: int) -> dict:
        return self.request("POST", self._team_path(f"tunings/{job_id}/cancel/"))

    def create_tuned_version(self, job_id: int, *, note: str = "") -> dict:
        return self.request("POST", self._team_path(f"tunings/{job_id}/create-version/"), json={"note": note})

    def wait_for_tuning(
        self,
        job_id: int,
        *,
        timeout: float = 3900,
        interval: float = 2.0,
        on_progress: Callable[[dict], None] | None = None,
    ) -> dict:
        """Poll until the job ends: SUCCEEDED is returned, any other end raises :class:`Failed`."""
        deadline = time.monotonic() + timeout
        seen = None
        while True:
            job = self.get_tuning(job_id)
            if on_progress and (job["state"], job["points_measured"]) != seen:
                on_progress(job)
            seen = (job["state"], job["points_measured"])
            if job["state"] == "SUCCEEDED":
                return job
            if job["state"] in ("FAILED", "CANCELLED", "TIMED_OUT"):
                raise Failed(f"Tuning {job_id} {job['state']}: {job.get('reason') or 'no message'}")
            if time.monotonic() >= deadline:
                raise TimedOut(f"Tuning {job_id} is still {job['state']} after {timeout:g}s.")
            time.sleep(interval)

    def list_versions(self, model: str) -> list[dict]:
        return self._all(self._team_path(f"models/{model}/versions/"), ordering="-number")

    def get_version(self, model: str, number: int) -> dict:
        return self.request("GET", self._team_path(f"models/{model}/versions/{number}/"))

    def wait_for_version(
        self,
        model: str,
        number: int,
        *,
        timeout: float = 600,
        interval: float = 1.0,
        on_state: Callable[[dict], None] | None = None,
    ) -> dict:
        """Poll until the version is READY (returned) or FAILED (:class:`Failed` with its error)."""
        deadline = time.monotonic() + timeout
        last = None
        while True:
            version = self.get_version(model, number)
            if on_state and version["state"] != last:
                on_state(version)
            last = version["state"]
            if version["state"] == "READY":
                return version
            if version["state"] == "FAILED":
                raise Failed(f"Version {number} of {model} failed: {version.get('error') or 'no message'}")
            if time.monotonic() >= deadline:
                raise TimedOut(f"Version {number} of {model} is still {last} after {timeout:g}s.")
            time.sleep(interval)

    # --- the resumable upload protocol (see the platform's README, "REST API") ------------------------
    def upload(
        self,
        path: str | os.PathLike,
        model: str,
        *,
        chunk_size: int = CHUNK_BYTES,
        serving_options: dict | None = None,
        conversion_options: dict | None = None,
        progress: ProgressCallback | None = None,
        on_resume: Callable[[int], None] | None = None,
    ) -> dict:
        """Upload ``path`` as the model's next version and complete it (the conversion is queued); returns
        the version. An earlier, interrupted upload of the same file to the same model resumes where the
        server's bytes end; a dropped connection is retried from the server's offset."""
        path = Path(path)
        size = path.stat().st_size
        sha256 = sha256_of(path)
        key = self.journal.key(self.url, self.team, model, sha256, size)
        session = self._resumable(self.journal.get(key))
        if session is not None:
            if on_resume:
                on_resume(session["offset"])
        else:
            body: dict[str, Any] = {"filename": path.name, "size": size, "sha256": sha256}
            if serving_options:
                body["serving_options"] = serving_options
            if conversion_options:
                body["conversion_options"] = conversion_options
            session = self.request("POST", self._team_path(f"models/{model}/uploads/"), json=body)
            self.journal.put(key, session["url"])
        upload_url = session["url"]
        offset = session["offset"]
        if progress:
            progress(offset, size)
        failures = 0
        with path.open("rb") as handle:
            while offset < size:
                handle.seek(offset)
                chunk = handle.read(min(chunk_size, size - offset))
                try:
                    response = self.http.patch(
                        upload_url,
                        content=chunk,
                        headers={
                            OFFSET_HEADER: str(offset),
                            "Content-Type": "application/offset+octet-stream",
                        },
                    )
                except httpx.TransportError as exc:
                    failures += 1
                    if failures > UPLOAD_RETRIES:
                        raise TgpError(
                            f"The upload stopped at byte {offset} of {size} ({exc}); run the same command "
                            "again to resume."
                        ) from None
                    time.sleep(min(2**failures * 0.25, 5))
                    offset = self._server_offset(upload_url)
                    continue
                if response.status_code in (409, 400) and OFFSET_HEADER in response.headers:
                    # The server holds a different number of bytes than we sent from (an earlier attempt's
                    # chunk landed after all, or part of one did): continue from its offset.
                    server_offset = int(response.headers[OFFSET_HEADER])
                    if server_offset == offset or (failures := failures + 1) > UPLOAD_RETRIES:
                        message, body = _message(response)
                        raise ApiError(response.status_code, message, body)
                    offset = server_offset
                    continue
                if response.status_code >= 400:
                    message, body = _message(response)
                    raise ApiError(response.status_code, message, body)
                failures = 0
                offset = int(response.headers.get(OFFSET_HEADER, offset + len(chunk)))
                if progress:
                    progress(offset, size)
        version = self.request("POST", f"{upload_url}complete/", json={"sha256": sha256})
        self.journal.forget(key)
        return version

    def _resumable(self, upload_url: str | None) -> dict | None:
        """The journaled upload's status if it is still open on the server; None to start afresh."""
        if not upload_url:
            return None
        try:
            session = self.request("GET", upload_url)
        except ApiError as exc:
            if exc.status == 404:  # cancelled, expired, or its version deleted
                return None
            raise
        return session if session.get("state") == "OPEN" else None

    def _server_offset(self, upload_url: str) -> int:
        return int(self.request("GET", upload_url)["offset"])

    # --- deployments and rollouts --------------------------------------------------------------------
    def list_deployments(self) -> list[dict]:
        return self._all(self._team_path("deployments/"))

    def get_deployment(self, pk: int) -> dict:
        return self.request("GET", self._team_path(f"deployments/{pk}/"))

    def deployment_of(self, model: str) -> dict | None:
        """The model's live deployment (there is at most one), or None."""
        for deployment in self.list_deployments():
            if deployment["model"] == model and deployment["state"] != "UNDEPLOYED":
                return deployment
        return None

    def _live_deployment(self, model: str) -> dict:
        deployment = self.deployment_of(model)
        if deployment is None:
            raise TgpError(f"Model '{model}' has no live deployment in team {self.team}.")
        return deployment

    def deploy(
        self, model: str, version: int, *, instances: list[int] | None = None, replicas: int | None = None
    ) -> dict:
        """Serve ``version``: a new deployment on ``instances`` (or by ``replicas``, where the platform
        places them), or, when the model is deployed already and no instances are named, a switch."""
        if not instances:
            current = self.deployment_of(model)
            if current is not None and replicas is None:
                return self.request(
                    "POST",
                    self._team_path(f"deployments/{current['id']}/switch/"),
                    json={"version": version},
                )
        body: dict[str, Any] = {"model": model, "version": version}
        if instances:
            body["instances"] = instances
        if replicas is not None:
            body["replicas"] = replicas
        return self.request("POST", self._team_path("deployments/"), json=body)

    def wait_for_deployment(
        self, model: str, *, version: int | None = None, timeout: float = 600, interval: float = 1.0
    ) -> dict:
        """Poll until the deployment is SERVING (``version`` when given): the platform reports SERVING once a
        call through the gateway succeeds, so a smoke test may call it at once."""
        deadline = time.monotonic() + timeout
        while True:
            deployment = self.get_deployment(self._live_deployment(model)["id"])
            if deployment["state"] == "SERVING" and version in (None, deployment["active_version"]):
                return deployment
            if deployment["state"] == "FAILED":
                raise Failed(f"Deployment of {model} failed: {deployment.get('last_error') or 'no message'}")
            if time.monotonic() >= deadline:
                raise TimedOut(f"Deployment of {model} is still {deployment['state']} after {timeout:g}s.")
            time.sleep(interval)

    def _rollouts_path(self, model: str, rest: str = "") -> str:
        return self._team_path(f"deployments/{self._live_deployment(model)['id']}/rollouts/{rest}")

    def start_rollout(self, model: str, version: int, **options) -> dict:
        body = {"version": version, **{k: v for k, v in options.items() if v is not None}}
        return self.request("POST", self._rollouts_path(model), json=body)

    def latest_rollout(self, model: str) -> dict:
        rows = self.request("GET", self._rollouts_path(model), params={"ordering": "-created_at"})
        rows = rows["results"] if isinstance(rows, dict) else rows
        if not rows:
            raise TgpError(f"Model '{model}' has no rollout.")
        return self.request("GET", self._rollouts_path(model, f"{rows[0]['id']}/"))

    def rollout_action(self, model: str, verb: str) -> dict:
        rollout = self.latest_rollout(model)
        return self.request("POST", self._rollouts_path(model, f"{rollout['id']}/{verb}/"))

    def watch_rollout(self, model: str, *, timeout: float = 3600, interval: float = 2.0) -> Iterator[dict]:
        """Yield the rollout whenever its state or weight changes, until it finishes; a rollout that rolled
        back or was aborted ends with :class:`Failed`."""
        deadline = time.monotonic() + timeout
        seen = None
        while True:
            rollout = self.latest_rollout(model)
            now = (rollout["state"], rollout["current_weight"], len(rollout.get("analyses") or []))
            if now != seen:
                seen = now
                yield rollout
            if rollout["state"] == "PROMOTED":
                # Promoted is decided; callable once the switch to the canary is routed by the gateway.
                self.wait_for_deployment(
                    model,
                    version=rollout["canary_version"],
                    timeout=max(deadline - time.monotonic(), 0),
                    interval=min(interval, 1.0),
                )
                return
            if rollout["state"] in ("ROLLED_BACK", "ABORTED"):
                raise Failed(
                    f"Rollout of {model} v{rollout['canary_version']} {rollout['state'].lower().replace('_', ' ')}"
                    + (f": {rollout['reason']}" if rollout.get("reason") else ".")
                )
            if time.monotonic() >= deadline:
                raise TimedOut(f"Rollout of {model} is still {rollout['state']} after {timeout:g}s.")
            time.sleep(interval)

    # --- inference through the gateway ---------------------------------------------------------------
    def infer(self, model: str, body: dict) -> dict:
        """One KServe v2 inference through the gateway URL the platform reports for the deployment."""
        endpoints = self._live_deployment(model).get("endpoints") or {}
        if not endpoints.get("infer_url"):
            raise TgpError(f"The platform reports no inference URL for {model}.")
        return self.request("POST", endpoints["infer_url"], json=body)
