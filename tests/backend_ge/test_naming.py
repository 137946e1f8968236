"""backend_ge.naming: the one place a Triton model name is composed, parsed and matched."""

from __future__ import annotations

import re

import pytest

from backend_ge import naming


@pytest.mark.parametrize(
    ("team", "model"), [("vision", "classifier"), ("a", "b"), ("team-1", "resnet-50"), ("x" * 50, "9" * 50)]
)
def test_a_composed_name_parses_back_to_its_slugs(team, model):
    name = naming.triton_model_name(team, model)
    assert name == f"{team}__{model}"
    assert naming.parse_triton_model_name(name) == (team, model)
    assert naming.is_triton_model_name(name)
    assert re.fullmatch(naming.TRITON_MODEL_NAME_PATTERN, name)


@pytest.mark.parametrize(
    ("team", "model"),
    [
        ("a_b", "c"),  # an underscore could move the separator: "a_b" + "_c"...
        ("a", "_b"),
        ("a__b", "c"),
        ("", "c"),
        ("a", ""),
        ("-a", "b"),
        ("a", "b-"),
        ("A", "b"),
        ("a", "b.c"),
        ("a", "b/../c"),
        ("x" * 51, "b"),
    ],
)
def test_composing_refuses_a_slug_that_could_make_the_name_ambiguous(team, model):
    with pytest.raises(ValueError, match="is not a slug"):
        naming.triton_model_name(team, model)


@pytest.mark.parametrize(
    "name",
    [
        "vision__classifier__candidate",  # a switch's candidate is no model's name
        "vision_classifier",
        "vision___classifier",
        "vision__",
        "__classifier",
        "vision",
        "Vision__classifier",
        "vision__classifier/1",
        "vision__classifier\n",
        "x" * 51 + "__m",
        None,
        42,
    ],
)
def test_parsing_refuses_names_the_platform_did_not_make(name):
    assert not naming.is_triton_model_name(name)
    with pytest.raises(ValueError, match="is not a Triton model name the platform made"):
        naming.parse_triton_model_name(name)


def test_the_candidate_name_is_the_name_with_the_suffix_and_no_model_name():
    candidate = naming.candidate_name("vision__mlp")
    assert candidate == "vision__mlp" + naming.CANDIDATE_SUFFIX == "vision__mlp__candidate"
    assert not naming.is_triton_model_name(candidate)
    with pytest.raises(ValueError):
        naming.candidate_name(candidate)


def test_two_different_slug_pairs_never_give_one_name():
    slugs = ["a", "b", "a-b", "b-c", "c", "a-b-c", "ab"]
    names = [naming.triton_model_name(t, m) for t in slugs for m in slugs]
    assert len(set(names)) == len(names)


def test_the_slug_validator_and_the_gateway_use_the_naming_module():
    from apps.gateway import haproxy
    from apps.teams.models import slug_validator

    assert slug_validator.regex.pattern == f"^{naming.SLUG_PATTERN}$"
    assert haproxy.MODEL_NAME == naming.TRITON_MODEL_NAME_PATTERN
    assert re.fullmatch(haproxy.ALLOWED_PATH, "/v2/models/vision__mlp/versions/2/infer")
    assert not re.fullmatch(haproxy.ALLOWED_PATH, "/v2/models/vision__mlp__candidate/infer")
