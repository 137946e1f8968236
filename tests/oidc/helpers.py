"""A real OpenID Connect provider for the single sign-on tests: npm's ``oidc-provider`` run with node
(``tests/oidc/provider/server.mjs``, installed by ``make install``). The test steers it through a JSON control
file: which account the next login interaction signs in, each account's claims, expired ID tokens."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

from backend_ge.runtime import free_port
from tests.conftest import wait_for

PROVIDER_DIR = Path(__file__).resolve().parent / "provider"
CLIENT_ID = "serving-platform"
CLIENT_SECRET = "test-only-client-secret"


def provider_installed() -> bool:
    return shutil.which("node") is not None and (PROVIDER_DIR / "node_modules" / "oidc-provider").is_dir()


class OidcProvider:
    def __init__(self, directory: Path, redirect_uri: str) -> None:
        self.port = free_port()
        self.issuer = f"http://127.0.0.1:{self.port}"
        self.control_file = directory / "oidc-control.json"
        self.log_path = directory / "oidc-provider.log"
        self.redirect_uri = redirect_uri
        self.control(login="nobody", accounts={})
        self.process: subprocess.Popen | None = None

    def control(self, *, login: str, accounts: dict, id_token_expired: bool = False) -> None:
        """What the provider does from its next request on (it reads the file at every request)."""
        data = {"login": login, "accounts": accounts, "idTokenExpired": id_token_expired}
        tmp = self.control_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self.control_file)

    def start(self) -> OidcProvider:
        env = {
            **os.environ,
            "PORT": str(self.port),
            "ISSUER": self.issuer,
            "CLIENT_ID": CLIENT_ID,
            "CLIENT_SECRET": CLIENT_SECRET,
            "REDIRECT_URI": self.redirect_uri,
            "CONTROL_FILE": str(self.control_file),
        }
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                ["node", "server.mjs"], cwd=PROVIDER_DIR, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        wait_for(self._answers, 20, f"oidc-provider at {self.issuer} (log: {self.log_path})")
        return self

    def _answers(self) -> bool:
        assert self.process.poll() is None, f"oidc-provider exited: {self.log_path.read_text()[-2000:]}"
        try:
            with urllib.request.urlopen(f"{self.issuer}/.well-known/openid-configuration", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def sso_settings(settings, provider: OidcProvider) -> None:
    """Turn single sign-on on against ``provider``, as the OIDC_* environment variables would."""
    settings.OIDC_ISSUER = provider.issuer
    settings.OIDC_ENABLED = True
    settings.OIDC_PROVIDER_NAME = "Test IdP"
    settings.OIDC_RP_CLIENT_ID = CLIENT_ID
    settings.OIDC_RP_CLIENT_SECRET = CLIENT_SECRET
    settings.OIDC_RP_SCOPES = "openid email profile groups"
    settings.AUTHENTICATION_BACKENDS = [
        *settings.AUTHENTICATION_BACKENDS,
        "apps.teams.oidc.PlatformOIDCBackend",
    ]
