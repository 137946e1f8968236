"""FAKE ``atc``: replays a recorded real ATC run (``recorded/atc``) line by line with its exit code and, like
ATC, writes ``<output>.om`` on success - only into a directory that already exists, so a replay never
litters the working tree.

Environment (set by the tests' ``fake_atc`` fixture and by ``npu-check --fake``):

- ``FAKE_ATC_FIXTURE``: the recording (a name in ``recorded/atc`` or a path); ``FAKE_ATC_EXIT`` its exit code
  (default: the recording's own, from ``fixtures.json``).
- ``FAKE_ATC_BY_MODEL``: JSON ``{"<model file stem>": "<recording>"}``, a recording per ``--model``.
- ``FAKE_ATC_OM=pyacl``: on success write a fake om that ``FakeAcl`` runs (the ONNX model of ``--model``
  with the ``--dynamic_batch_size`` gears); otherwise a few placeholder bytes.
- ``FAKE_ATC_ARGV``: write the argument vector there as JSON (and the pid to ``<file>.pids``).
- ``FAKE_ATC_SLEEP``, ``FAKE_ATC_LINE_DELAY``: seconds before the output, between lines;
  ``FAKE_ATC_SLEEP_ONCE``: sleep that long on the first run only (marker file next to ``FAKE_ATC_ARGV``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from backend_ge.fakes import ATC_RECORDINGS, atc_exit_codes, refuse_unless_enabled

DEFAULT_RECORDING = "success_yolox"


def _options(argv: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)


def _recording(options: dict[str, str]) -> tuple[Path, int]:
    by_model = json.loads(os.environ.get("FAKE_ATC_BY_MODEL") or "{}")
    stem = Path(options.get("model", "")).stem
    if stem in by_model:
        name = by_model[stem]
        return ATC_RECORDINGS / f"{name}.txt", atc_exit_codes()[name]
    name = os.environ.get("FAKE_ATC_FIXTURE", DEFAULT_RECORDING)
    path = Path(name) if os.sep in name else ATC_RECORDINGS / f"{name}.txt"
    code = os.environ.get("FAKE_ATC_EXIT")
    return path, int(code) if code is not None else atc_exit_codes()[path.stem]


def _write_om(options: dict[str, str], target: str) -> None:
    model = options.get("model", "")
    if os.environ.get("FAKE_ATC_OM") == "pyacl" and model.endswith(".onnx") and os.path.isfile(model):
        import onnx

        from backend_ge.fakes.pyacl import write_fake_om

        gears = [int(g) for g in options.get("dynamic_batch_size", "").split(",") if g.strip()]
        write_fake_om(onnx.load(model), target, gears)
    else:
        with open(target, "wb") as fh:
            fh.write(b"fake om compiled by the test atc")


def main() -> None:
    refuse_unless_enabled("atc")
    argv = sys.argv[1:]
    record = os.environ.get("FAKE_ATC_ARGV")
    if record:
        with open(record, "w") as fh:
            json.dump(argv, fh)
        with open(record + ".pids", "a") as fh:
            fh.write(f"{os.getpid()} {os.getppid()}\n")
        marker = record + ".ran"
        once = float(os.environ.get("FAKE_ATC_SLEEP_ONCE", "0"))
        first = not os.path.exists(marker)
        open(marker, "a").close()
        if once and first:
            print("ATC start working now, please wait for a moment.", flush=True)
            time.sleep(once)
    time.sleep(float(os.environ.get("FAKE_ATC_SLEEP", "0")))
    options = _options(argv)
    path, code = _recording(options)
    delay = float(os.environ.get("FAKE_ATC_LINE_DELAY", "0"))
    with open(path, encoding="utf-8") as recording:
        for line in recording:
            print(line, end="", flush=True)
            time.sleep(delay)
    output = options.get("output", "")
    if code == 0 and output and os.path.isdir(os.path.dirname(output)):
        _write_om(options, output + ".om")
    sys.exit(code)
