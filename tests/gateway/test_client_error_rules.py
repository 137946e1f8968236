"""The rules that turn Triton's request-parse failures from 500 into 400: which bodies they match (the messages
Triton 2.51 answered in tests/gateway/test_client_errors_live.py), and that only a 500's body is buffered."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from apps.gateway.haproxy import render_config
from apps.gateway.rules import CLIENT_ERROR_BODY, client_error_rules
from apps.gateway.state import options
from tests.gateway.test_render import SLOTS, state

# What Triton 2.51 answered with 500 for a bad request (measured), and 500s that are real failures.
CLIENT_ERRORS = [
    "failed to parse the request JSON buffer: Invalid value. at 12",
    "failed to parse the request JSON buffer: The document root must not be followed by other values. at 98",
    "Unable to parse 'inputs': attempt to access non-existing object member 'inputs'",
    "Unable to parse 'data': Shape does not match true shape of 'data' field",
    "Unable to parse 'data': attempt to access JSON non-number as double",
    "Unable to parse 'shape': attempt to access JSON non-unsigned-integer as unsigned-integer",
    "Unable to parse 'binary_data_output': attempt to access JSON non-boolean as boolean",
    "Unable to set 'classification': attempt to access JSON non-unsigned-integer as unsigned-integer",
]
SERVER_ERRORS = [
    "model 'vision__reshaper' failed: onnxruntime run failed: [ONNXRuntimeError] : 1 : FAIL : Unable to parse 'x': ",
    "model 'vision__mlp' returned output 'output' without a batch dimension of 4",
    "Failed to process the request(s) for model 'vision__mlp_0_0', message: Stub process is not healthy.",
]


def triton_body(message: str) -> str:
    return json.dumps({"error": message}, separators=(",", ":"))  # Triton writes no spaces


@pytest.mark.parametrize("message", CLIENT_ERRORS)
def test_triton_parse_failures_match_the_allow_list(message):
    assert re.search(CLIENT_ERROR_BODY, triton_body(message))


@pytest.mark.parametrize("message", SERVER_ERRORS)
def test_a_model_failure_does_not_match_even_when_it_quotes_a_parse_message(message):
    assert not re.search(CLIENT_ERROR_BODY, triton_body(message))


def test_the_message_must_open_the_body():
    assert not re.search(CLIENT_ERROR_BODY, '{"other":1,"error":"Unable to parse \'data\': x"}')
    assert not re.search(CLIENT_ERROR_BODY, '{"error":"Unable to parse data: x"}')  # no quoted field name


def test_only_a_500_on_the_infer_path_is_buffered_and_rewritten(tmp_path):
    rules = client_error_rules("infer_path")
    buffering = [line for line in rules if "wait-for-body" in line]
    assert buffering == [
        "    http-response wait-for-body time 1000ms if { status 500 } { var(txn.infer) -m found }"
    ]
    rewrite = next(line for line in rules if "set-status" in line)
    assert rewrite.startswith(
        "    http-response set-status 400 if { status 500 } { var(txn.infer) -m found }"
    )
    config = render_config(state(), SLOTS, replace(options(), directory=tmp_path))
    frontend = config.split("frontend inference", 1)[1].split("\nfrontend ", 1)[0]
    assert all(line in frontend.splitlines() for line in rules)
    # The rewrite comes before the count of 400s, so a rewritten answer counts as a bad request.
    assert frontend.index("set-status 400") < frontend.index("sc-inc-gpc(6,1) if { status 400 }")
    assert frontend.count("http-response wait-for-body") == 1
