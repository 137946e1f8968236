"""The conversion runner in-process: the ATC path against a fake atc replaying recorded output (exact command,
live log, readable errors, timeout), the ONNX path, .om and Triton directory uploads, claims and lost workers."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from apps.audit.models import AuditEvent
from apps.conversions import runner, services
from apps.conversions.models import ConversionJob, JobState
from apps.registry.models import SourceFormat, VersionState
from backend_ge import config as gc
from tests.conftest import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def start(version, owner, options=None) -> ConversionJob:
    # on_commit enqueueing is not wanted here: the test runs the job itself.
    from unittest import mock

    with mock.patch("apps.conversions.services.enqueue_conversion") as enqueue:
        job = services.start_conversion(actor=owner, version=version, options=options)
    enqueue.assert_called_once_with(job.pk)
    return job


def test_start_conversion_queues_a_job_and_marks_the_version(make_version, mlp_bytes, owner, team):
    version = make_version({"model.onnx": mlp_bytes})
    job = start(version, owner)
    version.refresh_from_db()
    assert job.state == JobState.QUEUED and version.state == VersionState.CONVERTING
    assert job.options == {
        "soc_version": team.default_soc_version,
        "precision_mode": "",
        "input_format": "",
        "input_shape": "",
        "batch_gears": "",
    }
    assert AuditEvent.objects.filter(action="conversion.started", target_id=str(job.pk)).exists()
    with pytest.raises(ValidationError, match="UPLOADED"):
        services.start_conversion(actor=owner, version=version)


def test_invalid_options_are_refused_with_the_field(make_version, mlp_bytes, owner):
    version = make_version({"model.onnx": mlp_bytes})
    with pytest.raises(ValidationError) as info:
        services.start_conversion(
            actor=owner, version=version, options={"precision_mode": "fast", "soc_version": "x"}
        )
    assert set(info.value.message_dict) == {"precision_mode", "soc_version"}
    assert not ConversionJob.objects.exists()


def test_onnx_path_without_atc_makes_the_version_ready(make_version, mlp_bytes, owner, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    version = make_version({"model.onnx": mlp_bytes})
    job = start(version, owner)
    assert runner.execute_job(job.pk, worker="test") == "succeeded"
    job.refresh_from_db()
    version.refresh_from_db()
    assert (
        job.state == JobState.SUCCEEDED
        and job.progress == 100
        and job.attempts == 1
        and job.toolchain == "onnx"
    )
    assert version.state == VersionState.READY and version.toolchain == "onnx"
    assert version.signature["inputs"][0] == {"name": "input", "dtype": "FP32", "dims": [16], "format": ""}
    assert version.signature["batched"] is True
    servable = version.servable_dir()
    assert sorted(p.relative_to(servable).as_posix() for p in servable.rglob("*")) == [
        "1",
        "1/model.onnx",
        "config.pbtxt",
    ]
    cfg = gc.load_config(
        (servable / "config.pbtxt").read_text(), expected_name=version.model.triton_model_name()
    )
    assert (servable / "config.pbtxt").read_text() == version.config_text
    assert cfg.max_batch_size == 8 and list(cfg.dynamic_batching.preferred_batch_size) == [4, 8]
    assert gc.validate_config(cfg, signature=gc.ModelSignature.from_dict(version.signature)) == []
    assert "onnxruntime" in job.log and "READY" in job.log
    # Nothing left behind next to the servable dir.
    assert [p.name for p in version.storage_dir().iterdir() if p.name.startswith(".")] == []


def test_invalid_onnx_fails_with_the_checker_reason(make_version, owner, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    version = make_version({"model.onnx": b"not a protobuf"})
    job = start(version, owner)
    assert runner.execute_job(job.pk) == "failed"
    version.refresh_from_db()
    assert version.state == VersionState.FAILED and "is not a valid ONNX model" in version.error
    assert not version.servable_dir().exists()


def test_tensorflow_without_atc_needs_an_atc_host(make_version, owner, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    version = make_version({"frozen.pb": b"graph"}, SourceFormat.TENSORFLOW)
    job = start(version, owner)
    runner.execute_job(job.pk)
    version.refresh_from_db()
    assert version.state == VersionState.FAILED
    assert "needs an ATC host (atc not found on this worker)" in version.error


def test_torchscript_without_torch_says_what_is_needed(make_version, owner, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setattr("apps.conversions.toolchains.torch_available", lambda: False)
    version = make_version({"model.pt": b"PK\x03\x04"}, SourceFormat.TORCHSCRIPT)
    runner.execute_job(start(version, owner).pk)
    version.refresh_from_db()
    assert version.state == VersionState.FAILED and "needs torch or an ATC host" in version.error


def test_om_upload_needs_no_conversion_and_takes_the_uploaded_config(make_version, owner, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    config = (
        'name: "whatever"\nplatform: "graph_executor"\nmax_batch_size: 4\n'
        'input [{ name: "x" data_type: TYPE_FP32 dims: [3, 8, 8] }]\n'
        'output [{ name: "y" data_type: TYPE_FP32 dims: [10] }]\n'
    )
    version = make_version({"model.om": b"om bytes", "config.pbtxt": config.encode()}, SourceFormat.OM)
    assert runner.execute_job(start(version, owner).pk) == "succeeded"
    version.refresh_from_db()
    assert version.toolchain == "none" and version.state == VersionState.READY
    assert version.signature["inputs"][0]["dims"] == [3, 8, 8] and version.signature["batched"] is True
    cfg = gc.load_config(version.config_text, expected_name=version.model.triton_model_name())
    assert cfg.backend == "ge" and (version.servable_dir() / "1" / "model.om").read_bytes() == b"om bytes"


def test_triton_directory_is_normalized_and_checked_against_the_model(
    make_version, mlp_bytes, owner, monkeypatch
):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    config = (
        'name: "mlp"\nplatform: "graph_executor"\nmax_batch_size: 2\n'
        'input [{ name: "input" data_type: TYPE_FP32 dims: [16] }]\n'
        'output [{ name: "output" data_type: TYPE_FP32 dims: [4] }]\n'
    )
    version = make_version(
        {"mlp/config.pbtxt": config.encode(), "mlp/1/model.onnx": mlp_bytes}, SourceFormat.TRITON_REPOSITORY
    )
    assert runner.execute_job(start(version, owner).pk) == "succeeded"
    version.refresh_from_db()
    cfg = gc.load_config(version.config_text, expected_name=version.model.triton_model_name())
    assert cfg.max_batch_size == 2 and cfg.backend == "ge"
    assert (version.servable_dir() / "1" / "model.onnx").is_file()


def test_atc_path_runs_the_exact_command_and_streams_the_log(make_version, mlp_bytes, owner, fake_atc, team):
    argv_file = fake_atc("success_yolox", FAKE_ATC_LINE_DELAY=0.3)
    version = make_version({"model.onnx": mlp_bytes})
    job = start(version, owner, {"precision_mode": "force_fp16", "input_format": "ND"})
    sizes = []

    def watch():
        # The log must grow while atc still runs, not appear at the end.
        for _ in range(200):
            row = ConversionJob.objects.get(pk=job.pk)
            sizes.append((len(row.log), row.state, row.progress))
            if row.state != JobState.RUNNING and row.state != JobState.QUEUED:
                return
            threading.Event().wait(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    outcome = runner.execute_job(job.pk, worker="npu-host-1")
    watcher.join(30)
    assert outcome == "succeeded"
    job.refresh_from_db()
    version.refresh_from_db()
    workdir = version.storage_dir() / f".model.tmp-{job.pk}-1"
    expected = [
        fake_atc.path,
        f"--model={version.source_dir() / 'model.onnx'}",
        "--framework=5",
        f"--output={workdir / '1' / 'model'}",
        f"--soc_version={team.default_soc_version}",
        "--input_shape=input:-1,16",
        "--dynamic_batch_size=1,2,4,8",
        "--input_format=ND",
        "--precision_mode=force_fp16",
        "--log=error",
    ]
    assert job.command == expected
    import json

    assert json.loads(argv_file.read_text()) == expected[1:]
    running = [size for size, state, _ in sizes if state == JobState.RUNNING]
    assert len(set(running)) >= 3, f"log did not grow during the run: {sizes}"
    assert "ATC run success, welcome to the next use." in job.log
    assert max(p for _, state, p in sizes if state == JobState.RUNNING) > 20
    assert job.toolchain == "atc" and job.exit_code == 0 and version.toolchain == "atc"
    assert (version.servable_dir() / "1" / "model.om").is_file()
    cfg = gc.load_config(version.config_text, expected_name=version.model.triton_model_name())
    assert cfg.parameters["EXECUTOR"].string_value == "acl" and cfg.max_batch_size == 8


@pytest.mark.parametrize(
    "fixture,code,words",
    [
        ("fail_e10001", "E10001", "check --input_shape names"),
        ("fail_e19010", "E19010", "No parser is registered for Op [MMCVModulatedDeformConv2d_12097"),
    ],
)
def test_atc_failures_become_readable_errors(make_version, mlp_bytes, owner, fake_atc, fixture, code, words):
    fake_atc(fixture)
    version = make_version({"model.onnx": mlp_bytes})
    job = start(version, owner)
    assert runner.execute_job(job.pk) == "failed"
    job.refresh_from_db()
    version.refresh_from_db()
    assert job.state == JobState.FAILED and job.exit_code == 1
    assert job.error.startswith(f"ATC failed with {code}: ") and words in job.error
    assert version.state == VersionState.FAILED and version.error == job.error
    assert "ATC run failed" in job.log and not version.servable_dir().exists()


def test_atc_timeout_stops_atc_and_fails_the_job(make_version, mlp_bytes, owner, fake_atc, settings):
    settings.CONVERSION_TIME_LIMIT = 2  # atc gets 90 % of it
    fake_atc("success_yolox", FAKE_ATC_SLEEP=30)
    version = make_version({"model.onnx": mlp_bytes})
    job = start(version, owner)
    began = timezone.now()
    assert runner.execute_job(job.pk) == "failed"
    assert (timezone.now() - began).total_seconds() < 15
    version.refresh_from_db()
    assert "ATC timed out after 1.8 s and was stopped" in version.error


def test_rerun_of_a_failed_version_is_a_new_job_and_gives_the_same_result(
    make_version, mlp_bytes, owner, fake_atc
):
    fake_atc("fail_e19010")
    version = make_version({"model.onnx": mlp_bytes})
    first = start(version, owner, {"precision_mode": "force_fp16"})
    runner.execute_job(first.pk)
    fake_atc("success_yolox")
    from unittest import mock

    with mock.patch("apps.conversions.services.enqueue_conversion"):
        second = services.rerun_conversion(actor=owner, version=version)
    assert second.pk != first.pk and second.options == first.options
    assert runner.execute_job(second.pk) == "succeeded"
    layout = sorted(p.relative_to(version.servable_dir()) for p in version.servable_dir().rglob("*"))
    # Running the finished job again changes nothing and adds nothing.
    assert runner.execute_job(second.pk) == "finished"
    assert sorted(p.relative_to(version.servable_dir()) for p in version.servable_dir().rglob("*")) == layout
    assert ConversionJob.objects.filter(version=version).count() == 2


def test_two_concurrent_claims_only_one_wins(make_version, mlp_bytes, owner):
    job = start(make_version({"model.onnx": mlp_bytes}), owner)
    stale_copy = ConversionJob.objects.get(pk=job.pk)
    barrier = threading.Barrier(2)
    results = []

    def claim(copy, name):
        barrier.wait()
        results.append(runner.claim_job(copy, name))
        from django.db import connection

        connection.close()

    threads = [
        threading.Thread(target=claim, args=(ConversionJob.objects.get(pk=job.pk), f"w{i}")) for i in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(results) == [False, True]
    job.refresh_from_db()
    assert job.attempts == 1 and job.state == JobState.RUNNING
    # A copy read before the claim cannot claim again (the attempts value is part of the condition).
    assert runner.claim_job(stale_copy, "late") is False


def test_running_job_with_a_fresh_heartbeat_is_not_taken_over(make_version, mlp_bytes, owner):
    job = start(make_version({"model.onnx": mlp_bytes}), owner)
    assert runner.claim_job(job, "alive")
    assert runner.execute_job(job.pk, worker="other") == "busy"
    ConversionJob.objects.filter(pk=job.pk).update(heartbeat_at=timezone.now() - timedelta(hours=1))
    job.refresh_from_db()
    assert runner.claim_job(job, "other") is True
    job.refresh_from_db()
    assert job.attempts == 2 and job.worker == "other"


def test_lost_worker_on_the_last_attempt_fails_with_the_reason(make_version, mlp_bytes, owner):
    version = make_version({"model.onnx": mlp_bytes})
    job = start(version, owner)
    ConversionJob.objects.filter(pk=job.pk).update(
        state=JobState.RUNNING, attempts=3, worker="w@dead", heartbeat_at=timezone.now() - timedelta(hours=1)
    )
    assert runner.recover_stale_jobs() == []
    job.refresh_from_db()
    version.refresh_from_db()
    assert job.state == JobState.FAILED and "lost 3 times" in job.error and "w@dead" in job.error
    assert version.state == VersionState.FAILED and version.error == job.error


def test_stale_jobs_are_listed_for_requeue(make_version, mlp_bytes, owner):
    job = start(make_version({"model.onnx": mlp_bytes}), owner)
    runner.claim_job(job, "w")
    assert runner.recover_stale_jobs() == []
    ConversionJob.objects.filter(pk=job.pk).update(heartbeat_at=timezone.now() - timedelta(hours=1))
    assert runner.recover_stale_jobs() == [job.pk]


def test_deleted_job_exits_cleanly():
    assert runner.execute_job(999_999) == "gone"


def test_update_config_validates_against_the_signature_and_writes_the_file(
    make_version, mlp_bytes, owner, monkeypatch
):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    version = make_version({"model.onnx": mlp_bytes})
    runner.execute_job(start(version, owner).pk)
    version.refresh_from_db()
    bad = version.config_text.replace("dims: 16", "dims: 17")
    with pytest.raises(ValidationError) as info:
        services.update_config(actor=owner, version=version, text=bad)
    assert "input[0].dims" in info.value.message_dict
    too_small = version.config_text.replace("max_batch_size: 8", "max_batch_size: 4")
    with pytest.raises(ValidationError) as info:
        services.update_config(actor=owner, version=version, text=too_small)
    assert "dynamic_batching.preferred_batch_size[1]" in info.value.message_dict
    good = version.config_text.replace(
        "max_queue_delay_microseconds: 100", "max_queue_delay_microseconds: 500"
    )
    services.update_config(actor=owner, version=version, text=good)
    version.refresh_from_db()
    assert "max_queue_delay_microseconds: 500" in version.config_text
    assert (version.servable_dir() / "config.pbtxt").read_text() == version.config_text
    assert AuditEvent.objects.filter(action="version.config_updated").count() == 1


def test_wait_for_is_bounded():
    with pytest.raises(AssertionError, match="timed out"):
        wait_for(lambda: False, 0.2)
