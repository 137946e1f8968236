"""Two versions side by side, in the API and on the page: signature and config differences, files, conversion
(ATC command, options, duration) and serving figures from the rollups; personas; bad parameters; hostile
config text rendered escaped."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from apps.conversions.models import ConversionJob
from tests.monitoring.builders import HOSTILE

API = "/api/v1/teams/vision/models/classifier/compare/"


def browser(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_member_gets_both_versions_side_by_side(compared, viewer_client):
    response = viewer_client.get(API, {"a": 1, "b": 2, "range": "1h"})
    assert response.status_code == 200, response.content
    data = response.json()
    assert (data["a"]["number"], data["b"]["number"], data["range"]) == (1, 2, "1h")
    # Signature: the input's dtype and shape changed, an output only v2 has.
    rows = {(r["kind"], r["name"]): r for r in data["signature"]["tensors"]}
    assert rows[("input", "input")]["changed"] == ["dtype", "shape"]
    assert rows[("input", "input")]["a"]["shape"] == [-1, 3, 224, 224]
    assert rows[("output", "output")]["changed"] == []
    assert rows[("output", "scores")]["a"] is None and rows[("output", "scores")]["b"]["dtype"] == "FP16"
    assert data["signature"]["identical"] is False
    # The config diff: one line changed, one added.
    ops = [(line["op"], line["text"]) for line in data["config"]["lines"]]
    assert ("-", "max_batch_size: 8") in ops and ("+", "max_batch_size: 16") in ops
    assert ("+", f"# {HOSTILE}") in ops  # data in the API; the page escapes it
    assert (data["config"]["added"], data["config"]["removed"]) == (2, 1)
    # Files and conversion.
    assert data["a"]["source_format"] == "onnx" and data["b"]["source_format"] == "om"
    assert data["differences"]["sha256"] is True and data["differences"]["size_bytes"] == 1.5
    assert (
        data["a"]["conversion"]["duration_seconds"] == 12
        and data["b"]["conversion"]["duration_seconds"] == 42
    )
    assert data["b"]["conversion"]["command"][0] == "atc" and data["a"]["conversion"]["command"] == []
    options = {o["key"]: o for o in data["options"]}
    assert options["precision_mode"]["changed"] and options["soc_version"]["a"] is None
    # Serving over the last hour only.
    a, b = data["a"]["serving"], data["b"]["serving"]
    assert (a["requests"], a["failure"], a["error_rate"]) == (100, 10, 0.1)
    assert (b["requests"], b["failure"], b["error_rate"]) == (200, 2, 0.01)
    assert (a["p50_ms"], a["p99_ms"], b["p99_ms"]) == (1.0, 4.0, 6.0)
    assert data["differences"]["p99_ms"] == 0.5
    # A shorter range leaves the older rows out; a longer one takes them in.
    wide = viewer_client.get(API, {"a": 1, "b": 2, "range": "6h"}).json()
    assert wide["a"]["serving"]["requests"] == 600


def test_owner_and_outsider(compared, owner_client, outsider_client):
    assert owner_client.get(API, {"a": 2, "b": 1}).status_code == 200
    # Another team's model is a 404, as is an unknown team or model: nothing confirms it exists.
    response = outsider_client.get(API, {"a": 1, "b": 2})
    assert response.status_code == 404
    assert (
        outsider_client.get("/api/v1/teams/vision/models/nope/compare/", {"a": 1, "b": 2}).status_code == 404
    )


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({"b": 2}, "a"),
        ({"a": "x", "b": 2}, "a"),
        ({"a": 1, "b": 0}, "b"),
        ({"a": 1, "b": 1}, "b"),
        ({"a": 1, "b": 2, "range": "1y"}, "range"),
    ],
)
def test_bad_parameters_are_a_400_that_says_what_to_send(compared, viewer_client, query, field):
    response = viewer_client.get(API, query)
    assert response.status_code == 400, response.content
    assert field in response.content.decode()


def test_unknown_version_is_a_404(compared, viewer_client):
    assert viewer_client.get(API, {"a": 1, "b": 9}).status_code == 404
    assert viewer_client.get(API, {"a": 9, "b": 1}).status_code == 404


def test_page_shows_differences_and_escapes_the_config(compared, viewer):
    url = reverse("version-compare", args=["vision", "classifier"])
    viewer_client = browser(viewer)
    page = viewer_client.get(url, {"a": 1, "b": 2})
    assert page.status_code == 200
    html = page.content.decode()
    assert "<script>alert" not in html and "<img src=x" not in html
    assert "&lt;/pre&gt;&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in html
    assert 'class="diff-line diff-add">+max_batch_size: 16' in html
    assert 'class="diff-line diff-del">-max_batch_size: 8' in html
    assert 'data-tensor="scores"' in html and "absent" in html
    assert "atc --model=model.onnx --framework=5 --soc_version=Ascend310P3" in html
    assert "10.00 %" in html and "1.00 %" in html  # error rates
    assert "42.0 s" in html and "12.0 s" in html  # conversion durations
    # Without a and b: the two newest versions; a version without a conversion job shows dashes.
    ConversionJob.objects.filter(version=compared[0]).delete()
    default = viewer_client.get(url)
    assert default.status_code == 200 and 'id="compare-files"' in default.content.decode()
    assert '<td id="duration-a">—</td>' in default.content.decode()


def test_page_personas_and_bad_parameters(compared, owner, outsider, viewer):
    url = reverse("version-compare", args=["vision", "classifier"])
    assert browser(owner).get(url, {"a": 2, "b": 1}).status_code == 200
    assert browser(outsider).get(url, {"a": 1, "b": 2}).status_code == 404
    viewer_client = browser(viewer)
    bad = viewer_client.get(url, {"a": 1, "b": 1})
    assert bad.status_code == 400 and "two different versions" in bad.content.decode()
    assert viewer_client.get(url, {"a": 1, "b": 7}).status_code == 404


def test_versions_list_links_to_the_comparison(compared, viewer):
    html = browser(viewer).get(reverse("model-detail", args=["vision", "classifier"])).content.decode()
    assert 'id="versions-compare"' in html
    assert reverse("version-compare", args=["vision", "classifier"]) in html
