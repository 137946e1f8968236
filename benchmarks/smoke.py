"""``--smoke``, shared by every benchmark: the same code path with tiny counts, a few seconds each.

The test suite runs each benchmark this way (``tests/benchmarks/test_smoke.py``) so a script that no longer
runs to the end fails ``make test``. A smoke run prints its figures like a real run; they are not judged: a
missed performance target does not change the exit code, a functional check (a checksum, SERVING against
Triton's readiness, a rollout's outcome) still does.
"""

from __future__ import annotations

import argparse

HELP = "tiny counts, a few seconds, the same code path; figures printed but not judged (make test runs it)"


def parse_args(
    parser: argparse.ArgumentParser, argv: list[str] | None = None, **smoke_values
) -> argparse.Namespace:
    """Add ``--smoke`` and parse. With ``--smoke``, each option named in ``smoke_values`` takes that value
    unless it is given on the command line too (``--smoke --models 5`` runs 5 models)."""
    parser.add_argument("--smoke", action="store_true", help=HELP)
    args = parser.parse_args(argv)
    unknown = sorted(set(smoke_values) - set(vars(args)))
    if unknown:  # a misspelt option would otherwise leave a full-size run in the test suite
        raise ValueError(f"smoke values for options the parser does not have: {', '.join(unknown)}")
    if args.smoke:
        parser.set_defaults(**smoke_values)
        args = parser.parse_args(argv)
    return args
