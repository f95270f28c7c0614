"""The model fuzzer at scale: hundreds of random block models, each planned at random budgets.

    python bench/reliability.py --seeds 200            # prints the table for bench/results/reliability.md

Each model is drawn by ``tests/fuzz.py:random_model`` and checked by ``tests/fuzz.py:check_budget``
(the same checks as tests/test_fuzz.py): loss, gradients and BatchNorm buffers equal to the
un-checkpointed model's; measured peak within the budget; prediction error; an "infeasible" answer
confirmed by measuring every block checkpointed by hand.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fuzz import Outcome, budgets, check_budget, loss_fn, random_model  # noqa: E402

from planner.pipeline import prepare  # noqa: E402


def fuzz(seeds: range, per_model: int) -> tuple[list[tuple[int, str, Outcome]], Counter]:
    outcomes, paths = [], Counter()
    for seed in seeds:
        drawn = random_model(seed)
        prepared = prepare(drawn.model, inputs=drawn.inputs, loss_fn=loss_fn, keep_output=drawn.keep_output)
        paths[prepared.captured.method.label] += 1
        rng = random.Random(seed)
        for budget in budgets(prepared, rng, per_model):
            outcome = check_budget(drawn, prepared, budget, selective=rng.random() < 0.5)
            outcomes.append((seed, drawn.describe(), outcome))
            for problem in outcome.problems():
                print(f"{drawn.describe()}: budget {budget} B: {problem}", flush=True)
    return outcomes, paths


def table(outcomes: list[tuple[int, str, Outcome]], paths: Counter, seeds: range, seconds: float) -> str:
    feasible = [o for _, _, o in outcomes if o.feasible]
    errors = [o.prediction_error for o in feasible]
    over = [e for e in errors if e > 0.01]
    infeasible = [o for _, _, o in outcomes if not o.feasible]
    rows = [
        ("models fuzzed", f"{len(seeds)} (seeds {seeds.start}..{seeds.stop - 1}; "
                          + ", ".join(f"{n} {label}" for label, n in paths.items()) + ")"),
        ("budgets tried", f"{len(outcomes)} ({len(feasible)} planned, {len(infeasible)} answered infeasible)"),
        ("gradient / loss / buffer mismatches", str(sum(o.max_grad_error > 0 for _, _, o in outcomes))),
        ("budget violations (measured > budget)", str(sum(o.measured_bytes > o.budget_bytes for o in feasible))),
        ("infeasible while every block by hand fits",
         str(sum(o.hand_bytes <= o.budget_bytes for o in infeasible))),
        ("worst under-prediction", f"{100 * min([*errors, 0.0]):+.2f}%"),
        ("worst over-prediction", f"{100 * max([*errors, 0.0]):+.2f}%"),
        ("plans predicted within 1%", f"{sum(abs(e) <= 0.01 for e in errors)} of {len(errors)}"),
        ("plans over-predicted by more than 1%", f"{len(over)}"),
        ("wall time", f"{seconds / 60:.1f} min"),
    ]
    return "\n".join(["| check | result |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=200, help="models to draw (seeds 0..N-1 after --first)")
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--budgets", type=int, default=3, help="random budgets per model")
    args = p.parse_args()
    seeds = range(args.first, args.first + args.seeds)
    began = time.perf_counter()
    outcomes, paths = fuzz(seeds, args.budgets)
    print(table(outcomes, paths, seeds, time.perf_counter() - began))


if __name__ == "__main__":
    main()
