"""Where Hugging Face's checkpointing compiled peaks, in one graph and with a graph per layer.

A Qwen2 decoder (width 768, 6 layers, batch 4 x 256, random weights) with ``gradient_checkpointing_enable()``,
compiled with inductor on this CPU three ways: as torch.compile does by default (a graph break at each layer),
in one graph (``skip_fwd_side_effects_in_bwd_under_checkpoint``, as ckplan has dynamo trace a planned model), and in
one graph with the input embedding apart (a graph break after ``embed_tokens``). Per way, from one warm step under
torch.profiler's allocator events: the peak (the parameters included), the allocation that reaches it and the
compiled graph it is made in; then the step times, interleaved, median of ``--runs``::

    OMP_NUM_THREADS=2 python bench/compiled_one_graph.py
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

MiB = 2**20


def peak_of(module, batch) -> tuple[int, int, str]:
    """``(peak bytes over the parameters, bytes of the allocation that reaches it, where it is made)`` of one
    training step of a plain loop, from torch.profiler's allocator events."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = module(**batch)  # a plain loop: the output (the logits) kept through backward
        out.loss.backward()
        del out
    allocations = []
    stack = [(event, ()) for event in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        event, path = stack.pop()
        if event.tag == _EventType.Allocation:
            if event.extra_fields.device.type == "cpu":
                allocations.append((event.start_time_ns, int(event.extra_fields.alloc_size), path))
            continue
        stack.extend((child, (*path, event.name)) for child in event.children)
    allocations.sort(key=lambda a: a[0])
    live = peak = 0
    at = (0, ())
    for _, nbytes, path in allocations:
        live += nbytes
        if live > peak:
            peak, at = live, (nbytes, path)
    return peak, at[0], " / ".join(at[1][-2:])


def main() -> None:
    from compiled_hf import GraphBroken, decoder

    from planner.capture.inputs import as_inputs
    from planner.profiling.measure import step_samples_ms

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    model = decoder("qwen2", args.width, args.layers)
    ids = torch.randint(0, 32000, (4, 256), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    hf = copy.deepcopy(model)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    apart = copy.deepcopy(hf)
    apart.model.embed_tokens.register_forward_hook(lambda module, args, out: torch._dynamo.graph_break())
    ways = {"un-checkpointed": torch.compile(model), "a graph per layer (default)": GraphBroken(torch.compile(hf)),
            "one graph": torch.compile(hf), "one graph, the embedding apart": torch.compile(apart)}
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    for name, module in ways.items():
        torch._dynamo.reset()
        for _ in range(2):  # compile, then a warm step
            module(**batch).loss.backward()
            module.zero_grad(set_to_none=True)
        peak, nbytes, where = peak_of(module, batch)
        module.zero_grad(set_to_none=True)
        print(f"{name}: peak {(params + peak) / MiB:.1f} MiB, reached by {nbytes / MiB:.2f} MiB allocated in {where}")
    torch._dynamo.reset()
    samples = step_samples_ms(list(ways.values()), as_inputs(model, batch), lambda out: out.loss, runs=args.runs)
    medians = [statistics.median(s) for s in samples]
    for name, median in zip(ways, medians):
        print(f"{name}: step {median:.0f} ms, {100 * (median / medians[0] - 1):+.1f}%")


if __name__ == "__main__":
    main()
