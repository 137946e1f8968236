"""The playground's bounds: a body over PLAYGROUND_MAX_BYTES is a 413 before it is read (API and page), a
.npy part is checked by its header before its data is read, and no input - JSON, file or random data of a
model's declared dims - may build more than PLAYGROUND_MAX_ELEMENTS values."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from apps.core.body_limits import RequestTooLarge
from apps.deployments import calling, services
from apps.deployments.api import PlaygroundJSONParser
from apps.deployments.models import Deployment, PlacementState
from backend_ge.config import ModelSignature
from tests.support.models import CLASSIFIER_SIGNATURE

pytestmark = pytest.mark.django_db

MiB = 2**20


@pytest.fixture
def serving(owner, version, instance):
    deployment = services.deploy_version(
        actor=owner, model=version.model, version=version, instances=[instance]
    )
    deployment.placements.update(state=PlacementState.READY, served_version=version)
    services.placement_finished(deployment.placements.get())
    return Deployment.objects.get(pk=deployment.pk)


def api_url(deployment) -> str:
    return f"/api/v1/teams/vision/deployments/{deployment.pk}/playground/"


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


class CountingBytesIO(io.BytesIO):
    """Remembers how many bytes were read from it."""

    bytes_read = 0

    def read(self, size=-1):
        data = super().read(size)
        self.bytes_read += len(data)
        return data

    def readinto(self, buffer):
        count = super().readinto(buffer)
        self.bytes_read += count
        return count


def counting_upload(content: bytes, name: str = "input.npy") -> SimpleUploadedFile:
    upload = SimpleUploadedFile(name, content)
    upload.file = CountingBytesIO(content)
    return upload


def test_a_json_body_over_16_mib_is_413_with_the_error_shape(viewer_client, serving, settings):
    assert settings.PLAYGROUND_MAX_BYTES == 16 * 2**20  # the default
    values = "0.5," * (17 * MiB // 4)
    body = '{"inputs": {"input": {"mode": "json", "data": [' + values + "0.5]}}}"
    response = viewer_client.post(api_url(serving), body, content_type="application/json")
    assert response.status_code == 413
    payload = response.json()
    assert payload["error"] == "too_large"
    assert "larger than the 16 MiB this endpoint accepts (this one is 17.0 MiB)" in payload["message"]


def test_the_json_parser_reads_no_more_than_the_limit_even_without_a_declared_length(settings):
    settings.PLAYGROUND_MAX_BYTES = 1024
    stream = CountingBytesIO(b"[" + b"1," * 100_000 + b"1]")
    with pytest.raises(RequestTooLarge):
        PlaygroundJSONParser().parse(stream)
    assert stream.bytes_read == 1025


def test_a_multipart_npy_part_over_the_limit_is_413_and_not_stored(viewer_client, serving, settings):
    settings.PLAYGROUND_MAX_BYTES = 64 * 1024
    big = io.BytesIO(npy_bytes(np.zeros(40_000, dtype=np.float32)))
    big.name = "input.npy"
    response = viewer_client.post(api_url(serving), {"input": big}, format="multipart")
    assert response.status_code == 413 and response.json()["error"] == "too_large"


def test_a_npy_part_with_more_values_than_the_budget_is_refused_from_its_header(settings):
    settings.PLAYGROUND_MAX_ELEMENTS = 1000
    upload = counting_upload(npy_bytes(np.zeros((1, 3, 224, 224), dtype=np.float32)))
    signature = ModelSignature.from_dict(CLASSIFIER_SIGNATURE)
    with pytest.raises(Exception) as refused:
        calling.build_inputs(signature, {"input": calling.InputSpec(mode="file", upload=upload)})
    assert refused.value.message_dict == {
        "inputs.input": [
            "'input': the .npy file (shape [1, 3, 224, 224]) has 150,528 values; the playground takes at most "
            "1,000 values per request. Call the model through its endpoint (see the snippets) for bigger inputs."
        ]
    }
    assert upload.file.bytes_read < 200  # the header only, not the 602 KB of data


def test_a_npy_part_whose_length_does_not_match_its_header_is_refused_unread():
    content = npy_bytes(np.zeros((1, 3, 224, 224), dtype=np.float32))
    upload = counting_upload(content[:-4096])
    signature = ModelSignature.from_dict(CLASSIFIER_SIGNATURE)
    with pytest.raises(Exception) as refused:
        calling.build_inputs(signature, {"input": calling.InputSpec(mode="file", upload=upload)})
    assert "does not match its header" in str(refused.value)
    assert upload.file.bytes_read < 200


def test_a_npy_part_of_objects_is_refused():
    upload = counting_upload(npy_bytes(np.array([{"a": 1}], dtype=object)))
    signature = ModelSignature.from_dict(CLASSIFIER_SIGNATURE)
    with pytest.raises(Exception) as refused:
        calling.build_inputs(signature, {"input": calling.InputSpec(mode="file", upload=upload)})
    assert "must hold numbers, not object" in str(refused.value)


def test_a_fitting_npy_part_is_read_whole_and_shaped():
    image = np.random.default_rng(1).random((3, 224, 224), dtype=np.float32)
    upload = counting_upload(npy_bytes(image))
    signature = ModelSignature.from_dict(CLASSIFIER_SIGNATURE)
    arrays = calling.build_inputs(signature, {"input": calling.InputSpec(mode="file", upload=upload)})
    np.testing.assert_array_equal(arrays["input"], image[np.newaxis])


def test_random_data_for_huge_declared_dims_is_refused_before_it_is_made():
    signature = ModelSignature.from_dict(
        {
            "inputs": [{"name": "x", "dtype": "FP32", "dims": [100_000, 100_000, 100_000], "format": ""}],
            "outputs": [{"name": "y", "dtype": "FP32", "dims": [1], "format": ""}],
            "batched": True,
        }
    )
    with pytest.raises(Exception) as refused:
        calling.build_inputs(signature, {})
    assert "random data of shape [1, 100000, 100000, 100000] has 1,000,000,000,000,000 values" in str(
        refused.value
    )


def test_json_inputs_count_against_the_budget_through_the_api(viewer_client, serving, settings):
    settings.PLAYGROUND_MAX_ELEMENTS = 100_000
    data = np.zeros((3, 224, 224)).tolist()
    response = viewer_client.post(
        api_url(serving), {"inputs": {"input": {"mode": "json", "data": data}}}, format="json"
    )
    assert response.status_code == 400
    assert response.json()["fields"] == {
        "inputs.input": [
            "'input': the JSON list has 150,528 values; the playground takes at most 100,000 values per "
            "request. Call the model through its endpoint (see the snippets) for bigger inputs."
        ]
    }


def test_the_page_playground_refuses_a_large_body_before_reading_it(client, viewer, serving, settings):
    settings.PLAYGROUND_MAX_BYTES = 64 * 1024
    client.force_login(viewer)
    url = f"/teams/vision/deployments/{serving.pk}/playground/"
    big = SimpleUploadedFile("x.npy", npy_bytes(np.zeros(40_000, dtype=np.float32)))
    plain = client.post(url, {"mode_0": "file", "file_0": big})
    assert plain.status_code == 413 and "this endpoint accepts" in plain.content.decode()
    big.seek(0)
    htmx = client.post(url, {"mode_0": "file", "file_0": big}, HTTP_HX_REQUEST="true")
    html = htmx.content.decode()
    assert htmx.status_code == 200 and 'id="playground-error"' in html and "0.0625 MiB" in html


def test_the_page_playground_applies_the_element_budget(client, viewer, serving, settings):
    settings.PLAYGROUND_MAX_ELEMENTS = 1000
    client.force_login(viewer)
    response = client.post(
        f"/teams/vision/deployments/{serving.pk}/playground/",
        {"mode_0": "json", "data_0": json.dumps([0.0] * 2000)},
    )
    assert response.status_code == 400
    assert "the JSON list has 2,000 values; the playground takes at most 1,000" in response.content.decode()
