"""The tgp command line end to end against a live platform (pytest-django's live server, real tokens): what
a CI pipeline runs, with the exit codes it tests - 0 done, 1 failed with the platform's message, 2 usage,
3 timed out waiting."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from django.db import connection

from apps.conversions.models import ConversionJob
from apps.conversions.runner import execute_job
from apps.deployments.models import Deployment, PlacementState
from apps.fleet.models import Host
from apps.registry.models import RegisteredModel, UploadSession, VersionState
from backend_ge.runtime import free_port
from tests.deployments.helpers import finish
from tests.support.models import add_instance, classifier_onnx
from tgp.client import Client, UploadJournal

ROOT = Path(__file__).resolve().parents[2]


def test_login_stores_the_token_privately_and_commands_speak_json_and_exit_codes(
    tgp, tgp_home, live_server, make_token, signed_in, tmp_path
):
    config = tgp_home / "config.json"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert stat.S_IMODE(tgp_home.stat().st_mode) == 0o700
    stored = json.loads(config.read_text())
    assert stored == {"url": live_server.url, "token": signed_in, "team": "vision"}

    created = tgp("models", "create", "Classifier", "--task-type", "classification", "-o", "json")
    assert created.code == 0, created.err
    assert created.json()["slug"] == "classifier"
    assert created.json()["triton_name"]
    listed = tgp("models", "list", "-o", "json")
    assert [m["slug"] for m in listed.json()] == ["classifier"]
    assert "classifier" in tgp("models", "list").out  # the text table

    # Failure: the platform's own message on stderr, exit 1.
    again = tgp("models", "create", "Classifier", "-o", "json")
    assert again.code == 1
    assert "already has a model with the slug" in again.err and again.out == ""
    # Usage: exit 2, before anything is sent.
    assert tgp("upload", str(tmp_path / "missing.onnx"), "--model", "classifier").code == 2
    assert tgp("deploy", "classifier").code == 2
    assert tgp("models", "list", "-o", "yaml").code == 2

    # The environment wins over the stored file: a revoked or wrong token is the platform's 401 message.
    os.environ["TGP_TOKEN"] = "tgp_nope_nope"
    try:
        wrong = tgp("versions", "classifier")
    finally:
        del os.environ["TGP_TOKEN"]
    assert wrong.code == 1 and "Invalid API token." in wrong.err

    # As a pipeline runs it: `python -m tgp` with TGP_URL and TGP_TOKEN only, no config file.
    env = {
        **os.environ,
        "TGP_URL": live_server.url,
        "TGP_TOKEN": signed_in,
        "XDG_CONFIG_HOME": str(tmp_path / "empty"),
    }
    process = subprocess.run(
        [sys.executable, "-m", "tgp", "models", "list", "-o", "json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert process.returncode == 0, process.stderr
    assert json.loads(process.stdout)[0]["slug"] == "classifier"
    process = subprocess.run(
        [sys.executable, "-m", "tgp", "rollout", "start", "classifier"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert process.returncode == 2 and "--version" in process.stderr


def _convert_when_queued(model_slug: str, errors: list) -> threading.Thread:
    """The Celery worker's part, in a thread: run the conversion job of the model's upload once it is queued
    (bounded), through the real ONNX path."""

    def work():
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                job = ConversionJob.objects.filter(version__model__slug=model_slug).first()
                if job is not None:
                    execute_job(job.pk, worker="test")
                    return
                time.sleep(0.05)
            errors.append("no conversion job was queued within 60s")
        except Exception as exc:  # reported by the test, not lost in the thread
            errors.append(repr(exc))
        finally:
            connection.close()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


def test_upload_resumes_after_an_interruption_and_waits_for_the_conversion(
    tgp, tgp_home, live_server, signed_in, artifact_root, owner, team, tmp_path
):
    RegisteredModel.objects.create(team=team, name="Classifier", slug="classifier", created_by=owner)
    source = tmp_path / "classifier.onnx"
    source.write_bytes(classifier_onnx(1.0))
    size = source.stat().st_size
    chunk = 2048
    assert size > 3 * chunk

    # A first attempt dies after two chunks (the library as a pipeline imports it; the exception stands
    # for the killed process). The journal remembers the open upload.
    class Killed(Exception):
        pass

    chunks = []

    def die_after_two(done, total):
        chunks.append(done)
        if len(chunks) == 3:  # the first call reports offset 0
            raise Killed

    with pytest.raises(Killed), Client(live_server.url, signed_in) as client:
        client.upload(source, "classifier", chunk_size=chunk, progress=die_after_two)
    session = UploadSession.objects.get()
    assert session.received_bytes == 2 * chunk
    assert len(UploadJournal().path.read_text()) > 0
    assert stat.S_IMODE(UploadJournal().path.stat().st_mode) == 0o600

    # The same command again resumes that upload (one version, not two) and waits for the conversion.
    errors: list = []
    worker = _convert_when_queued("classifier", errors)
    result = tgp("upload", str(source), "--model", "classifier", "--chunk-size", str(chunk), "--wait",
                 "--timeout", "60", "-o", "json")  # fmt: skip
    worker.join(timeout=60)
    assert not errors, errors
    assert result.code == 0, result.err
    assert f"Resuming an earlier upload of classifier.onnx at byte {2 * chunk}" in result.err
    # Not a terminal: plain progress lines, never a bar.
    assert f"uploaded {size} of {size} bytes (100%)" in result.err
    version = result.json()
    assert version["state"] == VersionState.READY and version["number"] == 1
    assert version["sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    assert json.loads(UploadJournal().path.read_text()) == {}  # the finished upload is forgotten

    listed = tgp("versions", "classifier", "-o", "json")
    assert [(v["number"], v["state"]) for v in listed.json()] == [(1, "READY")]
    assert "READY" in tgp("versions", "classifier").out

    # Another upload with nobody converting it: --wait gives up after its timeout with exit 3.
    second = tmp_path / "classifier-2.onnx"
    second.write_bytes(classifier_onnx(2.0))
    timed_out = tgp("upload", str(second), "--model", "classifier", "--wait", "--timeout", "0.5")
    assert timed_out.code == 3, timed_out.err
    assert "Version 2 of classifier is still" in timed_out.err


class DroppingTransport(httpx.HTTPTransport):
    """Loses the connection on chosen PATCH requests: after the server took the chunk (the reply is lost)
    or before it was sent."""

    def __init__(self, after: set[int], before: set[int]):
        super().__init__()
        self.after, self.before, self.patches = after, before, 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "PATCH":
            self.patches += 1
            if self.patches in self.before:
                raise httpx.ConnectError("connection refused (test)", request=request)
            response = super().handle_request(request)
            if self.patches in self.after:
                response.close()
                raise httpx.ReadError("connection reset (test)", request=request)
            return response
        return super().handle_request(request)


def test_upload_continues_from_the_server_offset_after_dropped_connections(
    live_server, tgp_home, make_token, artifact_root, owner, team, tmp_path
):
    RegisteredModel.objects.create(team=team, name="Classifier", slug="classifier", created_by=owner)
    source = tmp_path / "classifier.onnx"
    source.write_bytes(classifier_onnx(1.0))
    _, secret = make_token(name="ci")
    transport = DroppingTransport(after={2}, before={4})
    with Client(live_server.url, secret, "vision", transport=transport) as client:
        version = client.upload(source, "classifier", chunk_size=2048)
    assert version["number"] == 1 and version["state"] in ("UPLOADED", "CONVERTING")
    assert version["sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    assert UploadSession.objects.get().received_bytes == source.stat().st_size
    # Six chunks, one resent after the refused connection; the chunk whose reply was lost is not resent.
    assert transport.patches == 7


def test_deploy_status_rollout_and_infer_report_the_platform_answers(
    tgp, signed_in, live_server, make_ready_version, settings
):
    ready = make_ready_version()  # model "classifier", version 1, READY through the real ONNX path
    instance = add_instance(Host.objects.create(name="local", address="127.0.0.1"))
    # Nothing listens on the gateway's address: infer must say where it could not connect.
    settings.GATEWAY_PUBLIC_URL = f"http://127.0.0.1:{free_port()}"

    # A replica count the platform refuses: its 400 speaks, naming the field.
    refused = tgp("deploy", "classifier", "--version", "1", "--replicas", "10000")
    assert refused.code == 1 and "replicas" in refused.err, refused.err
    assert not Deployment.objects.exists()

    # Deploy on an instance and wait: no agent serves this host, so the wait times out (exit 3).
    waited = tgp("deploy", "classifier", "--version", str(ready.number), "--instance", str(instance.pk),
                 "--wait", "--timeout", "1")  # fmt: skip
    assert waited.code == 3, waited.err
    assert "Deployment of classifier is still" in waited.err
    deployment = Deployment.objects.get()
    assert deployment.active_version_id == ready.pk or deployment.target_version_id == ready.pk

    status = tgp("status", "-o", "json")
    assert status.code == 0, status.err
    [live] = status.json()
    assert live["model"] == "classifier" and live["placements"][0]["instance"] == instance.pk
    assert live["endpoints"]["infer_url"].endswith("/infer")
    assert "classifier:" in tgp("status").out

    # A deployed model: deploy without instances switches, and the platform refuses an unknown version.
    missing = tgp("deploy", "classifier", "--version", "9")
    assert missing.code == 1 and "has no version 9" in missing.err

    # Rollouts: none yet; starting one to a missing version is the platform's message.
    assert "has no rollout" in tgp("rollout", "status", "classifier").err
    bad = tgp("rollout", "start", "classifier", "--version", "9", "-o", "json")
    assert bad.code == 1 and "has no version 9" in bad.err and bad.out == ""
    assert tgp("rollout", "start", "classifier", "--version", "1", "--steps", "x").code == 2

    # The agent's report, by hand as the deployment tests do: the placement is READY, the deployment SERVING.
    finish(deployment, instance, state=PlacementState.READY, served_version=ready)
    served = tgp("deploy", "classifier", "--version", "1", "--wait", "--timeout", "5", "-o", "json")
    assert served.code == 1 and served.out == "" and "already the served version" in served.err
    assert tgp("status", "-o", "json").json()[0]["state"] == "SERVING"

    # A rollout of version 2: started, shown, aborted; watching an aborted rollout is a failure (exit 1).
    make_ready_version(model=ready.model, scale=2.0)
    started = tgp("rollout", "start", "classifier", "--version", "2", "--steps", "10,50,100", "-o", "json")
    assert started.code == 0, started.err
    assert (started.json()["state"], started.json()["steps"]) == ("RUNNING", [10, 50, 100])
    shown = tgp("rollout", "status", "classifier", "-o", "json")
    assert shown.json()["id"] == started.json()["id"] and shown.json()["canary_version"] == 2
    aborted = tgp("rollout", "abort", "classifier", "-o", "json")
    assert aborted.code == 0 and aborted.json()["state"] == "ABORTED", aborted.err
    watched = tgp("rollout", "status", "classifier", "--watch", "--timeout", "5")
    assert watched.code == 1 and "aborted" in watched.err
    again = tgp("rollout", "promote", "classifier")
    assert again.code == 1 and again.err.startswith("Error (400)")

    body = Path(settings.ARTIFACT_ROOT).parent / "body.json"
    body.write_text(json.dumps({"inputs": []}))
    unreachable = tgp("infer", "classifier", "--json", str(body))
    assert unreachable.code == 1 and settings.GATEWAY_PUBLIC_URL in unreachable.err
    assert tgp("infer", "nothing", "--json", str(body)).code == 1


def test_models_objective_sets_and_clears_the_latency_objective_and_a_bad_one_exits_1(
    tgp, signed_in, owner, team
):
    from apps.registry import services

    services.create_model(actor=owner, team=team, name="Classifier", slug="classifier")
    result = tgp("models", "objective", "classifier", "--p99-ms", "15", "--rate", "250")
    assert result.code == 0, result.err
    assert result.out.strip() == "classifier: p99 <= 15 ms at 250 requests/s."
    model = RegisteredModel.objects.get(slug="classifier")
    assert (model.objective_p99_ms, model.objective_rate_rps) == (15.0, 250.0)
    result = tgp("models", "objective", "classifier", "--p99-ms", "0", "-o", "json")
    assert result.code == 1 and "objective_p99_ms" in result.err and "from 1 to 60000" in result.err
    assert RegisteredModel.objects.get(slug="classifier").objective_p99_ms == 15.0
    result = tgp("models", "objective", "classifier", "--clear", "-o", "json")
    assert result.code == 0 and result.json()["objective_p99_ms"] is None
    assert tgp("models", "objective", "classifier").code == 2  # neither a bound nor --clear
    assert tgp("models", "objective", "classifier", "--clear", "--rate", "5").code == 2


def test_derive_creates_a_version_with_other_serving_settings_and_keeps_the_rest(
    tgp, signed_in, make_ready_version
):
    ready = make_ready_version()
    result = tgp("derive", "classifier", "--version", "1", "--max-queue-delay-us", "500", "--preferred", "8")
    assert result.code == 0, result.err
    assert result.out.strip() == "classifier v2 READY (from v1)"
    derived = ready.model.versions.get(number=2)
    assert "max_queue_delay_microseconds: 500" in derived.config_text
    assert (
        "preferred_batch_size: 8" in derived.config_text
        and "preferred_batch_size: 4" not in derived.config_text
    )
    result = tgp("derive", "classifier", "--version", "2", "--instances", "99", "-o", "json")
    assert result.code == 1 and "instance_count" in result.err  # the platform's bound, its 400 printed
    result = tgp("derive", "classifier", "--version", "2", "--preferred", "64")
    assert result.code == 1 and "preferred_batch_size" in result.err
    assert ready.model.versions.count() == 2
    assert tgp("derive", "classifier", "--version", "1", "--preferred", "a,b").code == 2


def test_tune_starts_lists_and_cancels_a_tuning_and_bad_input_exits_1_or_2(
    tgp, signed_in, make_ready_version
):
    from apps.deployments.models import TuningJob, TuningState
    from apps.fleet.models import Pool

    ready = make_ready_version()
    assert tgp("tune", "classifier", "-v", "1", "--create-version").code == 2  # needs --wait
    result = tgp("tune", "classifier", "-v", "1")
    assert result.code == 1 and "objective_p99_ms" in result.err  # no objective yet: the platform's 400
    assert tgp("models", "objective", "classifier", "--p99-ms", "30").code == 0
    result = tgp("tune", "classifier", "-v", "1", "--budget-s", "5")
    assert result.code == 1 and "budget_s" in result.err and not TuningJob.objects.exists()
    Pool.objects.create(name="cpu")  # no host in it: the job waits with the reason
    result = tgp("tune", "classifier", "-v", "1", "--pool", "cpu", "--budget-s", "60", "-o", "json")
    assert result.code == 0, result.err
    job = result.json()
    assert job["state"] == "QUEUED" and "pool cpu has no schedulable instance" in job["reason"]
    listed = tgp("tunings", "--model", "classifier")
    assert listed.code == 0 and f"{job['id']}" in listed.out and "QUEUED" in listed.out
    assert tgp("tune", "classifier", "-v", "1").code == 1  # one tuning per version at a time
    waited = tgp("tunings", "--cancel", str(job["id"]))
    assert waited.code == 0 and "CANCELLED" in waited.out
    assert TuningJob.objects.get().state == TuningState.CANCELLED
    assert ready.model.versions.count() == 1
