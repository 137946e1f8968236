"""The stand-in for asyncio that keeps it (and ssl) out of every python stub, without Triton.

Each check runs in a fresh interpreter: the stand-in only matters where asyncio was never imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent(
    """
    import json, sys
    from backend_ge import stub_imports

    registered = stub_imports.defer_asyncio()
    import asyncio

    async def coro():
        return 1

    def gen():
        yield 1

    samples = [coro(), gen(), [], None, object()]
    answers = [asyncio.iscoroutine(x) for x in samples]
    deferred = not any(m in sys.modules for m in ("asyncio.events", "ssl", "concurrent.futures"))
    loop = asyncio.new_event_loop()  # anything beyond iscoroutine loads the real module
    loop.close()
    import asyncio as again
    expected = [again.iscoroutine(x) for x in samples]
    samples[0].close()
    print(json.dumps({"registered": registered, "answers": answers, "expected": expected,
                      "deferred": deferred, "real_after_use": "asyncio.events" in sys.modules,
                      "run_module": again.run.__module__}))
    """
)


def _probe(prefix: str = "") -> dict:
    out = subprocess.run(
        [sys.executable, "-c", prefix + PROBE], capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(out.stdout)


def test_iscoroutine_answers_like_asyncio_without_importing_it():
    result = _probe()
    assert result["registered"] is True
    assert result["answers"] == result["expected"] == [True, True, False, False, False]
    assert result["deferred"] is True


def test_any_other_use_brings_in_the_real_asyncio():
    result = _probe()
    assert result["real_after_use"] is True
    assert result["run_module"] == "asyncio.runners"


def test_an_already_imported_asyncio_is_left_alone():
    result = _probe("import asyncio\n")
    assert result["registered"] is False
    assert result["deferred"] is False
    assert result["answers"] == [True, True, False, False, False]
