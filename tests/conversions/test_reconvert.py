"""Batch gears as a conversion option (ATC's --dynamic_batch_size), and the re-conversion a tuning of an NPU
version offers: the next version compiled from the same source with the gears that serve the measured
batches (the fake atc records the exact command)."""

from __future__ import annotations

import json
from unittest import mock

import pytest
from django.core.exceptions import ValidationError

from apps.conversions import runner, services
from apps.conversions.models import ConversionJob, JobState
from apps.conversions.toolchains import atc_input_shapes
from apps.deployments.models import TuningJob, TuningState
from apps.registry.models import VersionState
from apps.registry.options import check_conversion_options
from backend_ge import config as gc
from backend_ge.convert import ConversionError
from tests.conversions.test_runner import start

pytestmark = pytest.mark.django_db(transaction=True)  # the conversions enqueue on commit
SIGNATURE = gc.ModelSignature((gc.TensorSignature("input", "FP32", (16,)),), (), True)


@pytest.mark.parametrize(
    "raw", ["1", "a,b", "0,4", "4,4", ",".join(map(str, range(1, 103))), "1,5000", [1, True]]
)
def test_gears_that_are_not_gears_are_refused_naming_the_option(make_version, mlp_bytes, raw):
    version = make_version({"model.onnx": mlp_bytes})
    with pytest.raises(ValidationError) as caught:
        check_conversion_options(version, {"batch_gears": raw})
    assert set(caught.value.message_dict) == {"batch_gears"}


def test_gears_are_sorted_and_atc_compiles_them(make_version, mlp_bytes):
    version = make_version({"model.onnx": mlp_bytes})
    assert check_conversion_options(version, {"batch_gears": "16, 1,4"})["batch_gears"] == "1,4,16"
    assert check_conversion_options(version, {"batch_gears": [8, 2]})["batch_gears"] == "2,8"
    assert atc_input_shapes(SIGNATURE, 16, "", "1,4,16") == ({"input": [-1, 16]}, [1, 4, 16])
    assert atc_input_shapes(SIGNATURE, 16, "")[1] == [1, 2, 4, 8, 16]
    with pytest.raises(ConversionError, match="above the max batch size 8"):
        atc_input_shapes(SIGNATURE, 8, "", "1,16")


def test_a_tunings_gears_convert_the_next_version_from_the_same_source(
    make_version, mlp_bytes, owner, fake_atc, maintainer_client
):
    argv_file = fake_atc("success_yolox")
    version = make_version({"model.onnx": mlp_bytes})
    assert runner.execute_job(start(version, owner).pk, worker="npu-host-1") == "succeeded"
    version.refresh_from_db()
    assert version.state == VersionState.READY and version.toolchain == "atc"
    job = TuningJob.objects.create(
        team=version.model.team, version=version, budget_s=60, max_candidates=3, state=TuningState.SUCCEEDED,
        objective={"p99_ms": 20.0, "rate_rps": None}, gears=[1, 2, 4, 8], result={"regear": [1, 2, 3, 4, 8]},
    )  # fmt: skip
    url = f"/api/v1/teams/vision/tunings/{job.pk}/reconvert/"
    with mock.patch("apps.conversions.services.enqueue_conversion"):
        answer = maintainer_client.post(url)
    assert answer.status_code == 201, answer.json()
    assert answer.json()["version"] == 2 and answer.json()["batch_gears"] == "1,2,3,4,8"
    conversion = ConversionJob.objects.get(pk=answer.json()["conversion_job"])
    fresh = conversion.version
    assert fresh.state == VersionState.CONVERTING and "tuning" in fresh.note
    assert (fresh.source_dir() / "model.onnx").read_bytes() == mlp_bytes
    assert runner.execute_job(conversion.pk, worker="npu-host-1") == "succeeded"
    conversion.refresh_from_db()
    assert "--dynamic_batch_size=1,2,3,4,8" in conversion.command
    assert "--dynamic_batch_size=1,2,3,4,8" in json.loads(argv_file.read_text())
    assert conversion.state == JobState.SUCCEEDED

    # No suggestion, no re-conversion; a version not converted here has no source to convert again.
    TuningJob.objects.filter(pk=job.pk).update(result={"regear": []})
    refused = maintainer_client.post(url)
    assert refused.status_code == 400 and "suggests no other gears" in refused.json()["fields"]["tuning"][0]
    with pytest.raises(ValidationError, match="nothing to convert again"):
        services.reconvert_version(actor=owner, version=make_version({"model.onnx": mlp_bytes}), options={})
