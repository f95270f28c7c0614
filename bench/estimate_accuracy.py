"""How far can estimates be trusted? Meta-tensor memory and roofline times against a real CPU step.

    python bench/estimate_accuracy.py              # writes bench/results/estimates.md

For each bundled example: the profile estimated for ``device="generic-cpu"`` (meta tensors,
roofline) next to the profile measured here. Memory: the estimated un-checkpointed peak and
the predicted peak of a plan made from the estimate, against ``measure_peak`` of real steps.
Time: Pearson and Spearman correlation, over nodes, of estimated and measured forward and
backward times (and of log times), plus the whole step.
"""

from __future__ import annotations

import argparse
import runpy
from pathlib import Path

import numpy as np
import torch

import planner
from planner.capture.inputs import as_inputs
from planner.common.budget import format_bytes
from planner.profiling.measure import measure_peak

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ("seed_cnn", "gpt", "resnet")


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(x: np.ndarray) -> np.ndarray:
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x))
        for value in np.unique(x):  # ties share their mean rank
            r[x == value] = r[x == value].mean()
        return r
    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(a, b)[0, 1])


def plan_from(model, inputs, loss_fn, prof):
    try:
        return planner.optimize(model, "60%", inputs=inputs, loss_fn=loss_fn, profile=prof), "60%"
    except planner.InfeasibleBudget as exc:
        return planner.optimize(model, exc.min_peak_bytes, inputs=inputs, loss_fn=loss_fn, profile=prof), "smallest"


def one(name: str) -> tuple[str, str]:
    example = runpy.run_path(str(ROOT / "examples" / f"{name}.py"))
    model, inputs, loss_fn = example["model"], example["inputs"], example["loss_fn"]
    example_inputs = as_inputs(model, inputs)
    estimated = planner.profile(model, inputs=inputs, loss_fn=loss_fn, device="generic-cpu")
    measured = planner.profile(model, inputs=inputs, loss_fn=loss_fn)
    real_peak = measure_peak(model, example_inputs, loss_fn)
    plan, budget = plan_from(model, inputs, loss_fn, estimated)
    planned_peak = measure_peak(plan.module, example_inputs, loss_fn)
    memory = (f"| {name} | {format_bytes(estimated.baseline_peak_bytes)} | {format_bytes(real_peak)} | "
              f"{100 * (estimated.baseline_peak_bytes - real_peak) / real_peak:+.3f}% | {budget}, "
              f"{len(plan.segments)} segments | {format_bytes(plan.predicted_peak_bytes)} | "
              f"{format_bytes(planned_peak)} | {100 * (plan.predicted_peak_bytes - planned_peak) / planned_peak:+.3f}% |")
    nodes = [i for i, n in enumerate(measured.nodes) if n.kind != "get_attr"]
    rows = []
    for field in ("fwd_ms", "bwd_ms"):
        est = np.array([getattr(estimated.nodes[i], field) for i in nodes])
        real = np.array([getattr(measured.nodes[i], field) for i in nodes])
        keep = (est > 0) & (real > 0)
        rows.append(f"{pearson(est, real):.2f} / {spearman(est, real):.2f} / "
                    f"{pearson(np.log(est[keep]), np.log(real[keep])):.2f}")
    time = (f"| {name} | {len(nodes)} | {rows[0]} | {rows[1]} | {estimated.step_ms:.1f} | {measured.step_ms:.1f} |")
    return memory, time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "bench/results/estimates.md"))
    args = p.parse_args()
    results = [one(name) for name in EXAMPLES]
    text = "\n".join([
        "# Estimates against measurements (CPU)",
        "",
        f"`python bench/estimate_accuracy.py`, torch {torch.__version__}, {torch.get_num_threads()} threads. "
        "Estimated = `planner.profile(model, ..., device=\"generic-cpu\")`: the step replayed on meta tensors "
        "(nothing allocated) with roofline times from `planner/profiling/device_specs/generic-cpu.json`. Measured = a "
        "real step here (`planner.profiling.measure.measure_peak`, the same live-storage ruler as the profiler).",
        "",
        "## Memory",
        "",
        "| example | estimated peak | measured peak | error | plan from the estimate | its predicted peak "
        "| measured | error |",
        "|---|---|---|---|---|---|---|---|",
        *(memory for memory, _ in results),
        "",
        "## Time (per node)",
        "",
        "Pearson / Spearman / Pearson of log times, estimated against measured, over the graph's nodes "
        "(median of 3 timed steps, node by node). The roofline knows FLOPs and bytes, not this CPU's "
        "kernels or the eager overhead of each node, so absolute times differ; what planning needs is the "
        "order: which nodes are expensive to recompute.",
        "",
        "| example | nodes | forward | backward | estimated step, ms | measured step, ms |",
        "|---|---|---|---|---|---|",
        *(time for _, time in results),
        "",
    ])
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
