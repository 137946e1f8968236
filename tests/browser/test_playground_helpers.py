"""The playground's helpers in Chromium: only the chosen input mode's field shows, the request copied as curl
(a python3 script that writes a KServe v2 body, then curl) works, labels and softmax decorate the top-5 of a
classifier's result. The inference itself is covered with a real Triton in tests/deployments/test_browser.py;
here the result partial is the one the server renders, put in place as htmx would."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from django.template.loader import render_to_string

from apps.deployments import services as deployments
from apps.deployments.models import PlacementState
from tests.conftest import requires_chromium
from tests.support.browser import sign_in
from tests.support.models import make_version

pytestmark = [pytest.mark.browser, requires_chromium]


@pytest.fixture
def deployment(owner, model, instance, artifact_root):
    version = make_version(model, 1)
    deployment = deployments.deploy_version(actor=owner, model=model, version=version, instances=[instance])
    deployment.placements.update(state=PlacementState.READY, served_version=version)
    deployments.placement_finished(deployment.placements.get())
    return deployment


def test_input_modes_curl_copy_labels_and_softmax(page, live_server, deployment, tmp_path):
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    sign_in(page, live_server.url)
    page.goto(f"{live_server.url}/teams/vision/deployments/{deployment.pk}/")
    box = page.locator(".playground-input[data-input='input']")
    assert not box.locator("textarea").is_visible() and not box.locator("input[type=file]").is_visible()
    page.select_option("#mode_0", "file")
    assert box.locator("input[type=file]").is_visible() and not box.locator("textarea").is_visible()
    page.select_option("#mode_0", "random")

    # Copy the request as curl; its python part writes a body of the input's shape, then curl posts it.
    page.click("#playground-copy-curl")
    page.wait_for_function("document.querySelector('#playground-copy-curl').textContent === 'Copied'")
    copied = page.evaluate("navigator.clipboard.readText()")
    assert "/v2/models/vision__classifier/infer" in copied and "Bearer $TGP_TOKEN" in copied
    script = copied.split("python3 - <<'PY' > body.json\n", 1)[1].split("\nPY\n", 1)[0]
    body = json.loads(
        subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    )
    (tensor,) = body["inputs"]
    assert tensor["name"] == "input" and tensor["shape"] == [1, 3, 224, 224] and tensor["datatype"] == "FP32"
    assert len(tensor["data"]) == math.prod(tensor["shape"])

    # JSON values typed by the user go into the request as they are.
    page.select_option("#mode_0", "json")
    page.fill("textarea[name=data_0]", '[[0.5, "tricky \\"quote\\""]]')
    script = page.locator("#playground-curl").text_content().split("body.json\n", 1)[1].split("\nPY\n", 1)[0]
    body = json.loads(
        subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    )
    assert body["inputs"][0]["data"] == [[0.5, 'tricky "quote"']]

    # A classifier's result: labels from the textarea, softmax over the whole output.
    logits = [0.0] * 10
    logits[3], logits[7] = 4.0, 2.0
    top5 = sorted(range(10), key=lambda i: -logits[i])[:5]
    result = {
        "latency_ms": 1.5, "instance": "local/cpu-0", "version": 1, "inputs": [],
        "outputs": [{"name": "output", "datatype": "FP32", "shape": [1, 10], "data": logits,
                     "top5": [{"index": i, "score": logits[i]} for i in top5]}],
    }  # fmt: skip
    html = render_to_string("frontend/deployments/partials/playground_result.html", {"result": result})
    page.evaluate(
        """(html) => { const target = document.getElementById('playground-result'); target.innerHTML = html;
           target.dispatchEvent(new CustomEvent('htmx:afterSwap', {bubbles: true})); }""",
        html,
    )
    assert not page.locator("#top5-0 .pg-prob-col").is_visible()
    page.click("#playground-labels summary")
    page.fill("#pg-labels", "\n".join(f"class {i}" for i in range(10)))
    page.check("#pg-softmax")
    first = page.locator("#top5-0 tbody tr").first
    cells = first.locator("td").all_inner_texts()
    expected = math.exp(4) / (8 + math.exp(4) + math.exp(2))
    assert cells[1] == "3" and cells[2] == "class 3" and cells[4] == f"{expected * 100:.2f} %"
    values = page.locator("pre.pg-values")
    assert values.evaluate("e => getComputedStyle(e).whiteSpace") == "pre-wrap"
