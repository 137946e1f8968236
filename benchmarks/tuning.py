"""Serving-config tuning on this machine: the tuned config against the generated default at the same p99
objective, the batching gain with the tuned config, and what the search cost.

For each model (the seed's MLP and ResNet-50 examples, their generated configs) a real tritonserver serves a
scratch copy, and ``backend_ge.tuning`` searches from the generated config - dynamic batching, max batch size,
queue delay, preferred size, instance count - measuring each candidate at rising concurrency until its p99
passes the objective. Then, side by side in the same run, the tuned config at ``--gain-concurrency`` with
dynamic batching on and off: the batching gain the seed puts at 3.6x.

Figures: the default's and the tuned config's most throughput within the objective and their ratio (target
for the MLP: >= 1.3x, or the measured reason) - both measured again after the search, interleaved
(``--recheck-rounds``, the medians), since the search measured them minutes apart on a shared machine -, the
batching gain, and the search's wall time, candidates and
points. ``--json FILE`` writes them per model, with ``tuned_over_default`` and ``batching_gain`` of the MLP
at the top level.

Usage: ``python benchmarks/tuning.py [--models mlp,resnet50] [--mlp-p99-ms 10] [--resnet50-p99-ms 1500]
[--budget-s 300] [--max-candidates 12] [--max-instances 2] [--recheck-rounds 3] [--brute] [--json FILE]
[--smoke]``

``--brute`` also measures every candidate of a reduced grid (max batch sizes from 8 up, queue delays 0, 100,
500 and 2000 us, preferred size none or one, each instance count) as the reference the bounded search is judged
by: the share of the reference's best throughput the search reached, with what share of the space.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend_ge import config as ge_config  # noqa: E402
from backend_ge import examples, tuning, tuning_measure, tuning_reference  # noqa: E402
from backend_ge.runtime import TritonServer  # noqa: E402
from benchmarks import smoke  # noqa: E402

SEED_BATCHING_GAIN = 3.6
MLP_TARGET = 1.3

# Per model: concurrencies swept, requests per point (at least per_stream per client stream).
PROFILES = {
    "mlp": {"concurrencies": (1, 2, 4, 8, 16, 32), "requests": 600, "per_stream": 25},
    "resnet50": {"concurrencies": (1, 2, 4, 8, 16), "requests": 48, "per_stream": 4},
}


def tune_model(server: TritonServer, repo: Path, name: str, args) -> dict:
    scratch = f"{name}_scratch"
    shutil.copytree(repo / name, repo / scratch)
    cfg = ge_config.parse_config((repo / name / "config.pbtxt").read_text())
    profile = PROFILES[name]
    concurrencies = tuple(c for c in profile["concurrencies"] if c <= args.max_concurrency)
    measure = tuning_measure.TritonMeasure(
        server, scratch, cfg, requests=args.requests or profile["requests"], per_stream=profile["per_stream"]
    )
    objective = tuning.Objective(p99_ms=getattr(args, f"{name}_p99_ms"))
    default = tuning.Candidate.from_config(cfg)
    try:
        result = tuning.tune(
            measure,
            default,
            tuning.Limits(cfg.max_batch_size, max_instances=args.max_instances, concurrencies=concurrencies),
            objective,
            budget_s=args.budget_s,
            max_candidates=args.max_candidates,
            log=lambda line: print(f"  {name}: {line}", flush=True) if args.verbose else None,
        )
        tuned = result.recommended or result.closest or default
        recheck = _recheck(measure, result, default, tuned, objective, args.recheck_rounds)
        gain_at = min(args.gain_concurrency, max(concurrencies))
        on = measure(dataclasses.replace(tuned, dynamic_batching=True), gain_at)
        off = measure(
            dataclasses.replace(tuned, dynamic_batching=False, max_queue_delay_us=0, preferred=()), gain_at
        )
        brute = None
        if args.brute:
            reference = tuning.Limits(
                cfg.max_batch_size,
                gears=tuple(
                    b for b in tuning.Limits(cfg.max_batch_size).batch_sizes() if b >= BRUTE_MIN_BATCH
                ),
                max_instances=args.max_instances,
                concurrencies=concurrencies,
            )
            space = tuning_reference.grid(default, reference, delays=BRUTE_DELAYS_US)
            brute = tuning_reference.brute_force(
                measure, space, reference, objective, budget_s=args.brute_budget_s
            )
    finally:
        measure.close()
    brute_figures = {}
    if brute is not None:
        best = brute.score(brute.recommended) if brute.recommended else None
        brute_figures = {
            "brute_space": len(space),
            "brute_candidates": len(brute.candidates()),
            "brute_points": len(brute.points),
            "brute_wall_s": round(brute.wall_s, 1),
            "brute_best_rps": best,
            "brute_best": brute.recommended.label() if brute.recommended else None,
            "brute_stopped": brute.stopped,
            "search_of_brute": (result.score(tuned) / best) if best and result.score(tuned) else None,
        }
    return {
        "objective": objective.describe(),
        "default": default.label(),
        "default_rps": result.score(default),
        "tuned": tuned.label(),
        "tuned_rps": result.score(tuned),
        "search_tuned_over_default": result.tuned_over_default(),
        # The ratio reported: both configs measured again, interleaved, at their best concurrency within the
        # objective (the median of each) - the search's own figures come from different minutes.
        "tuned_over_default": recheck.get("ratio", result.tuned_over_default()),
        "recheck": recheck,
        "message": result.message(),
        "gain_concurrency": gain_at,
        "batched_rps": on.throughput_rps,
        "unbatched_rps": off.throughput_rps,
        "batching_gain": on.throughput_rps / off.throughput_rps if off.throughput_rps else None,
        "search_wall_s": round(result.wall_s, 1),
        "candidates": len(result.candidates()),
        "points": len(result.points),
        "stopped": result.stopped,
        "curve": [p.as_dict() for p in result.points],
        **brute_figures,
    }


def _recheck(measure, result, default, tuned, objective, rounds: int) -> dict:
    """Default and tuned measured again ``rounds`` times each, alternately, each at the concurrency where it
    served the most within the objective: {"default_rps": [...], "tuned_rps": [...], "ratio"} (the ratio of
    the medians; a run whose p99 passed the objective counts as 0). Empty when there is nothing to compare."""
    if tuned == default or rounds < 1:
        return {}
    at = {}
    for candidate in (default, tuned):
        met = [p for p in result.points_of(candidate) if objective.met_by(p)]
        if not met:
            return {}
        at[candidate] = max(met, key=lambda p: p.throughput_rps).concurrency
    figures: dict[str, list[float]] = {"default_rps": [], "tuned_rps": []}
    for _ in range(rounds):
        for key, candidate in (("default_rps", default), ("tuned_rps", tuned)):
            point = measure(candidate, at[candidate])
            figures[key].append(round(point.throughput_rps, 1) if objective.met_by(point) else 0.0)
    base = statistics.median(figures["default_rps"])
    return {
        **figures,
        "concurrency": {"default": at[default], "tuned": at[tuned]},
        "ratio": statistics.median(figures["tuned_rps"]) / base if base else None,
    }


BRUTE_DELAYS_US = (0, 100, 500, 2000)
BRUTE_MIN_BATCH = 8


def _rps(value) -> str:
    return "none within the objective" if value is None else f"{value:,.0f} req/s"


def print_report(name: str, r: dict, smoke_run: bool) -> None:
    ratio = r["tuned_over_default"]
    print(f"{name}: objective {r['objective']}")
    print(f"{name}: default {_rps(r['default_rps'])} ({r['default']})")
    print(f"{name}: tuned {_rps(r['tuned_rps'])} ({r['tuned']})")
    if ratio is None:
        print(f"{name}: tuned / default: n/a - {r['message']}")
    else:
        verdict = ""
        if name == "mlp" and not smoke_run:
            verdict = " (target >= 1.3x: " + ("met" if ratio >= MLP_TARGET else "MISSED") + ")"
        print(f"{name}: tuned / default: {ratio:.2f}x{verdict}")
    if r["recheck"]:
        c = r["recheck"]
        search = r["search_tuned_over_default"]
        print(
            f"{name}:   measured again, interleaved ({len(c['tuned_rps'])} rounds): default {c['default_rps']} "
            f"req/s at concurrency {c['concurrency']['default']}, tuned {c['tuned_rps']} at "
            f"{c['concurrency']['tuned']}; the search's own figures said "
            + (f"{search:.2f}x" if search else "n/a")
        )
    gain = r["batching_gain"]
    print(
        f"{name}: batching gain at concurrency {r['gain_concurrency']}: "
        + (f"{gain:.2f}x" if gain else "n/a")
        + f" ({r['batched_rps']:,.0f} vs {r['unbatched_rps']:,.0f} req/s; the seed's {SEED_BATCHING_GAIN}x)"
    )
    print(
        f"{name}: search {r['search_wall_s']:.1f} s, {r['candidates']} candidates, {r['points']} points, "
        f"stopped: {r['stopped']}"
    )
    if "brute_space" in r:
        share = r["search_of_brute"]
        print(
            f"{name}: brute force over {r['brute_space']} candidates ({r['brute_candidates']} measured, "
            f"{r['brute_points']} points, {r['brute_wall_s']:.1f} s, stopped: {r['brute_stopped']}): best "
            f"{_rps(r['brute_best_rps'])}; the search reached "
            + (f"{share * 100:.0f} %" if share else "n/a")
            + f" of it with {r['candidates']} candidates ({r['candidates'] / r['brute_space'] * 100:.0f} % of the space)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,resnet50", help="comma-separated: mlp, resnet50")
    parser.add_argument("--mlp-p99-ms", type=float, default=10.0)
    parser.add_argument("--resnet50-p99-ms", type=float, default=1500.0)
    parser.add_argument("--budget-s", type=float, default=300.0, help="each model's search time budget")
    parser.add_argument("--max-candidates", type=int, default=12)
    parser.add_argument("--max-instances", type=int, default=2)
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument("--gain-concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=0, help="requests per point (0: the model's profile)")
    parser.add_argument(
        "--brute", action="store_true", help="also measure every candidate of a reduced grid (the reference)"
    )
    parser.add_argument("--brute-budget-s", type=float, default=1800.0)
    parser.add_argument(
        "--recheck-rounds", type=int, default=3, help="default and tuned measured again, interleaved"
    )
    parser.add_argument("--verbose", action="store_true", help="print every point as it is measured")
    parser.add_argument("--json", metavar="FILE")
    args = smoke.parse_args(
        parser, argv, models="mlp", budget_s=20.0, max_candidates=3, max_concurrency=4, gain_concurrency=4,
        requests=40, brute=True, brute_budget_s=5.0, recheck_rounds=1,
    )  # fmt: skip
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = sorted(set(names) - set(PROFILES))
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; known: {', '.join(PROFILES)}")

    work = Path(tempfile.mkdtemp(prefix="tuning-bench-"))
    repo = work / "repository"
    examples.write_examples(repo, names)
    figures: dict[str, dict] = {}
    server = TritonServer(repo, workdir=work / "triton", exit_timeout=10, auto_complete_config=False)
    try:
        server.start(timeout=120)
        for name in names:
            figures[name] = tune_model(server, repo, name, args)
            print_report(name, figures[name], args.smoke)
    finally:
        server.stop(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    first = figures.get("mlp") or next(iter(figures.values()))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "tuned_over_default": first["tuned_over_default"],
                    "batching_gain": first["batching_gain"],
                    "models": figures,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
