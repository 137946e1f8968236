"""Error text that tenants may read.

Errors raised on an inference host (a model that fails to load, a smoke inference that fails, Triton's own
messages) often carry Python tracebacks and absolute paths of the host: where the platform keeps its state,
the artifact store, other instances' repositories. Those are the operators' business, not a tenant's.
``public_error`` turns such an error into a summary without them; when it withheld anything it logs the full
text under a short id and puts the id into the summary, so an operator can find the details from what a
tenant reports.
"""

from __future__ import annotations

import logging
import re
import traceback
import uuid

log = logging.getLogger(__name__)

# A summary longer than this is cut (the full text is in the log under its id).
PUBLIC_ERROR_MAX_CHARS = 600

# An absolute path: starts after a space, a quote, a bracket, "=" or "," (not after ":" so URLs stay), and
# has at least two components, so "1/2", "and/or" and a lone "/" are left alone.
_ABSOLUTE_PATH = re.compile(r"""(?:^|(?<=[\s'"(\[=,]))/[^\s/'"()\[\],;:]+(?:/[^\s'"()\[\],;:]*)+""")
# Where a traceback starts: CPython's header, Triton python backend's "At:" frame list, a frame line.
_TRACEBACK_START = re.compile(r"Traceback \(most recent call last\):|\n\s*At:\s*\n|^\s+File \"", re.MULTILINE)
_ID_SUFFIX = re.compile(r"\(error id [0-9a-f]{12}; ")


def _last_exception_line(block: str) -> str:
    """The ``SomeError: message`` line that ends a CPython traceback, if there is one."""
    for line in reversed(block.strip().splitlines()):
        if line and not line[0].isspace() and not line.startswith("Traceback"):
            return line.strip()
    return ""


def summarize_error(text: str) -> tuple[str, bool]:
    """(the text without tracebacks and absolute paths, whether anything was withheld)."""
    original = text.strip()
    summary = original
    match = _TRACEBACK_START.search(summary)
    if match:
        head, tail = summary[: match.start()].rstrip(" :\n"), summary[match.start() :]
        cause = _last_exception_line(tail) if tail.startswith("Traceback") else ""
        summary = "; ".join(part for part in (head, cause) if part)
    summary = _ABSOLUTE_PATH.sub("<path>", summary)
    summary = " ".join(summary.split())  # one line
    if len(summary) > PUBLIC_ERROR_MAX_CHARS:
        summary = summary[: PUBLIC_ERROR_MAX_CHARS - 1].rstrip() + "…"
    withheld = summary != " ".join(original.split())
    return summary or "the operation failed", withheld


def public_error(error: BaseException | str) -> str:
    """A tenant-safe one-line summary of ``error``. When details were withheld, the full text (with the
    traceback of an exception) is logged under a new id and the summary ends with that id."""
    text = str(error) if isinstance(error, BaseException) else error
    if _ID_SUFFIX.search(text):
        return text  # already made public (e.g. a placement error quoted in a deployment's error)
    summary, withheld = summarize_error(text)
    if not withheld:
        return summary
    error_id = uuid.uuid4().hex[:12]
    full = text
    if isinstance(error, BaseException) and error.__traceback__ is not None:
        full = "".join(traceback.format_exception(error))
    log.error("error id %s: %s", error_id, full)
    return f"{summary} (error id {error_id}; an operator can look it up in the platform's logs)"
