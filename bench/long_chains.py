"""ckplan on long chains against the placements people write by hand, each at that placement's measured peak.

    python bench/long_chains.py                        # writes bench/results/long_chains.md
    python bench/long_chains.py --cases chain-100 rnn-512 --runs 3

Cases: ``chain-N``, an ``nn.Sequential`` of N residual MLP blocks (width 64, batch 256: 64 KiB across each block
edge), against ``checkpoint_sequential`` with √N segments and every block checkpointed; ``rnn-512``,
``examples/rnn.py``'s LSTM unrolled over 512 steps (torch.fx), against groups of 23 steps and every step;
``eager-rnn-512``, the same network that torch.fx cannot trace (module hooks), against every call of the cell;
``state-rnn-512``, ``examples/rnn.py``'s ``StateRNN`` (an ``nn.LSTMCell``, width 256, over 512 steps in a loop that
hands on only its state, the head on the last ``h``, batch 64, 1,000 tokens; module hooks), against every call of
the cell checkpointed by hand.

For each hand placement: its peak measured (at the allocator, ``measure_peak``: a plain loop, the output kept
through backward); ckplan plans at exactly that peak with default options (the model captured and profiled once:
"prepare", then the solve per budget; prepare split into capture and profile, by the ``progress`` stages); the
planned module's peak measured. The un-checkpointed model, the
placement and the plan are timed interleaved (``step_samples_ms``: ``--runs`` rounds of one step each after a
warm-up round; one thread): overhead = median step time over the un-checkpointed median, minus 1. "Bound" is the
relaxed chunk DP's lower bound on the recompute of any plan with a cut at every block edge, at that peak.
"""

from __future__ import annotations

import argparse
import gc
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from compare_strategies import example_module  # noqa: E402


class Residual(nn.Module):
    """``x + fc2(relu(fc1(x)))``, ``fc1`` ``expand`` times as wide as ``x``."""

    def __init__(self, width: int, expand: int = 2) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, expand * width), nn.Linear(expand * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Hand(nn.Module):
    """``blocks`` checkpointed by hand: ``checkpoint_sequential`` in ``segments`` segments, or (``segments=0``)
    every block under its own checkpoint."""

    def __init__(self, blocks: nn.Sequential, segments: int) -> None:
        super().__init__()
        self.blocks, self.segments = blocks, segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.segments:
            return checkpoint_sequential(self.blocks, self.segments, x, use_reentrant=False)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


class EveryCall(nn.Module):
    """``StateRNN`` with every call of its cell checkpointed by hand (``hand``), a module of its own for timing."""

    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.rnn.hand = True
        try:
            return self.rnn(ids)
        finally:
            self.rnn.hand = False


class Grouped(nn.Module):
    """The RNN with its ``hand_groups`` set: a module of its own for timing side by side."""

    def __init__(self, rnn: nn.Module, groups: int) -> None:
        super().__init__()
        self.rnn, self.groups = rnn, groups

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.rnn.hand_groups = self.groups
        try:
            return self.rnn(ids)
        finally:
            self.rnn.hand_groups = 0


def case(name: str):
    """``(model, inputs, loss_fn, {placement name: module})`` of one case."""
    from planner.capture.step import default_loss

    if name.startswith("chain-"):
        n = int(name.split("-")[1])
        torch.manual_seed(0)
        blocks = nn.Sequential(*[Residual(64) for _ in range(n)])
        segments = round(math.sqrt(n))
        return blocks, (torch.randn(256, 64),), default_loss, {
            f"checkpoint_sequential({segments})": Hand(blocks, segments), "every block": Hand(blocks, 0)}
    rnn = example_module("rnn")
    if name == "rnn-512":
        return rnn.model, rnn.inputs, rnn.loss_fn, {"groups of 23 steps": Grouped(rnn.model, 23),
                                                    "every step": Grouped(rnn.model, 1)}
    if name == "eager-rnn-512":
        torch.manual_seed(0)
        model = rnn.EagerRNN(rnn.VOCAB, 256, rnn.STEPS)
        return model, rnn.inputs, rnn.loss_fn, {"every call of the cell": Grouped(model, 1)}
    if name == "state-rnn-512":
        torch.manual_seed(0)
        model = rnn.StateRNN(1000, 256, 512)
        ids, targets = torch.randint(0, 1000, (64, 512)), torch.randint(0, 1000, (64,))
        return model, (ids,), lambda out: nn.functional.cross_entropy(out, targets), {
            "every call of the cell": EveryCall(model)}
    raise SystemExit(f"unknown case {name!r}")


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


def rows_for(name: str, runs: int) -> list[str]:
    from planner.capture.inputs import as_inputs
    from planner.errors import PlannerError
    from planner.pipeline import plan_for, prepare
    from planner.planning.prepared import chunked
    from planner.profiling.measure import measure_peak, step_samples_ms
    from planner.solve.deadline import Deadline
    from planner.solve.result import NoSolution
    from planner.solve.rotor import relaxed

    model, inputs, loss_fn, hands = case(name)
    example = as_inputs(model, inputs)
    stages: dict[str, float] = {}
    began = time.perf_counter()
    prepared = prepare(model, inputs=inputs, loss_fn=loss_fn,
                       progress=lambda stage: stages.setdefault(stage, time.perf_counter()))
    ended = time.perf_counter()
    capture_s, profile_s = stages["profile"] - stages["capture"], ended - stages["profile"]
    fine = chunked(prepared, prepared.regions.block_cuts + 1) if prepared.regions.block_count else None
    out = [f"| {name} | (un-checkpointed) | | {mib(prepared.baseline.peak_bytes)} | | | prepare "
           f"{ended - began:.1f} s (capture {capture_s:.1f}, profile {profile_s:.1f}) |"]
    print(out[-1], flush=True)
    for hand_name, hand in hands.items():
        peak = measure_peak(hand, example, loss_fn)
        try:
            plan = plan_for(prepared, peak)
        except PlannerError as exc:
            out.append(f"| {name} | ckplan at {hand_name}'s peak | {mib(peak)} | failed: {str(exc)[:80]} | | | |")
            continue
        bound = "n/a"
        if fine is not None:
            try:
                lower = relaxed(fine.memory, peak, deadline=Deadline.after(120))
                bound = "none fits" if lower is None else f"{lower[1] / 1000:.0f} ms"
            except NoSolution:
                bound = "out of time"
        planned = measure_peak(plan.module, example, loss_fn)
        samples = step_samples_ms([model, hand, plan.module], example, loss_fn, runs=runs)
        base = statistics.median(samples[0])
        over = [statistics.median(s) / base - 1 for s in samples[1:]]
        out.append(f"| {name} | {hand_name} | | {mib(peak)} | {over[0]:+.1%} | | |")
        out.append(f"| {name} | ckplan at {hand_name}'s peak | {len(plan.segments)} | {mib(planned)} "
                   f"(pred {mib(plan.predicted_peak_bytes)}) | {over[1]:+.1%} | {plan.recompute_ms:.0f} ms / {bound} | "
                   f"{plan.solver_status}, solve {plan.solve_time_s:.1f} s |")
        print(*out[-2:], sep="\n", flush=True)
        del plan
        gc.collect()
    out.append(f"| {name} | (un-checkpointed step) | | | {base:.0f} ms | | |")
    return out


CASES = ["chain-100", "chain-300", "chain-1000", "rnn-512", "eager-rnn-512", "state-rnn-512"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=CASES)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "long_chains.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name in args.cases:
        rows += rows_for(name, args.runs)
    head = ["# ckplan on long chains, at each hand placement's measured peak", "",
            f"`python bench/long_chains.py --cases {' '.join(args.cases)} --runs {args.runs}` on "
            f"{platform.machine()}, torch {torch.__version__}, 1 thread. Peaks in MiB (measured, a plain loop: the "
            "output kept through backward). Overhead = step time / un-checkpointed step - 1, median of "
            f"{args.runs} interleaved steps. Recompute: ckplan's predicted recompute per step / the relaxed DP's "
            "lower bound over plans cut at every block edge. Planning = prepare (capture and profile, once per "
            "model) + solve; measured peaks read at the allocator.", "",
            "| case | placement | segments | peak | overhead | recompute / bound | planning |",
            "|---|---|---|---|---|---|---|"]
    Path(args.out).write_text("\n".join(head + rows) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
