"""Checks of what a user sends with an upload: serving options, conversion options and the config of a lone
.om file."""

from __future__ import annotations

import re

from django.core.exceptions import ValidationError

from backend_ge import config as gc
from backend_ge.served_config import (
    MAX_BATCH_SIZE,
    MAX_INSTANCE_COUNT,
    MAX_QUEUE_DELAY_US,
    TEAM_INSTANCE_LIMIT,
    build_served_config,
)
from backend_ge.serving import DEFAULT_MAX_BATCH_SIZE

# What the conversion job hands to backend_ge.config.generate_config. Defaults match the seed's models.
# Devices are not among them: the platform assigns an instance's devices at placement.
SERVING_DEFAULTS: dict = {
    "max_batch_size": DEFAULT_MAX_BATCH_SIZE,
    "preferred_batch_sizes": [],
    "max_queue_delay_us": 100,
    "instance_count": 1,
}
# The name an uploaded config carries until the conversion job gives it the model's Triton name.
UPLOADED_CONFIG_NAME = "model"


def _int(value, field: str, low: int, high: int, errors: dict) -> int | None:
    if isinstance(value, bool):
        value = None
    try:
        number = int(value)
        if str(number) != str(value).strip() and not isinstance(value, int):
            raise ValueError
    except (TypeError, ValueError):
        errors.setdefault(field, []).append(f"Give a whole number between {low} and {high}.")
        return None
    if not low <= number <= high:
        errors.setdefault(field, []).append(f"Must be between {low} and {high}.")
        return None
    return number


def _int_list(value, field: str, low: int, high: int, errors: dict) -> list[int]:
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").split(",") if v]
    if not isinstance(value, list | tuple):
        errors.setdefault(field, []).append("Give a list of whole numbers, e.g. 4,8,16.")
        return []
    out = [_int(v, field, low, high, errors) for v in value]
    return sorted({v for v in out if v is not None})


def check_serving_options(options: dict | None, max_instances: int = MAX_INSTANCE_COUNT) -> dict:
    """Serving options with defaults filled in; ValidationError maps each bad option to its message."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(SERVING_DEFAULTS))
    errors: dict[str, list[str]] = {
        key: [f"Unknown serving option; use {', '.join(SERVING_DEFAULTS)}."] for key in unknown
    }
    if "device_ids" in errors:
        errors["device_ids"] = ["Devices are chosen by the platform at placement: the instance's devices."]
    merged = {**SERVING_DEFAULTS, **{k: v for k, v in options.items() if v is not None and v != ""}}
    out = {
        "max_batch_size": _int(merged["max_batch_size"], "max_batch_size", 0, MAX_BATCH_SIZE, errors),
        "preferred_batch_sizes": _int_list(
            merged["preferred_batch_sizes"], "preferred_batch_sizes", 1, MAX_BATCH_SIZE, errors
        ),
        "max_queue_delay_us": _int(
            merged["max_queue_delay_us"], "max_queue_delay_us", 0, MAX_QUEUE_DELAY_US, errors
        ),
        "instance_count": _int(merged["instance_count"], "instance_count", 1, max_instances, errors),
    }
    if out["max_batch_size"] is not None and any(
        p > out["max_batch_size"] for p in out["preferred_batch_sizes"]
    ):
        errors.setdefault("preferred_batch_sizes", []).append(
            f"Preferred batch sizes cannot exceed the max batch size ({out['max_batch_size']})."
        )
    if errors:
        raise ValidationError(errors)
    return out


def check_om_config(text: str, max_instances: int = MAX_INSTANCE_COUNT) -> str:
    """The config.pbtxt sent with a lone .om, as the platform will serve it: only the fields a tenant may set
    (seed style accepted), inputs and outputs required (an .om's signature comes from here on a host without
    the NPU). Returns the rendered text; ValidationError lists each refused field path."""
    try:
        cfg = build_served_config(
            text,
            name=UPLOADED_CONFIG_NAME,
            max_instance_count=max_instances,
            instance_limit=TEAM_INSTANCE_LIMIT,
        )
    except gc.ConfigError as exc:
        raise ValidationError({"config_text": [str(e) for e in exc.errors]}) from None
    return gc.render_config(cfg)


# ATC's documented choices; anything else would only fail minutes later inside the worker.
PRECISION_MODES = (
    "force_fp16",
    "force_fp32",
    "allow_fp32_to_fp16",
    "must_keep_origin_dtype",
    "allow_mix_precision",
)
INPUT_FORMATS = ("NCHW", "NHWC", "ND", "NCDHW", "NDHWC")
_SOC_VERSION = re.compile(r"^Ascend[0-9A-Za-z]{3,20}$")
_INPUT_SHAPE = re.compile(r"^[\w./:-]+:-?\d+(,-?\d+)*(;[\w./:-]+:-?\d+(,-?\d+)*)*$")
OPTION_KEYS = ("soc_version", "precision_mode", "input_format", "input_shape", "batch_gears")
# ATC's --dynamic_batch_size: 2 to 100 batch sizes (empty: 1, 2, 4, ... up to the max batch size).
MAX_GEAR = 4096


def check_conversion_options(version, options: dict | None) -> dict:
    """The conversion options with defaults filled in; raises ValidationError naming the bad option."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTION_KEYS))
    if unknown:
        raise ValidationError(
            {key: [f"Unknown conversion option; use {', '.join(OPTION_KEYS)}."] for key in unknown}
        )
    out = {key: str(options.get(key) or "").strip() for key in OPTION_KEYS}
    out["soc_version"] = out["soc_version"] or version.model.team.default_soc_version
    errors: dict[str, list[str]] = {}
    if not _SOC_VERSION.match(out["soc_version"]):
        errors["soc_version"] = [
            "Use the chip name from `npu-smi info` prefixed with Ascend, e.g. Ascend310P3."
        ]
    if out["precision_mode"] and out["precision_mode"] not in PRECISION_MODES:
        errors["precision_mode"] = [f"Use one of: {', '.join(PRECISION_MODES)}."]
    out["input_format"] = out["input_format"].upper()
    if out["input_format"] and out["input_format"] not in INPUT_FORMATS:
        errors["input_format"] = [f"Use one of: {', '.join(INPUT_FORMATS)}."]
    out["input_shape"] = out["input_shape"].replace(" ", "")
    if out["input_shape"] and not _INPUT_SHAPE.match(out["input_shape"]):
        errors["input_shape"] = [
            "Write it as ATC does: name:d0,d1,...;name2:... with -1 for the batch dimension."
        ]
    gears = _gears(options.get("batch_gears"))
    if gears is None:
        errors["batch_gears"] = [
            f"Give 2 to 100 different batch sizes from 1 to {MAX_GEAR}, e.g. 1,4,8,16 (ATC's --dynamic_batch_size)."
        ]
    else:
        out["batch_gears"] = ",".join(map(str, gears))
    if errors:
        raise ValidationError(errors)
    return out


def _gears(raw) -> list[int] | None:
    """The gears, sorted, from "1,4,8" or [1, 4, 8]; [] for none; None when they are not gears."""
    if raw in (None, "", []):
        return []
    parts = raw if isinstance(raw, list) else str(raw).replace(" ", "").split(",")
    if not all((isinstance(p, int) and not isinstance(p, bool)) or (isinstance(p, str) and p.isdigit() and len(p) < 6)
               for p in parts):  # fmt: skip
        return None
    gears = sorted({int(p) for p in parts})
    if not 2 <= len(gears) <= 100 or len(gears) != len(parts) or not 1 <= gears[0] <= gears[-1] <= MAX_GEAR:
        return None
    return gears
