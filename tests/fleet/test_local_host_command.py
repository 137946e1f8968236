"""``manage.py fleet_local_host``: the credential goes where the local agent reads it (AGENT_CREDENTIAL_FILE)."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.utils import timezone

from apps.deployments import services as deployments
from apps.deployments.models import DeploymentState
from apps.fleet.models import Host, Pool, TritonInstance, hash_host_secret
from tests.support.models import make_version

pytestmark = pytest.mark.django_db


def test_the_credential_is_written_where_the_agent_reads_it_by_default(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("AGENT_CREDENTIAL_FILE", raising=False)
    monkeypatch.setenv("FLEET_ROOT", str(tmp_path / "fleet"))
    default = tmp_path / "fleet" / "host-credential"  # the agent's default: ROOT/host-credential
    call_command("fleet_local_host", "--name", "local", "--instance", "cpu-0:18100:18101:18102")
    host = Host.objects.get(name="local")
    written = default.read_text().strip()
    assert hash_host_secret(written) == host.credential_hash
    assert default.stat().st_mode & 0o777 == 0o600
    assert TritonInstance.objects.filter(host=host, name="cpu-0", http_port=18100).exists()
    call_command("fleet_local_host", "--name", "local")
    assert "is current" in capsys.readouterr().out
    assert default.read_text().strip() == written
    monkeypatch.setenv("AGENT_CREDENTIAL_FILE", str(tmp_path / "agent.credential"))
    call_command("fleet_local_host", "--name", "local")
    host.refresh_from_db()
    assert hash_host_secret((tmp_path / "agent.credential").read_text().strip()) == host.credential_hash


def test_an_explicit_credential_file_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("AGENT_CREDENTIAL_FILE", str(tmp_path / "default.credential"))
    chosen = tmp_path / "chosen.credential"
    call_command("fleet_local_host", "--name", "local", "--credential-file", str(chosen))
    assert chosen.is_file() and not (tmp_path / "default.credential").exists()


def test_the_local_host_joins_a_shared_pool_so_a_deploy_by_replicas_is_placed_on_it(
    monkeypatch, tmp_path, team, owner, classifier
):
    """What ``make run`` does: a team's first ``tgp deploy M --version 1`` (replicas, no instance) must not
    stay PENDING for want of a pool."""
    monkeypatch.setenv("AGENT_CREDENTIAL_FILE", str(tmp_path / "agent.credential"))
    call_command(
        "fleet_local_host", "--name", "local", "--pool", "local", "--instance", "cpu-0:18100:18101:18102"
    )
    host = Host.objects.get(name="local")
    assert host.pool == Pool.objects.get(name="local", team=None) and host.labels["pool"] == "local"
    Host.objects.filter(pk=host.pk).update(last_heartbeat_at=timezone.now())
    TritonInstance.objects.filter(host=host).update(state="READY")
    deployment = deployments.deploy_version(
        actor=owner, model=classifier, version=make_version(classifier, 1), replicas=1
    )
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.DEPLOYING, deployment.pending_reason
    assert [p.instance.name for p in deployment.placements.all()] == ["cpu-0"]
    call_command("fleet_local_host", "--name", "local", "--pool", "local")  # again: nothing changes
    assert Pool.objects.count() == 1 and TritonInstance.objects.filter(host=host).count() == 1
