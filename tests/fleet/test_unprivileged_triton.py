"""Triton runs unprivileged: an agent running as root starts each instance's tritonserver, and so every
python stub, as a system user of that instance, which can read its own repository and nothing of the
platform's: not the artifact store, the secret key, the database, the agent's log or another instance's
repository. Checked on real agents and servers, with the ids the stub processes really run with."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
from django.conf import settings

from apps.deployments import services
from apps.deployments.models import Deployment, DeploymentState
from apps.fleet.models import InstanceState, TritonInstance
from backend_ge import sandbox
from tests.conftest import wait_for

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="switching to the instance users needs root (the agent only does it as root)"
)


class Ids:
    """The real uid, gid and supplementary groups of a process, from /proc/<pid>/status."""

    def __init__(self, pid: int):
        fields = dict(
            line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
        )
        self.uid = int(fields["Uid"].split()[0])
        self.euid = int(fields["Uid"].split()[1])
        self.gid = int(fields["Gid"].split()[0])
        self.groups = [int(g) for g in fields["Groups"].split()]

    def run(self, *cmd: str) -> subprocess.CompletedProcess:
        """Run ``cmd`` exactly as this process's user (no supplementary group of ours)."""
        return subprocess.run(
            cmd, user=self.uid, group=self.gid, extra_groups=self.groups, capture_output=True, text=True, errors="replace",
            cwd="/", timeout=30,
        )  # fmt: skip

    def can_read(self, path: Path) -> bool:
        result = self.run("/bin/ls", str(path)) if path.is_dir() else self.run("/bin/cat", str(path))
        if result.returncode != 0:
            assert "Permission denied" in result.stderr, result.stderr  # refused, not missing
        return result.returncode == 0


def stub_pids(server_pid: int) -> list[int]:
    """The python backend stubs in the server's process group."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (
                os.getpgid(int(entry.name)) == server_pid
                and b"triton_python_backend_stub" in (entry / "cmdline").read_bytes()
            ):
                pids.append(int(entry.name))
        except (OSError, ProcessLookupError):
            continue
    return pids


def serving(deployment: Deployment) -> Deployment:
    return wait_for(
        lambda: Deployment.objects.filter(pk=deployment.pk, state=DeploymentState.SERVING).first(),
        120,
        f"deployment {deployment.pk} to serve",
    )


def ready_instance(name: str, agent) -> TritonInstance:
    return wait_for(
        lambda: TritonInstance.objects.filter(host__name=name, state=InstanceState.READY).first(),
        120,
        f"{name}'s instance to be READY",
    )


@needs_root
@pytest.mark.triton
@pytest.mark.django_db(transaction=True)
def test_stubs_run_as_the_instance_user_and_read_only_their_own_repository(
    start_agent, make_ready_version, owner, artifact_root
):
    first, second = start_agent("iso-a"), start_agent("iso-b")
    version = make_ready_version()
    instances = [ready_instance("iso-a", first), ready_instance("iso-b", second)]
    serving(services.deploy_version(actor=owner, model=version.model, version=version, instances=instances))
    fleet = Path(artifact_root).parent / "fleet"
    name = version.model.triton_model_name()
    own_repository = fleet / "iso-a" / "cpu-0" / "repository"
    other_repository = fleet / "iso-b" / "cpu-0" / "repository"

    server_pid = TritonInstance.objects.get(pk=instances[0].pk).pid
    server = Ids(server_pid)
    assert server.uid != 0 and server.euid != 0 and server.gid != 0 and 0 not in server.groups
    assert pwd.getpwuid(server.uid).pw_name == sandbox.user_name("iso-a", "cpu-0")
    stubs = stub_pids(server_pid)
    assert stubs, "no python stub runs for the deployed model"
    for pid in stubs:
        ids = Ids(pid)
        assert (ids.uid, ids.euid, ids.gid, ids.groups) == (server.uid, server.uid, server.gid, server.groups)
    assert Ids(TritonInstance.objects.get(pk=instances[1].pk).pid).uid not in (0, server.uid)
    # The agent's secrets stay out of the stubs' environment.
    environ = dict(
        item.split("=", 1)
        for item in Path(f"/proc/{stubs[0]}/environ").read_text().split("\0")
        if "=" in item
    )
    assert environ["HOME"] == str(fleet / "iso-a" / "cpu-0" / "run")
    assert not {"DATABASE_URL", "SECRET_KEY", "AGENT_KEY", "ARTIFACT_ROOT", "FLEET_ROOT"} & set(environ)
    # The python backend's shared memory (0644 regions) lives in a /dev/shm of the server's own.
    assert sandbox.has_private_dev_shm(server_pid) and sandbox.has_private_dev_shm(stubs[0])
    regions = [p for p in Path(f"/proc/{stubs[0]}/root/dev/shm").iterdir() if p.stat().st_uid == server.uid]
    assert regions, "the stub's /dev/shm holds no region of its server"
    assert not any((Path("/dev/shm") / region.name).exists() for region in regions)

    # What it needs: its repository (the model's file too), its run directory.
    assert server.can_read(own_repository / name / str(version.number) / "model.onnx")
    assert server.run("/usr/bin/touch", str(fleet / "iso-a" / "cpu-0" / "run" / "probe")).returncode == 0
    # What it must not read - and each private by its own mode, not only because a directory above it
    # happens to be closed on this machine.
    private = [
        Path(artifact_root),
        fleet / "cache",
        fleet / "iso-a" / "cpu-0" / "tritonserver.log",
        settings.VAR_DIR / "secret_key",
        settings.VAR_DIR / "celery",
    ]
    database = settings.DATABASES["default"]
    if database["ENGINE"].endswith("sqlite3"):
        private += [Path(f"{database['NAME']}{suffix}") for suffix in ("", "-wal", "-shm")]
    private = [path for path in private if path.exists()]
    assert Path(artifact_root) in private and settings.VAR_DIR / "celery" in private
    for path in private:
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, f"{path} is {oct(path.stat().st_mode)}"
    forbidden = [
        *private,
        version.servable_dir() / "1" / "model.onnx",
        other_repository,
        other_repository / name / str(version.number) / "model.onnx",
    ]
    for path in forbidden:
        assert path.exists(), path
        assert not server.can_read(path), f"{path} is readable by the instance's user"
    # Nothing can be written into its own repository (the agent's) or the runtime tree.
    assert server.run("/usr/bin/touch", str(own_repository / "planted")).returncode != 0
    assert server.run("/usr/bin/touch", str(fleet / "iso-a" / "runtime" / "planted")).returncode != 0


@pytest.fixture
def probe_user():
    if os.geteuid() != 0:
        pytest.skip("creating and switching to an instance user needs root")
    return sandbox.ensure_user("sandbox-test", "probe")


@pytest.fixture
def private_dir():
    path = Path(tempfile.mkdtemp(prefix="ge-sandbox-test-"))  # 0700, root's
    yield path
    shutil.rmtree(path, ignore_errors=True)


def as_user(user: sandbox.ServerUser, *cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, cwd="/", timeout=30, **user.popen_kwargs())


def test_a_traverse_grant_lets_the_shared_group_pass_but_not_list(probe_user, private_dir):
    inner = private_dir / "inner"
    inner.mkdir(mode=0o755)
    (inner / "file").write_text("x")
    assert as_user(probe_user, "/bin/cat", str(inner / "file")).returncode != 0
    assert sandbox.ensure_traversable(inner, probe_user.groups[0]) == [private_dir]
    assert as_user(probe_user, "/bin/cat", str(inner / "file")).stdout == "x"
    refused = as_user(probe_user, "/bin/ls", str(private_dir))
    assert refused.returncode != 0 and "Permission denied" in refused.stderr
    assert stat.S_IMODE(private_dir.stat().st_mode) == 0o710  # the ACL's mask: --x for the group class
    assert sandbox.ensure_traversable(inner, probe_user.groups[0]) == []  # idempotent


def test_the_access_check_names_what_the_user_cannot_reach_and_what_it_must_not_read(
    probe_user, private_dir, tmp_path
):
    from backend_ge.runtime import assemble_runtime, server_environment

    sandbox.ensure_traversable(private_dir, probe_user.groups[0])
    runtime = assemble_runtime(private_dir / "runtime")
    repository, run_dir = private_dir / "repository", private_dir / "run"
    repository.mkdir(mode=0o700)  # root's alone: the user cannot list it
    run_dir.mkdir()
    os.chown(run_dir, probe_user.uid, probe_user.gid)
    leaked = private_dir / "leaked-secret"
    leaked.write_text("s")
    leaked.chmod(0o644)
    kwargs = dict(
        python=runtime.python_bin / "python3",
        repository=repository,
        run_dir=run_dir,
        binary=runtime.binary,
        backends=runtime.backends,
        env=server_environment(runtime, home=run_dir, include_checkout=False),
    )
    with pytest.raises(sandbox.SandboxError) as failed:
        sandbox.check_access(probe_user, private=[leaked], **kwargs)
    message = str(failed.value)
    assert f"user {probe_user.name}" in message
    assert f"cannot list the repository {repository}" in message
    assert f"can read {leaked} although it must not" in message

    sandbox.prepare_instance_dirs(private_dir, repository, probe_user)
    leaked.chmod(0o600)
    sandbox.check_access(probe_user, private=[leaked], **kwargs)  # imports numpy, onnxruntime, backend_ge


def test_an_account_the_platform_did_not_create_is_not_used(probe_user):
    name = sandbox.user_name("sandbox-test", "foreign")
    if not _exists(name):
        subprocess.run(["useradd", "--system", "--no-create-home", "--comment", "someone", name], check=True)
    try:
        with pytest.raises(sandbox.SandboxError, match="was not created by the serving platform"):
            sandbox.ensure_user("sandbox-test", "foreign")
    finally:
        subprocess.run(["userdel", name], check=False)


def _exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def test_user_names_come_from_the_platforms_names_and_fit_useradd():
    assert sandbox.user_name("local", "cpu-0") == "tge-local-cpu-0"
    long = sandbox.user_name("a" * 40, "cpu-0")
    assert long.startswith("tge-") and len(long) <= 32
    assert long != sandbox.user_name("a" * 41, "cpu-0")
    assert sandbox.user_name("x", "../../etc") != "tge-x-../../etc"


@needs_root
@pytest.mark.servers
@pytest.mark.django_db(transaction=True)
def test_the_agent_refuses_to_start_when_an_instance_user_could_read_a_secret(start_agent, artifact_root):
    gateway = artifact_root.parent / "gateway"
    gateway.mkdir(mode=0o755)
    (gateway / "instances.map").write_text("key\n")
    (gateway / "instances.map").chmod(0o644)  # e.g. written by hand, with the umask's mode
    # What this host's configuration names private (as `make run` names the platform's gateway files).
    agent = start_agent("leaky", AGENT_PRIVATE_PATHS=gateway / "instances.map")
    assert agent.process.wait(120) != 0
    output = agent.output()
    assert "host agent for leaky cannot run its Triton instances" in output
    assert f"user {sandbox.user_name('leaky', 'cpu-0')}" in output
    assert f"can read {gateway / 'instances.map'} although it must not" in output
    assert not TritonInstance.objects.filter(host__name="leaky", state=InstanceState.READY).exists()
