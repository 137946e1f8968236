"""The seed article's config text, made parseable: its configs are printed with every quote stripped
(``name: resnet50``) and its ensemble ``step`` blocks at the top level. Used by ``backend_ge.config``."""

from __future__ import annotations

import re

from tritonclient.grpc import model_config_pb2

_STEP_BLOCK = re.compile(r"step\s*:?\s*([\[{])")


def wrap_seed_steps(text: str) -> str:
    """Move top-level ``step [...]`` blocks (the seed's ensemble layout) into ``ensemble_scheduling``."""
    out, steps, i, depth, n = [], [], 0, 0, len(text)
    while i < n:
        ch = text[i]
        if ch in "\"'":  # copy quoted strings untouched so brackets inside them do not count
            j = i + 1
            while j < n and text[j] != ch:
                j += 2 if text[j] == "\\" else 1
            out.append(text[i : j + 1])
            i = j + 1
            continue
        if ch == "#":
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(text[i:j])
            i = j
            continue
        m = _STEP_BLOCK.match(text, i) if depth == 0 else None
        if m and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            j, d = m.end(), 1
            while j < n and d:
                if text[j] in "[{":
                    d += 1
                elif text[j] in "]}":
                    d -= 1
                j += 1
            steps.append(text[i:j])
            i = j
            continue
        depth += ch in "[{"
        depth -= ch in "]}"
        out.append(ch)
        i += 1
    if not steps:
        return text
    return "".join(out) + "\nensemble_scheduling {\n" + "\n".join(steps) + "\n}\n"


def _string_field_names() -> frozenset[str]:
    """Every string-typed field name anywhere in ModelConfig (name, backend, key, string_value, ...)."""
    from google.protobuf.descriptor import FieldDescriptor

    seen, names = set(), set()

    def walk(descriptor) -> None:
        if descriptor.full_name in seen:
            return
        seen.add(descriptor.full_name)
        for field in descriptor.fields:
            if field.type == FieldDescriptor.TYPE_STRING:
                names.add(field.name)
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                walk(field.message_type)

    walk(model_config_pb2.ModelConfig.DESCRIPTOR)
    return frozenset(names)


_STRING_FIELDS = _string_field_names()
# `name: resnet50`: a string field followed by a bare word. Enum fields (data_type: TYPE_FP32) are not
# string fields, and numbers, quoted strings and `{` blocks do not match a bare word.
_BARE_STRING = re.compile(
    r"(?<![\w\"'])(" + "|".join(sorted(_STRING_FIELDS)) + r")(\s*:\s*)([A-Za-z_][\w.\-/]*)(?=[\s,\]}]|$)"
)


def quote_bare_strings(text: str) -> str:
    """The seed article prints configs with the quotes stripped (``name: resnet50``, ``string_value: 0``);
    quote bare values of string fields so such a config still parses."""

    def quote(match: re.Match) -> str:
        return f'{match.group(1)}{match.group(2)}"{match.group(3)}"'

    text = _BARE_STRING.sub(quote, text)
    # string_value: 0 (a number where a string is expected) is the seed's DEVICE_ID parameter.
    return re.sub(r"(?<![\w\"'])(string_value\s*:\s*)(-?\d[\w.]*)", r'\1"\2"', text)
