"""Hugging Face decoders compiled with inductor on this CPU, at the measured peak of Hugging Face's checkpointing
compiled: ckplan's plan compiled (``compilable=True``) against it and against compile's ``activation_memory_budget``.

Per model (Qwen2 and Llama, width 768, 6 layers, batch 4 x 256, random weights, dropout off, a plain loop: the
output kept through backward): the un-checkpointed model compiled; ``gradient_checkpointing_enable()`` compiled as
torch.compile does by default (a graph per layer: Hugging Face's layers mutate state outside the checkpointed region),
whose measured peak is the budget, and in one graph (``skip_fwd_side_effects_in_bwd_under_checkpoint``, which ckplan
sets when it plans so that a planned model compiles in one graph as the unplanned one does); ckplan planned with
``compilable=True`` and ``follow_batch=False``, its loss counted as inductor runs it, at that budget scaled by that
model's and the compiled un-checkpointed peaks, compiled, measured, and planned again until its compiled step fits
within 2% under the budget (``planner.compiled.fit``, 6 plans compiled at most, then every layer; then the same
with the input embedding compiled apart, then with the graph broken at each layer); each
``activation_memory_budget`` fraction of ``--fractions`` compiled (``CompiledModule``) and measured, the highest that
fits kept. Peaks at the allocator (``measure_peak``, after a step that compiles); step times interleaved
(``step_samples_ms``, median of ``--runs``), overhead against the un-checkpointed model compiled::

    OMP_NUM_THREADS=2 python bench/compiled_hf.py      # bench/results/compiled_hf.md
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MiB = 2**20
WAYS = {"one": "", "inputs_apart": ", the input embedding compiled apart", "per_region": ", graph broken at its layers"}


def decoder(family: str, width: int, layers: int):
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=32000, hidden_size=width, intermediate_size=width * 8 // 3 // 64 * 64,
                  num_hidden_layers=layers, num_attention_heads=width // 64,
                  num_key_value_heads=max(1, width // 64 // 3),
                  use_cache=False, attention_dropout=0.0)
    config = (transformers.Qwen2Config if family == "qwen2" else transformers.LlamaConfig)(**common)
    return (transformers.Qwen2ForCausalLM if family == "qwen2" else transformers.LlamaForCausalLM)(config)


class GraphBroken(torch.nn.Module):
    """A compiled module traced as ``torch.compile`` does by default: a checkpointed region whose forward mutates
    state outside it (Hugging Face's decoder layers) breaks the graph, where ckplan, once it plans, has dynamo trace
    it into one graph (``skip_fwd_side_effects_in_bwd_under_checkpoint``, a process-wide setting)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, **kwargs):
        with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=False):
            return self.inner(**kwargs)


def rows_for(family: str, args: argparse.Namespace) -> list[str]:
    import torch._dynamo

    from planner import prepare
    from planner.capture.inputs import as_inputs
    from planner.capture.step import backward
    from planner.compiled.backend import CompiledModule
    from planner.compiled.fit import fit_compiled
    from planner.profiling.measure import measure_peak, step_samples_ms

    model = decoder(family, args.width, args.layers)
    ids = torch.randint(0, 32000, (args.rows, args.length), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    example = as_inputs(model, batch)
    loss = lambda out: out.loss
    torch._dynamo.reset()  # every module compiled below is an entry of the model's frames: keep under dynamo's limit
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True  # as ckplan sets it when it plans
    plain = torch.compile(model)
    hf_model = copy.deepcopy(model)
    hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf_model.train()
    hf = GraphBroken(torch.compile(hf_model))
    one_graph = torch.compile(copy.deepcopy(hf_model))

    def warm_peak(module) -> int:
        """The peak of a step after one that compiles (a first compiled step can count what compiling frees)."""
        backward(loss(module(**batch)))
        for parameter in module.parameters():
            parameter.grad = None
        return measure_peak(module, example, loss)

    peaks = {"none": warm_peak(plain)}
    torch._dynamo.reset()
    peaks["hf"] = warm_peak(hf)
    torch._dynamo.reset()
    peaks["one graph"] = warm_peak(one_graph)
    budget = peaks["hf"]
    prepared = prepare(copy.deepcopy(model), inputs=batch, compilable=True, follow_batch=False)
    torch._dynamo.reset()
    planned = fit_compiled(prepared, budget, example, loss, keep_output=True, compiled_plain_bytes=peaks["none"],
                           progress=lambda line: print(f"{family}: {line}", flush=True))
    if planned is None:
        raise SystemExit(f"{family}: no eager plan to compile")
    plan, ours, peaks["ckplan"] = planned.plan, planned.module, planned.probe.peak_bytes
    fraction, fitted = None, None
    for f in args.fractions:
        torch._dynamo.reset()
        probe = CompiledModule(model, f)
        peak = warm_peak(probe)
        print(f"{family}: activation_memory_budget {f}: {peak / MiB:.1f} MiB (budget {budget / MiB:.1f})", flush=True)
        if peak <= budget:
            fraction, fitted, peaks["fraction"] = f, probe, peak
            break
    modules = [plain, hf, one_graph, ours] + ([fitted] if fitted is not None else [])
    torch._dynamo.reset()  # the warm-up round compiles each of them again, within dynamo's recompile limit
    samples = step_samples_ms(modules, example, loss, runs=args.runs)
    medians = [statistics.median(s) for s in samples]
    base = medians[0]
    names = ["un-checkpointed", "Hugging Face checkpointing (a graph per layer, as compiled by default)",
             "Hugging Face checkpointing in one graph",
             f"ckplan ({len(plan.segments)} segments, {planned.compiles} plans compiled, eager budget "
             f"{planned.target_bytes / MiB:.0f} MiB{WAYS[planned.probe.graphs.value]}"
             f"{'' if planned.fits else ': none fits, the smallest'})"]
    keys = ["none", "hf", "one graph", "ckplan"]
    if fitted is not None:
        names.append(f"activation_memory_budget {fraction}")
        keys.append("fraction")
    out = []
    for name, key, median, times in zip(names, keys, medians, samples):
        over = " (over)" if key != "none" and peaks[key] > budget else ""
        out.append(f"| {family} | {name} | {peaks[key] / MiB:.1f}{over} | {median:.0f} ({min(times):.0f}.."
                   f"{max(times):.0f}) | {100 * (median / base - 1):+.1f}% |")
    if fitted is None:
        out.append(f"| {family} | activation_memory_budget {', '.join(map(str, args.fractions))} | none fits | | |")
    print("\n".join(out), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=["qwen2", "llama"])
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "compiled_hf.md"))
    args = parser.parse_args()
    lines = [
        "# Hugging Face decoders compiled, at Hugging Face checkpointing's compiled peak", "",
        f"`python bench/compiled_hf.py --width {args.width} --layers {args.layers} --rows {args.rows} --length "
        f"{args.length} --runs {args.runs}` (torch {torch.__version__}, inductor, "
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads). Peaks at the CPU "
        "allocator, MiB, one training step of a plain loop (the output kept through backward); step: median ms of "
        f"{args.runs} interleaved steps (fastest..slowest); overhead against the un-checkpointed model compiled. "
        "The budget is Hugging Face checkpointing's compiled peak as torch.compile runs it by default (a graph per "
        "layer); its row in one graph is the same checkpointing traced as ckplan has dynamo trace a planned model. "
        "ckplan is planned with `compilable=True`, its loss counted as inductor runs it (no log-softmax kept), at "
        "the budget scaled by that model's and the compiled un-checkpointed peaks, compiled and measured, and "
        "planned again until its compiled step fits within 2% under the budget "
        "(`planner.compiled.fit`, then every layer, then the same with the input embedding compiled apart, "
        "then with the graph broken at each layer); "
        "`activation_memory_budget` is the highest fraction whose "
        "compiled peak fits. A peak over the budget is marked (over).", "",
        "| model | compiled | peak MiB | step ms | overhead |", "|---|---|---|---|---|",
    ]
    for family in args.families:
        lines += rows_for(family, args)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
