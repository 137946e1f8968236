"""Names the platform and its inference hosts agree on without a message between them.

A served model's name inside Triton is ``<team slug>__<model slug>``: the registry composes it, the gateway's
HAProxy matches it, the monitoring scraper and the final-counts check read the team and the model back from
it, and the host agent smoke-tests a new version under ``<name>__candidate`` before it serves it. Slugs never
contain an underscore, so the double underscore cannot come out of two other slugs (with a hyphen, team
"a" + model "b-c" and team "a-b" + model "c" would collide), and a candidate name is no model's name.

Both the platform and the host agent import this module; it imports nothing of either.
"""

from __future__ import annotations

import re

SLUG_MAX_LENGTH = 50
# A team's or a model's slug: 1-50 lowercase letters, digits and hyphens, starting and ending with a letter
# or digit. Used by the slug validators, the gateway's path allow-list (a PCRE in HAProxy) and the checks below.
SLUG_PATTERN = rf"[a-z0-9](?:[a-z0-9-]{{0,{SLUG_MAX_LENGTH - 2}}}[a-z0-9])?"
SLUG_RULE = "1-50 lowercase letters, digits and hyphens, starting and ending with a letter or digit"
SEPARATOR = "__"
# A Triton model name the platform made; no anchors and no groups, so it can be embedded in a longer pattern.
TRITON_MODEL_NAME_PATTERN = f"{SLUG_PATTERN}{SEPARATOR}{SLUG_PATTERN}"
# What a version is smoke-tested under before it serves (``<name>__candidate``): no model's name.
CANDIDATE_SUFFIX = f"{SEPARATOR}candidate"

_SLUG = re.compile(SLUG_PATTERN)
_TRITON_MODEL_NAME = re.compile(f"(?P<team>{SLUG_PATTERN}){SEPARATOR}(?P<model>{SLUG_PATTERN})")


def is_slug(value: object) -> bool:
    return isinstance(value, str) and _SLUG.fullmatch(value) is not None


def triton_model_name(team_slug: str, model_slug: str) -> str:
    """The model's name inside Triton. Raises ValueError for a slug that could make the name ambiguous."""
    for what, slug in (("team", team_slug), ("model", model_slug)):
        if not is_slug(slug):
            raise ValueError(f"{what} slug {slug!r} is not a slug ({SLUG_RULE})")
    return f"{team_slug}{SEPARATOR}{model_slug}"


def parse_triton_model_name(name: object) -> tuple[str, str]:
    """``(team slug, model slug)`` of a name :func:`triton_model_name` made. Raises ValueError for anything
    else: a candidate name, a name Triton was given by someone else, a non-string."""
    match = _TRITON_MODEL_NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        raise ValueError(f"{name!r} is not a Triton model name the platform made (<team>{SEPARATOR}<model>)")
    return match["team"], match["model"]


def is_triton_model_name(name: object) -> bool:
    return isinstance(name, str) and _TRITON_MODEL_NAME.fullmatch(name) is not None


def tuning_name(name: str, job_id: int) -> str:
    """The scratch name a tuning job's candidates of ``name`` are measured under (``<name>__tuning-<id>``):
    no model's name (three parts) and no candidate's."""
    parse_triton_model_name(name)
    if isinstance(job_id, bool) or not isinstance(job_id, int) or job_id < 1:
        raise ValueError(f"tuning job id {job_id!r} is not a positive integer")
    return f"{name}{SEPARATOR}tuning-{job_id}"


def candidate_name(name: str) -> str:
    """The name a new version of ``name`` is smoke-tested under before it serves."""
    parse_triton_model_name(name)
    return name + CANDIDATE_SUFFIX


__all__ = [
    "CANDIDATE_SUFFIX",
    "SEPARATOR",
    "SLUG_MAX_LENGTH",
    "SLUG_PATTERN",
    "SLUG_RULE",
    "TRITON_MODEL_NAME_PATTERN",
    "candidate_name",
    "is_slug",
    "is_triton_model_name",
    "parse_triton_model_name",
    "triton_model_name",
    "tuning_name",
]
