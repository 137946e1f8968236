"""A model's last counters, read on the host just before its versions are unloaded.

Triton forgets a version's counters when it unloads it, so whatever it served since the platform's last
scrape would never be counted. The host reads them first and reports them with its placement result; the
platform folds them into the per-version rows exactly once (``apps.monitoring.final_counts``). No Django
here: the payload is plain JSON, parsed on the platform with the scraper's own parser.
"""

from __future__ import annotations

import re
import urllib.request
from datetime import UTC, datetime

from backend_ge.runtime import TritonError, TritonServer

# The host keeps only the lines of the model it unloads: the rest of the instance is none of this report's business.
MAX_METRICS_CHARS = 256 * 1024


def _model_lines(text: str, name: str, versions: set[str] | None) -> str:
    label = f'model="{name}"'  # the closing quote keeps "<name>__candidate" out
    kept = []
    for line in text.splitlines():
        if line.startswith("#"):
            kept.append(line)  # HELP/TYPE: the parser needs the family types
            continue
        if label not in line:
            continue
        if versions is not None:
            match = re.search(r'version="([^"]*)"', line)
            if match is None or match.group(1) not in versions:
                continue
        kept.append(line)
    return "\n".join(kept)[:MAX_METRICS_CHARS] + "\n"


def read_final_counts(
    server: TritonServer, name: str, versions: list[int] | None = None, timeout: float = 5.0
) -> dict:
    """What Triton has counted for ``versions`` of model ``name`` (every loaded version when None), as a
    JSON-able report: the model's lines of ``/metrics``, its statistics, the server's process id and when
    the reading started. Raises ``TritonError`` or ``OSError`` when the server does not answer."""
    wanted = None if versions is None else {str(v) for v in versions}
    read_at = datetime.now(UTC)
    with urllib.request.urlopen(server.metrics_url, timeout=timeout) as response:
        text = response.read().decode("utf-8", errors="replace")
    statistics = [
        entry
        for entry in server.model_statistics(name)
        if wanted is None or str(entry.get("version", "")) in wanted
    ]
    if server.process is None:
        raise TritonError(f"{name}: the server is not running")
    return {
        "model": name,
        "versions": sorted(wanted) if wanted is not None else None,
        "server_id": str(server.process.pid),
        "read_at": read_at.isoformat(),
        "metrics": _model_lines(text, name, wanted),
        "statistics": statistics,
    }
