"""``manage.py fleet_local_host``: the credential goes where the local agent reads it (AGENT_CREDENTIAL_FILE)."""

from __future__ import annotations

import pytest
from django.core.management import call_command

from apps.fleet.models import Host, TritonInstance, hash_host_secret

pytestmark = pytest.mark.django_db


def test_the_credential_is_written_to_the_agents_credential_file_by_default(settings, tmp_path, capsys):
    settings.AGENT_CREDENTIAL_FILE = tmp_path / "agent" / "local.credential"
    call_command("fleet_local_host", "--name", "local", "--instance", "cpu-0:18100:18101:18102")
    host = Host.objects.get(name="local")
    written = settings.AGENT_CREDENTIAL_FILE.read_text().strip()
    assert hash_host_secret(written) == host.credential_hash
    assert settings.AGENT_CREDENTIAL_FILE.stat().st_mode & 0o777 == 0o600
    assert TritonInstance.objects.filter(host=host, name="cpu-0", http_port=18100).exists()
    call_command("fleet_local_host", "--name", "local")
    assert "is current" in capsys.readouterr().out
    assert settings.AGENT_CREDENTIAL_FILE.read_text().strip() == written


def test_an_explicit_credential_file_wins(settings, tmp_path):
    settings.AGENT_CREDENTIAL_FILE = tmp_path / "default.credential"
    chosen = tmp_path / "chosen.credential"
    call_command("fleet_local_host", "--name", "local", "--credential-file", str(chosen))
    assert chosen.is_file() and not settings.AGENT_CREDENTIAL_FILE.exists()
