"""A corpus of hostile config.pbtxt edits, shared by the upload and the config-edit (PUT) tests.

Each case turns a valid config (the platform's generated one, or an upload's) into a hostile one and names the
field path the refusal must carry.
"""

from __future__ import annotations

import re
from collections.abc import Callable

KIND_LINE = re.compile(r"^\s*(platform|backend):.*$", re.MULTILINE)


def add(extra: str) -> Callable[[str], str]:
    return lambda text: f"{text}\n{extra}\n"


def kind(extra: str) -> Callable[[str], str]:
    """Replace the config's backend/platform line with ``extra``."""
    return lambda text: KIND_LINE.sub("", text) + f"\n{extra}\n"


def instances(extra: str) -> Callable[[str], str]:
    """Replace the config's instance groups (the generated config has one) with ``extra``."""
    return lambda text: re.sub(r"instance_group \{[^}]*\}", "", text) + f"\n{extra}\n"


def scheduling(extra: str, *, kind_line: str = "") -> Callable[[str], str]:
    """Replace dynamic batching (one of Triton's scheduling choices) with ``extra``, and the kind line."""

    def change(text: str) -> str:
        text = re.sub(r"dynamic_batching \{[^}]*\}", "", text)
        if kind_line:
            text = KIND_LINE.sub("", text) + f"\n{kind_line}\n"
        return f"{text}\n{extra}\n"

    return change


def sub(pattern: str, replacement: str) -> Callable[[str], str]:
    def change(text: str) -> str:
        changed, count = re.subn(pattern, replacement, text)
        assert count, f"{pattern!r} not in the base config"
        return changed

    return change


OTHER_TEAMS_WEIGHTS = "../../../../../../artifacts/teams/1/models/1/versions/1/model/1/model.onnx"

CASES: dict[str, tuple[Callable[[str], str], str]] = {
    "python execution environment": (
        add(
            'parameters { key: "EXECUTION_ENV_PATH" value { string_value: '
            '"$$TRITON_MODEL_DIRECTORY/../../../../../artifacts/teams/1/models/1/versions/1/source" } }'
        ),
        "parameters.EXECUTION_ENV_PATH",
    ),
    "python backend parameter": (
        add('parameters { key: "FORCE_CPU_ONLY_INPUT_TENSORS" value { string_value: "no" } }'),
        "parameters.FORCE_CPU_ONLY_INPUT_TENSORS",
    ),
    "device pinned by the tenant": (
        add('parameters { key: "DEVICE_ID" value { string_value: "7" } }'),
        "parameters.DEVICE_ID",
    ),
    "another team's weights": (
        add(f'default_model_filename: "{OTHER_TEAMS_WEIGHTS}"'),
        "default_model_filename",
    ),
    "backend python": (kind('backend: "python"'), "backend"),
    "backend onnxruntime": (kind('backend: "onnxruntime"'), "backend"),
    "backend pytorch": (kind('backend: "pytorch"'), "backend"),
    "platform tensorrt": (kind('platform: "tensorrt_plan"'), "platform"),
    "100000 instances": (
        instances("instance_group { count: 100000 kind: KIND_CPU }"),
        "instance_group[0].count",
    ),
    "gpu instances": (instances("instance_group { count: 1 kind: KIND_GPU }"), "instance_group[0].kind"),
    "gpu ids": (instances("instance_group { count: 1 gpus: [0, 1, 2] }"), "instance_group[0].gpus"),
    "warmup from a file": (
        add(
            'model_warmup { name: "w" batch_size: 1 inputs { key: "input" value { data_type: TYPE_FP32 '
            'dims: [4] input_data_file: "../../../../../../var/secret_key" } } }'
        ),
        "model_warmup[0].inputs.input.input_data_file",
    ),
    "huge max batch size": (sub(r"max_batch_size: \d+", "max_batch_size: 1000000"), "max_batch_size"),
    "huge queue delay": (
        sub(r"max_queue_delay_microseconds: \d+", "max_queue_delay_microseconds: 900000000000"),
        "dynamic_batching.max_queue_delay_microseconds",
    ),
    "repository agents": (
        add('model_repository_agents { agents { name: "checksum" } }'),
        "model_repository_agents",
    ),
    "transaction policy": (add("model_transaction_policy { decoupled: true }"), "model_transaction_policy"),
    "response cache": (add("response_cache { enable: true }"), "response_cache"),
    "sequence batching": (
        scheduling("sequence_batching { max_sequence_idle_microseconds: 1 }"),
        "sequence_batching",
    ),
    "version policy": (add("version_policy { all {} }"), "version_policy"),
    "ensemble of another team's model": (
        scheduling(
            'ensemble_scheduling { step { model_name: "victims--resnet50" model_version: -1 '
            'input_map { key: "input" value: "input" } output_map { key: "output" value: "output" } } }',
            kind_line='platform: "ensemble"',
        ),
        "ensemble_scheduling.step[0].model_name",
    ),
}
