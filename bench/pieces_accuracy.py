"""How close are per-node times measured in pieces (``planner.profiling.pieces``) to a whole step's?

    python bench/pieces_accuracy.py [--rounds 5] [--pieces 6 12] [--examples gpt_large gpt resnet]

For each example: the full-step ``Timer`` (as ``memory_pass.profile`` times a model) and a
``PieceTimer`` per piece count, one warm-up step each, then ``--rounds`` steps of each interleaved in
one process (the order rotating every round), one thread; per-node times are medians over rounds. A
second full-step ``Timer`` (``control``) gives the noise floor: the same statistics between two
whole-step timers, its per-piece ratios over the last piece count's pieces.
Forward and backward: the summed node times, the min-max over pieces of (piece sum / the same nodes'
full-step sum), the per-node ratio pieces/full (median [p10, p90], over all nodes and over nodes of
at least 0.1 ms in the full step) and Spearman's rank correlation of node times. Memory: peak live
bytes (``memtrack.LiveStorages``, parameters and inputs included) of one step of each. Prints
markdown; the machine's noise is not removed, so run it on an idle machine to compare runs.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # after OMP_NUM_THREADS, which torch reads on import
import runpy
from pathlib import Path

import numpy as np
import torch
from torch.utils._pytree import tree_leaves

from planner.capture.api import capture
from planner.capture.inputs import as_inputs
from planner.capture.step import untouched
from planner.profiling.memtrack import LiveStorages
from planner.profiling.pieces import PieceTimer, even_pieces, node_count
from planner.profiling.timing import Timer

ROOT = Path(__file__).resolve().parent.parent
HEAVY_MS = 0.1
"""Nodes at least this long in the full step (ms) get their own ratio quantiles."""


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(x: np.ndarray) -> np.ndarray:
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x))
        for value in np.unique(x):
            r[x == value] = r[x == value].mean()
        return r
    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def _quantiles(ratios: np.ndarray) -> str:
    if not len(ratios):
        return "-"
    p10, med, p90 = np.percentile(ratios, [10, 50, 90])
    return f"{med:.2f} [{p10:.2f}, {p90:.2f}]"


def compare(full: np.ndarray, parts: np.ndarray, pieces: list[tuple[int, int]]) -> str:
    """One table row's statistics (see the module docstring) of node times ``parts`` against ``full`` (ms)."""
    sums = [parts[lo:hi].sum() / full[lo:hi].sum() for lo, hi in pieces if full[lo:hi].sum() > 0]
    both = (full > 0) & (parts > 0)
    heavy = both & (full >= HEAVY_MS)
    ratios = parts / np.where(full > 0, full, 1.0)
    return (f"{full.sum():.1f} | {parts.sum():.1f} | {parts.sum() / full.sum():.3f} | "
            f"{min(sums):.2f}-{max(sums):.2f} | {_quantiles(ratios[both])} | {_quantiles(ratios[heavy])} "
            f"({heavy.sum()}) | {spearman(full[both], parts[both]):.3f}")


def _peak(timer: Timer, model, inputs, loss_fn) -> int:
    """Peak live bytes of one step of ``timer`` (parameters, buffers and inputs counted)."""
    with LiveStorages() as tracker:
        for tensor in [*model.parameters(), *model.buffers(), *tree_leaves((inputs.args, inputs.kwargs))]:
            if isinstance(tensor, torch.Tensor):
                tracker.track(tensor)
        timer.step(inputs, loss_fn)
    return tracker.peak_bytes


def one(name: str, piece_counts: list[int], rounds: int) -> tuple[list[str], list[str]]:
    """Time and memory rows for ``examples/<name>.py``."""
    example = runpy.run_path(str(ROOT / "examples" / f"{name}.py"))
    model, loss_fn = example["model"], example["loss_fn"]
    inputs = as_inputs(model, example["inputs"])
    gm = capture(model, inputs).graph_module
    n, cpu = node_count(gm), torch.device("cpu")
    plans = {k: even_pieces(n, k) for k in piece_counts}
    plans["control"] = plans[piece_counts[-1]]
    with untouched(model):
        Timer(gm, cpu).step(inputs, loss_fn)  # warm-up
        timers: dict = {"full": Timer(gm, cpu), "control": Timer(gm, cpu),
                        **{k: PieceTimer(gm, cpu, plans[k]) for k in piece_counts}}
        for k in piece_counts:  # warm-up; learns which crossing values get gradients
            timers[k].step(inputs, loss_fn)
            timers[k].clear_times()
        order = list(timers)
        for r in range(rounds):
            for k in order[r % len(order):] + order[:r % len(order)]:
                timers[k].step(inputs, loss_fn)
        peaks = {k: _peak(timers[k], model, inputs, loss_fn) for k in ["full", *piece_counts]}
    times = {k: {d: np.array([getattr(t, f"{d}_ms")(i) for i in range(n + 1)]) for d in ("fwd", "bwd")}
             for k, t in timers.items()}
    time_rows = [f"| {name} | {n + 1} | {k} | {d} | " + compare(times["full"][d], times[k][d], plans[k]) + " |"
                 for k in ["control", *piece_counts] for d in ("fwd", "bwd")]
    memory_rows = [f"| {name} | {k} | {peaks[k] / 2 ** 20:.1f} | {peaks[k] / peaks['full']:.2f} |" for k in peaks]
    return time_rows, memory_rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", nargs="+", default=["gpt_large", "gpt", "resnet"])
    p.add_argument("--pieces", nargs="+", type=int, default=[6, 12])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    results = [one(name, args.pieces, args.rounds) for name in args.examples]
    print("\n".join([
        f"torch {torch.__version__}, {torch.get_num_threads()} thread, {args.rounds} interleaved rounds; "
        "times in ms, medians over rounds; ratio = pieces / full step",
        "",
        "| example | nodes | pieces | pass | full step | in pieces | sum ratio | per-piece sum ratio "
        f"| node ratio med [p10, p90] | nodes >= {HEAVY_MS} ms: ratio (count) | Spearman |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *(row for rows, _ in results for row in rows),
        "",
        "| example | pieces | peak live MiB | vs full step |",
        "|---|---|---|---|",
        *(row for _, rows in results for row in rows),
    ]))


if __name__ == "__main__":
    main()
