"""ckplan against torchvision's DenseNet-121 ``memory_efficient=True``, at that model's measured peak.

torchvision does not import beside the torch 2.13 CPU wheel this project installs, so this runs in a
venv of its own (the machine notes: torch 2.14.1 + torchvision 0.29.1, a CUDA build that runs on CPU)::

    python3 -m venv /work/tv-venv && . /work/tv-venv/bin/activate
    pip install torch==2.14.1 torchvision==0.29.1 ortools==9.15.6755 numpy rich matplotlib networkx
    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/densenet.py --runs 9    # bench/results/densenet.md

``memory_efficient`` checkpoints each dense layer's concatenation + BN + ReLU + 1x1 conv (the
"bottleneck"), torchvision's own hand placement. The two models share weights. Its peak is measured
(live tensor storages, ``measure_peak``: a plain loop, the output kept through backward); ckplan plans
the plain model at exactly that peak with its defaults (selective, 64 chunks to start with, refined
finer while it pays) under each of ``--time-limits`` (DenseNet-121 has 310 cut positions, and
``memory_efficient``'s placement needs two per dense layer, 116 in all); the modules are timed
interleaved (``step_samples_ms``, one thread). Overhead = median step over the plain model's median, minus 1.
The ``memory_efficient`` row's predictions are ckplan's memory model evaluated on that placement
(each layer's ``cat`` .. ``conv1``), which ckplan did not choose.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


def main() -> None:
    import torchvision

    from planner.capture.inputs import as_inputs
    from planner.pipeline import plan_for, prepare
    from planner.planning.prepared import chunked
    from planner.profiling.measure import measure_peak, step_samples_ms
    from planner.solve.rotor import relaxed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--max-chunks", type=int, default=64)
    parser.add_argument("--time-limits", type=float, nargs="+", default=[30.0, 120.0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "densenet.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torchvision.models.densenet121(num_classes=10)
    hand = torchvision.models.densenet121(num_classes=10, memory_efficient=True)
    hand.load_state_dict(model.state_dict())
    x = torch.randn(args.batch, 3, args.size, args.size)
    labels = torch.randint(0, 10, (args.batch,))
    loss_fn = lambda out: torch.nn.functional.cross_entropy(out, labels)
    example = as_inputs(model, (x,))
    peak = measure_peak(hand, example, loss_fn)
    prepared = prepare(model, inputs=(x,), loss_fn=loss_fn, max_chunks=args.max_chunks)
    plans = {f"ckplan, time_limit_s={limit:g}": plan_for(prepared, peak, time_limit_s=limit)
             for limit in args.time_limits}
    every = chunked(prepared, 10_000)  # every cut position
    hand_peak, hand_overhead = _hand_prediction(every)
    bound = relaxed(every.memory, peak)[1] / every.memory.step_us  # no whole-segment plan re-runs less
    samples = step_samples_ms([model, hand, *(p.module for p in plans.values())], example, loss_fn, runs=args.runs)
    base = statistics.median(samples[0])

    def overhead(times: list[float]) -> str:
        return (f"{statistics.median(times) / base - 1:+.1%} ({min(times) / base - 1:+.1%} .. "
                f"{max(times) / base - 1:+.1%})")

    rows = [f"| memory_efficient=True (torchvision) | 58 / 0 | {mib(hand_peak)} / {mib(peak)} | {hand_overhead:+.1%} | "
            f"{overhead(samples[1])} | (by hand) |"]
    for (kind, plan), times in zip(plans.items(), samples[2:]):
        saves = sum(len(s.saved_nodes) for s in plan.segments)
        rows.append(f"| {kind} at its peak | {len(plan.segments)} / {saves} | {mib(plan.predicted_peak_bytes)} / "
                    f"{mib(measure_peak(plan.module, example, loss_fn))} | {plan.predicted_overhead:+.1%} | "
                    f"{overhead(times)} | {plan.solver_status}, {plan.solve_time_s:.1f} s |")
    rows.append(f"| (un-checkpointed) | | {mib(prepared.baseline.peak_bytes)} | | {base:.0f} ms per step | |")
    head = ["# ckplan against torchvision DenseNet-121 `memory_efficient`, at its measured peak", "",
            f"`OMP_NUM_THREADS=1 PYTHONPATH=. python bench/densenet.py --batch {args.batch} --size {args.size} "
            f"--runs {args.runs} --max-chunks {args.max_chunks} --time-limits {' '.join(f'{t:g}' for t in args.time_limits)}` on {platform.machine()}, torch {torch.__version__}, torchvision "
            f"{torchvision.__version__}, CPU, 1 thread; batch {args.batch}x3x{args.size}x{args.size}, 10 classes, "
            "cross-entropy. Peaks in MiB (predicted / measured live tensor storages, a plain loop). Overhead: median "
            f"of {args.runs} interleaved steps over the plain model's median, minus 1 (fastest .. slowest).", "",
            "| module | segments / saves | peak pred / meas | overhead pred | overhead meas | solver |",
            "|---|---|---|---|---|---|"]
    rows += ["", f"Lower bound over every cut position ({every.regions.n_chunks}), whole segments (the chunk DP's "
                 f"relaxation at {mib(peak)} MiB): {bound:+.1%} predicted, {1 - bound / hand_overhead:.0%} below the "
                 "hand placement's prediction."]
    Path(args.out).write_text("\n".join(head + rows) + "\n")
    print("\n".join(head + rows))


def _hand_prediction(prepared) -> tuple[int, float]:
    """ckplan's predicted peak and overhead of ``memory_efficient``'s placement: in each dense layer, the
    ``cat`` of the earlier features through ``conv1`` (torchvision's ``bn_function``), checkpointed."""
    from planner.memory.simulate import segment_recompute_us, simulate

    names = [n.name for n in prepared.profile.nodes]
    starts = prepared.regions.starts
    chunk = {b: k for k, b in enumerate(starts)} | {prepared.regions.end: len(starts)}
    plan = []
    for i, name in enumerate(names):
        if "denselayer" in name and name.endswith("_conv1"):
            cat = max(j for j in range(i) if names[j].startswith("cat"))
            plan.append((chunk[cat], chunk[i + 1]))  # KeyError: that cut position is not among the chunks
    recompute = sum(segment_recompute_us(prepared.memory, a, b) for a, b in plan)
    return simulate(prepared.memory, tuple(plan)).peak_bytes, recompute / (prepared.profile.step_ms * 1000)


if __name__ == "__main__":
    main()
