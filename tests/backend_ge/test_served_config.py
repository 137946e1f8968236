"""backend_ge.served_config: the served config is built from an allow-list; everything else is refused by path."""

from __future__ import annotations

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from backend_ge import config as gc
from backend_ge import served_config as sc
from tests.backend_ge.seeds import SEED_BERT, SEED_ENSEMBLE, SEED_RESNET50, SEED_RESNET50_AS_PRINTED

BASE = (
    'name: "m" backend: "ge" max_batch_size: 8\n'
    'input [{ name: "in" data_type: TYPE_FP32 dims: [3] }]\n'
    'output [{ name: "out" data_type: TYPE_FP32 dims: [2] }]\n'
)


def refused(text: str, **kwargs) -> dict[str, list[str]]:
    kwargs.setdefault("name", "team--m")
    with pytest.raises(gc.ConfigError) as exc:
        sc.build_served_config(text, **kwargs)
    return exc.value.as_dict()


# extra text appended to BASE (or replacing its backend line) -> the field path that must be named
HOSTILE = {
    "python env path": (
        'parameters { key: "EXECUTION_ENV_PATH" value { string_value: "$$TRITON_MODEL_DIRECTORY/../../x" } }',
        "parameters.EXECUTION_ENV_PATH",
    ),
    "unknown parameter": (
        'parameters { key: "shm-region-prefix" value { string_value: "x" } }',
        "parameters.shm-region-prefix",
    ),
    "device id from the tenant": (
        'parameters { key: "DEVICE_ID" value { string_value: "3" } }',
        "parameters.DEVICE_ID",
    ),
    "device list from the tenant": (
        'parameters { key: "device_ids" value { string_value: "0,1" } }',
        "parameters.device_ids",
    ),
    "device id in another spelling": (
        'parameters { key: "device_id" value { string_value: "3" } }',
        "parameters.device_id",
    ),
    "bad executor": (
        'parameters { key: "EXECUTOR" value { string_value: "python" } }',
        "parameters.EXECUTOR",
    ),
    "thread count out of bounds": (
        'parameters { key: "intra_op_thread_count" value { string_value: "100000" } }',
        "parameters.intra_op_thread_count",
    ),
    "file name escaping": (
        'default_model_filename: "../../../../teams/1/model.onnx"',
        "default_model_filename",
    ),
    "cc file names": ('cc_model_filenames { key: "7.5" value: "../x.plan" }', "cc_model_filenames"),
    "version policy": ("version_policy { all {} }", "version_policy"),
    "runtime": ('runtime: "libtorch"', "runtime"),
    "backend python": ('backend: "python"', "backend"),
    "backend onnxruntime": ('backend: "onnxruntime"', "backend"),
    "backend pytorch": ('backend: "pytorch"', "backend"),
    "platform other than ensemble": ('platform: "onnxruntime_onnx"', "platform"),
    "100000 instances": ("instance_group { count: 100000 kind: KIND_CPU }", "instance_group[0].count"),
    "many groups": ("instance_group [{ count: 5 }, { count: 5 }]", "instance_group[1].count"),
    "gpu kind": ("instance_group { count: 1 kind: KIND_GPU }", "instance_group[0].kind"),
    "model kind": ("instance_group { count: 1 kind: KIND_MODEL }", "instance_group[0].kind"),
    "gpus": ("instance_group { count: 1 kind: KIND_CPU gpus: [0, 1] }", "instance_group[0].gpus"),
    "host policy": ('instance_group { count: 1 host_policy: "numa0" }', "instance_group[0].host_policy"),
    "warmup from a file": (
        'model_warmup { name: "w" batch_size: 1 inputs { key: "in" value { data_type: TYPE_FP32 dims: [3] '
        'input_data_file: "../../../../etc/shadow" } } }',
        "model_warmup[0].inputs.in.input_data_file",
    ),
    "warmup without data": (
        'model_warmup { name: "w" batch_size: 1 inputs { key: "in" value { data_type: TYPE_FP32 dims: [3] } } }',
        "model_warmup[0].inputs.in",
    ),
    "warmup count": (
        'model_warmup { name: "w" batch_size: 1 count: 1000000 '
        'inputs { key: "in" value { data_type: TYPE_FP32 dims: [3] zero_data: true } } }',
        "model_warmup[0].count",
    ),
    "huge max batch size": ("max_batch_size: 2000000000", "max_batch_size"),
    "huge queue delay": (
        "dynamic_batching { max_queue_delay_microseconds: 100000000000 }",
        "dynamic_batching.max_queue_delay_microseconds",
    ),
    "many priority levels": (
        "dynamic_batching { priority_levels: 100000 }",
        "dynamic_batching.priority_levels",
    ),
    "huge queue": (
        "dynamic_batching { default_queue_policy { max_queue_size: 4000000000 } }",
        "dynamic_batching.default_queue_policy.max_queue_size",
    ),
    "huge dimension": ('input [{ name: "big" data_type: TYPE_FP32 dims: [2000000000] }]', "input[1].dims[0]"),
    "unsafe tensor name": ('input [{ name: "a b;rm" data_type: TYPE_FP32 dims: [3] }]', "input[1].name"),
    "label file": (
        'output [{ name: "o2" data_type: TYPE_FP32 dims: [2] label_filename: "/etc/passwd" }]',
        "output[1].label_filename",
    ),
    "repository agents": (
        'model_repository_agents { agents { name: "checksum" } }',
        "model_repository_agents",
    ),
    "transaction policy": ("model_transaction_policy { decoupled: true }", "model_transaction_policy"),
    "response cache": ("response_cache { enable: true }", "response_cache"),
    "sequence batching": ("sequence_batching { max_sequence_idle_microseconds: 1 }", "sequence_batching"),
    "optimization": ("optimization { priority: PRIORITY_MAX }", "optimization"),
    "metric tags": ('metric_tags { key: "team" value: "other" }', "metric_tags"),
    "steps outside an ensemble": (
        'ensemble_scheduling { step { model_name: "other--m" } }',
        "ensemble_scheduling",
    ),
}


def hostile_text(extra: str) -> str:
    """BASE with ``extra`` added, or in place of BASE's own backend / max_batch_size."""
    for own in ('backend: "ge"', "max_batch_size: 8"):
        if extra.startswith(own.split(":")[0] + ":"):
            return BASE.replace(own, extra)
    return BASE + extra


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_config_is_refused_naming_the_field(case):
    extra, field = HOSTILE[case]
    errors = refused(hostile_text(extra))
    assert field in errors, errors
    assert all(message for message in errors[field])


def test_every_problem_is_reported_at_once():
    errors = refused(
        BASE
        + 'default_model_filename: "../x" response_cache { enable: true }'
        + ' parameters { key: "EXECUTION_ENV_PATH" value { string_value: "/x" } }'
    )
    assert {"default_model_filename", "response_cache", "parameters.EXECUTION_ENV_PATH"} <= set(errors)


def test_a_field_triton_adds_later_is_refused_by_default(monkeypatch):
    # The walk is generic: a field missing from the allow-list is refused even if no rule names it.
    monkeypatch.setitem(sc.TENANT_FIELDS, "dynamic_batching", {"preferred_batch_size": sc.LEAF})
    errors = refused(BASE + "dynamic_batching { max_queue_delay_microseconds: 5 }")
    assert "dynamic_batching.max_queue_delay_microseconds" in errors


def test_served_config_has_the_platform_name_backend_and_cpu_instances():
    cfg = sc.build_served_config(
        BASE.replace('name: "m"', 'name: "../other-team--m"') + "instance_group { count: 2 }", name="team--m"
    )
    assert cfg.name == "team--m" and cfg.backend == "ge" and cfg.platform == ""
    assert [(g.count, g.kind) for g in cfg.instance_group] == [(2, mc.ModelInstanceGroup.KIND_CPU)]
    assert not cfg.HasField("version_policy") and cfg.default_model_filename == ""


def test_instance_limit_is_the_callers():
    text = BASE + "instance_group { count: 3 }"
    assert sc.build_served_config(text, name="m", max_instance_count=3).instance_group[0].count == 3
    errors = refused(text, max_instance_count=2, instance_limit="the team's limit (quota_model_instances)")
    assert errors["instance_group[0].count"] == [
        "3 instances in all; the team's limit (quota_model_instances) is 2 per model "
        "(each one is a process on the host)"
    ]


def test_allowed_fields_survive_with_their_values():
    text = BASE + (
        "dynamic_batching { preferred_batch_size: [4, 8] max_queue_delay_microseconds: 500 priority_levels: 2 "
        "default_priority_level: 1 default_queue_policy { timeout_action: DELAY default_timeout_microseconds: 1000 "
        "max_queue_size: 64 } priority_queue_policy { key: 2 value { max_queue_size: 8 } } }\n"
        'model_warmup { name: "warm" batch_size: 2 count: 2 inputs { key: "in" value { data_type: TYPE_FP32 '
        "dims: [3] random_data: true } } }\n"
        'parameters { key: "EXECUTOR" value { string_value: "onnxruntime" } }\n'
        'parameters { key: "intra_op_thread_count" value { string_value: "2" } }\n'
    )
    cfg = sc.build_served_config(text, name="m")
    assert list(cfg.dynamic_batching.preferred_batch_size) == [4, 8]
    assert cfg.dynamic_batching.priority_queue_policy[2].max_queue_size == 8
    assert cfg.model_warmup[0].inputs["in"].random_data
    assert {k: v.string_value for k, v in cfg.parameters.items()} == {
        "EXECUTOR": "onnxruntime",
        "intra_op_thread_count": "2",
    }


@pytest.mark.parametrize(
    "text,name",
    [(SEED_RESNET50, "resnet50"), (SEED_BERT, "bert"), (SEED_RESNET50_AS_PRINTED, "resnet50")],
)
def test_seed_configs_still_serve(text, name):
    cfg = sc.build_served_config(text, name=name)
    assert cfg.backend == "ge" and cfg.parameters.keys() <= {"EXECUTOR_TYPE"}
    assert gc.validate_config(cfg, expected_name=name) == []


def test_generated_config_passes_unchanged_apart_from_the_platform_fields():
    sig = gc.ModelSignature(
        (gc.TensorSignature("input", "FP32", (3, 8, 8), "NCHW"),),
        (gc.TensorSignature("output", "FP32", (3,)),),
        True,
    )
    generated = gc.generate_config(
        "team--m",
        sig,
        max_batch_size=32,
        preferred_batch_sizes=[4, 8],
        max_queue_delay_us=500,
        executor="acl",
    )
    assert sc.build_served_config(generated, name="team--m", signature=sig) == generated


def test_ensemble_may_call_only_the_teams_models():
    team_models = {"preprocess", "resnet50", "postprocess"}
    cfg = sc.build_served_config(SEED_ENSEMBLE, name="team--ens", allowed_models=team_models)
    assert cfg.platform == "ensemble" and not cfg.backend and not cfg.instance_group
    errors = refused(SEED_ENSEMBLE, allowed_models={"preprocess", "postprocess"})
    assert "ensemble_scheduling.step[1].model_name" in errors
    assert "platform" in refused(SEED_ENSEMBLE)  # where ensembles are not accepted at all
    errors = refused(
        SEED_ENSEMBLE.replace('platform: "ensemble"', 'platform: "ensemble" instance_group { count: 1 }'),
        allowed_models=lambda name: name in team_models,
    )
    assert "instance_group" in errors


@pytest.mark.parametrize(
    "text",
    [
        BASE.replace("dims: [3]", "data_type:99999999999 dims: [3]"),  # protobuf's "Value out of range"
        SEED_ENSEMBLE.replace("dims: [5] } ]", "dims: [5]"),  # seed repairs that never parse
        "{" * 500,
    ],
)
def test_malformed_text_is_a_field_error_not_a_crash(text):
    with pytest.raises(gc.ConfigError) as exc:
        sc.build_served_config(text, name="m", allowed_models={"resnet50"})
    assert exc.value.errors and all(e.field and e.message for e in exc.value.errors)


def test_host_instance_limit_is_the_smaller_of_the_teams_and_the_hosts_and_names_it():
    assert sc.host_instance_limit(4, 2) == (2, sc.HOST_INSTANCE_LIMIT)
    assert sc.host_instance_limit(4, 8) == (4, sc.TEAM_INSTANCE_LIMIT)
    assert sc.host_instance_limit(4, 4) == (4, sc.TEAM_INSTANCE_LIMIT)
    assert sc.host_instance_limit(4, 0) == (1, sc.HOST_INSTANCE_LIMIT)  # a host always runs one
    assert sc.TEAM_INSTANCE_LIMIT == "the team's limit (quota_model_instances)"
    assert sc.HOST_INSTANCE_LIMIT == "this host's limit (FLEET_MAX_MODEL_INSTANCES)"
