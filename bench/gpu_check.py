"""The checks to run on a CUDA device, all in one go (an H200's results: ``bench/results/gpu_h200.md``).

Per example: profile one step on the device and save it to ``profiles/<example>-<gpu>.json``; plan at
each budget, selective and whole-segment, from that profile; measure every plan's peak
(``torch.cuda.max_memory_allocated``, ``planner.profiling.measure.measure_peak``) and its step time against the
un-checkpointed model (interleaved, median); and compare the roofline estimate for ``--spec`` (a
bundled device spec) with the measured profile. Then the compiled path (``--compiled``, default
gpt_large): torch.compile at ``activation_memory_budget`` 0.5 and 0.3, and ``optimize_compiled`` at
each one's measured peak, timed interleaved. Then a ~1B Llama-shaped Hugging Face decoder (``--llama``, bf16,
1 x 2048 tokens): the prediction error of every plan against the allocator's peak (allocated and reserved);
every layer (HF/torchtitan full AC), torchtitan's op-level policy (``op_sac``) and ckplan at the op-level
policy's measured peak, timed interleaved; and the does-not-fit case: the process capped with
``torch.cuda.set_per_process_memory_fraction`` below the plain step, planned and stepped under the cap. Then offload
(``--offload``, 8 x 2048 at 8192 tokens): the host link measured when profiling, and with one copy stream alone and
beside compute (``link_rows``), plans with and without offload at
full checkpointing's peak, a plan offloading its kept layer inputs, one offloading the op outputs its layers cache
(selective checkpointing), and torch's ``save_on_cpu`` around full checkpointing (layer-input offload as Unsloth and
transformers' flag do it). Then reserved memory (``--reserved``): each plan's step from an emptied cache against the
caching allocator's simulation over its allocations (``planner.memory.caching``). Writes
``gpu_check.md`` (and the profiles) under ``--out``::

    python bench/gpu_check.py --out "$OUT"                # on a CUDA machine (the small examples and gpt_large)
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python bench/gpu_check.py --out "$OUT/expandable"  # reserved
    python bench/gpu_check.py --device cpu --examples seed_cnn gpt --out /tmp/gpu_check   # dry run here
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._pytree import tree_map

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))  # offloading.py: plans with offloads chosen by hand
sys.path.insert(0, str(ROOT))

from compare_strategies import EXAMPLES, load, mib  # noqa: E402


def on_device(name: str, device: torch.device):
    """The example's model, inputs and loss on ``device`` (its loss reads module globals: moved too)."""
    model, inputs, loss_fn = load(name)
    module = sys.modules[f"ckplan_example_{name}"]
    for key, value in list(vars(module).items()):
        if isinstance(value, torch.Tensor):
            setattr(module, key, value.to(device))
    move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t
    return model.to(device), tree_map(move, inputs), loss_fn


def example_rows(name: str, device: torch.device, budgets: list[int], runs: int, out: Path, spec: str) -> list[str]:
    from planner import InfeasibleBudget
    from planner.capture.inputs import as_inputs
    from planner.pipeline import plan_for, prepare
    from planner.profiling.measure import measure_peak, step_times_ms

    model, inputs, loss_fn = on_device(name, device)
    began = time.perf_counter()
    prepared = prepare(model, inputs=inputs, loss_fn=loss_fn)
    prepare_s = time.perf_counter() - began
    gpu = torch.cuda.get_device_name(device).replace(" ", "-").lower() if device.type == "cuda" else device.type
    prepared.profile.save(str(out / f"{name}-{gpu}.json"))
    example = as_inputs(model, inputs)
    rows = [f"| {name} | none | | {mib(prepared.baseline.peak_bytes)} / "
            f"{mib(measure_peak(model, example, loss_fn))} | | | prepare {prepare_s:.1f} s, "
            f"sac_op_us {prepared.sac_cost.op_us:.1f} ({prepared.sac_cost.source}) |"]
    for fraction in budgets:
        plans = {}
        for selective in (True, False):
            try:
                plans["selective" if selective else "whole-segment"] = plan_for(prepared, f"{fraction}%",
                                                                                 selective=selective,
                                                                                 budget_bounds="allocated")
            except InfeasibleBudget as exc:
                rows.append(f"| {name} | {fraction}% | infeasible: {str(exc).splitlines()[0][:70]} | | | | |")
                break
        if not plans:
            continue
        times = step_times_ms([model, *(p.module for p in plans.values())], example, loss_fn, runs=runs)
        for (kind, plan), ms in zip(plans.items(), times[1:]):
            saves = sum(len(s.saved_nodes) for s in plan.segments)
            measured = measure_peak(plan.module, example, loss_fn)
            rows.append(f"| {name} | {fraction}% {kind} | {len(plan.segments)} / {saves} | "
                        f"{mib(plan.predicted_peak_bytes)} / {mib(measured)} (budget {mib(plan.budget_bytes)}) | "
                        f"{100 * plan.predicted_overhead:+.1f}% | {100 * (ms / times[0] - 1):+.1f}% | "
                        f"{plan.solver_status} {plan.solve_time_s:.1f} s |")
    if spec:  # the roofline on meta tensors for the bundled spec, against this measured profile
        estimated = prepare(model, inputs=inputs, loss_fn=loss_fn, device=spec)
        rows.append(f"| {name} | estimate for {spec} | | {mib(estimated.baseline.peak_bytes)} / "
                    f"{mib(prepared.baseline.peak_bytes)} (profiled) | step {estimated.profile.step_ms:.2f} ms | "
                    f"step {prepared.profile.step_ms:.2f} ms (profiled) | |")
    return rows


def compiled_rows(name: str, device: torch.device, runs: int) -> list[str]:
    """torch.compile's knapsack at 0.5 and 0.3 against ``optimize_compiled`` at each one's measured peak."""
    from planner import optimize_compiled
    from planner.capture.inputs import as_inputs
    from planner.compiled.search import probe, timed

    model, inputs, loss_fn = on_device(name, device)
    example = as_inputs(model, inputs)
    knapsack = {f: probe(model, f, example, loss_fn, keep_output=True) for f in (1.0, 0.5, 0.3)}
    rows = []
    for fraction in (0.5, 0.3):
        began = time.perf_counter()
        chosen = optimize_compiled(model, knapsack[fraction][1].peak_bytes, inputs=inputs, loss_fn=loss_fn, runs=runs)
        took = time.perf_counter() - began
        base, theirs, ours = timed([knapsack[1.0], knapsack[fraction], (chosen.module, chosen.probes[chosen.chosen])], example,
                                   loss_fn, runs=runs)
        what = "ckplan plan" if chosen.plan is not None else f"fraction {chosen.fraction:g}"
        rows.append(f"| {name} | compiled: budget {fraction} vs ckplan ({what}, {took:.0f} s) | | "
                    f"{mib(theirs.peak_bytes)} / {mib(chosen.peak_bytes)} | {theirs.step_ms / base.step_ms - 1:+.1%} | "
                    f"{ours.step_ms / base.step_ms - 1:+.1%} | vs compile at 1.0 |")
    return rows


def llama(layers: int, hidden: int, device: torch.device, tokens: int = 2048):
    """A Llama-shaped decoder from a config (random weights, bf16), ``layers`` deep: ~1.1B parameters at 16 x 2048."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 128),
                                      num_key_value_heads=max(1, hidden // 512), use_cache=False,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16)
    ids = torch.randint(0, 32000, (1, tokens), device=device)
    return model, {"input_ids": ids, "labels": ids}


def allocator_peaks(module, example, device: torch.device) -> tuple[int, int]:
    """Allocated and reserved peak of one step (the logits dropped before backward); reserved is allocated on a CPU."""
    from planner.profiling.measure import measure_peak

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    allocated = measure_peak(module, example, keep_output=False)
    reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else allocated
    return allocated, reserved


def reserved_rows(device: torch.device, layers: int, hidden: int) -> list[str]:
    """What the caching allocator reserves for a step, against its simulation (``planner.memory.caching``) over the
    step's allocations recorded at the dispatcher (``allocation_events``), with the expandable segments this
    process's ``PYTORCH_CUDA_ALLOC_CONF`` sets: per plan, allocated and reserved measured from an emptied cache
    (``empty_cache``, then one step: ``max_memory_allocated``, ``max_memory_reserved``), and simulated (allocated,
    reserved with room to spare, reserved at the device's limit). On a CPU only the simulation."""
    import gc

    from planner.capture.inputs import as_inputs
    from planner.memory.caching import simulate_reserved
    from planner.pipeline import plan_for, prepare
    from planner.profiling.headroom import expandable_segments
    from planner.profiling.measure import allocation_events, measure_peak

    model, batch = llama(layers, hidden, device)
    example = as_inputs(model, batch)
    prepared = prepare(model, inputs=batch, keep_output=False)
    every = plan_for(prepared, prepared.baseline.peak_bytes - 1, solver="every_block")
    halfway = (prepared.baseline.peak_bytes + every.predicted_peak_bytes) // 2
    plans = {"none": None, "every layer": every,
             "op_sac": plan_for(prepared, prepared.baseline.peak_bytes - 1, solver="op_sac"),
             "ckplan halfway to every layer's peak": plan_for(prepared, halfway, budget_bounds="allocated")}
    expandable = expandable_segments()
    rows = []
    for name, plan in plans.items():
        module = model if plan is None else plan.module
        predicted = "-" if plan is None or plan.reserved is None else \
            f"{mib(plan.reserved.roomy_bytes)} / {mib(plan.reserved.needed_bytes)}"
        simulated = simulate_reserved(allocation_events(module, example, keep_output=False), expandable=expandable)
        measured = "n/a (not a GPU)"
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            allocated = measure_peak(module, example, keep_output=False)
            reserved = torch.cuda.max_memory_reserved(device)
            measured = (f"{mib(allocated)} / {mib(reserved)} ({100 * (simulated.peak_bytes / reserved - 1):+.2f}% "
                        "reserved)")
        rows.append(f"| llama {layers} x {hidden} | {name} | {'on' if expandable else 'off'} | {measured} | "
                    f"{mib(simulated.allocated_bytes)} / {mib(simulated.peak_bytes)} / {mib(simulated.needed_bytes)} | "
                    f"{predicted} |")
    return rows


def llama_rows(device: torch.device, runs: int, layers: int, hidden: int) -> list[str]:
    """Prediction against the allocator (allocated, reserved), the hand policies against ckplan at the op-level
    policy's measured peak, and a cap below the plain step."""
    from planner.capture.inputs import as_inputs
    from planner.errors import PlannerError
    from planner.pipeline import plan_for, prepare
    from planner.profiling.measure import measure_peak, step_times_ms

    model, batch = llama(layers, hidden, device)
    example = as_inputs(model, batch)
    params = sum(p.numel() for p in model.parameters())
    began = time.perf_counter()
    prepared = prepare(model, inputs=batch, keep_output=False)
    rows = [f"| llama {params / 1e9:.2f}B | none | | {mib(prepared.baseline.peak_bytes)} / "
            f"{mib(measure_peak(model, example, keep_output=False))} | | | prepare {time.perf_counter() - began:.1f} s |"]

    policies = {name: plan_for(prepared, prepared.baseline.peak_bytes - 1, solver=name)  # fixed placements
                for name in ("every_block", "op_sac")}
    policies["ckplan at op_sac's peak"] = plan_for(prepared, allocator_peaks(policies["op_sac"].module, example, device)[0],
                                                 budget_bounds="allocated")
    times = step_times_ms([model, *(p.module for p in policies.values())], example, runs=runs)
    for (name, plan), ms in zip(policies.items(), times[1:]):
        allocated, reserved = allocator_peaks(plan.module, example, device)
        rows.append(f"| llama | {name} | {len(plan.segments)} / {sum(len(s.saved_ops) for s in plan.segments)} | "
                    f"{mib(plan.predicted_peak_bytes)} / {mib(allocated)} allocated, {mib(reserved)} reserved "
                    f"({100 * (plan.predicted_peak_bytes / allocated - 1):+.2f}%) | "
                    f"{100 * plan.predicted_overhead:+.1f}% ({plan.recompute_ms:.1f} ms) | "
                    f"{100 * (ms / times[0] - 1):+.1f}% | {plan.solver_status} |")
    if device.type == "cuda":  # the does-not-fit case: a cap below the plain step, planned and stepped under it
        total = torch.cuda.get_device_properties(device).total_memory
        cap = (prepared.baseline.peak_bytes + policies["every_block"].predicted_peak_bytes) // 2
        torch.cuda.set_per_process_memory_fraction(cap / total, device)
        try:
            try:
                measure_peak(model, example, keep_output=False)
                plain = "fits"
            except torch.OutOfMemoryError:
                plain = "out of memory"
            torch.cuda.empty_cache()
            try:
                fitted = prepare(model, inputs=batch, keep_output=False, budget=int(cap * 0.95))
                plan = plan_for(fitted, int(cap * 0.95))
            except PlannerError as exc:
                rows.append(f"| llama | capped at {mib(cap)}: plain step {plain} | | {str(exc)[:300]} | | | |")
                return rows
            allocated, reserved = allocator_peaks(plan.module, example, device)
            rows.append(f"| llama | capped at {mib(cap)}: plain step {plain} | {len(plan.segments)} / "
                        f"{sum(len(s.saved_ops) for s in plan.segments)} | {mib(plan.predicted_peak_bytes)} / "
                        f"{mib(allocated)} allocated, {mib(reserved)} reserved | profiled in {fitted.profile.pieces} "
                        f"piece(s) | | {plan.solver_status} |")
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    return rows


def link_rows(device: torch.device, nbytes: int = 256 * 2**20, repeats: int = 5) -> list[str]:
    """The host link as offload uses it: a copy to pinned host memory and one back on one side stream, alone and
    while the default stream runs bf16 matmuls (a forward's compute), and what the copies cost the matmuls (fastest
    of ``repeats``). On a CPU there is no side stream: the copies alone (a memcpy)."""
    from planner.profiling.link import measure_host_link

    alone = measure_host_link(device, repeats=repeats)
    rows = [f"| host link, one copy alone | {alone[0]:.1f} GB/s to pinned host memory, {alone[1]:.1f} GB/s back | "
            "| | | |" if alone else "| host link | not measurable on this device | | | | |"]
    if device.type != "cuda":
        return [*rows, "| host link beside compute | needs a CUDA device (a side stream) | | | | |"]
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    back = torch.empty_like(source)
    side = torch.cuda.Stream(device)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def timed(stream, work) -> Callable[[], float]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            work()
            end.record(stream)
        return lambda: start.elapsed_time(end)  # ms, read once synchronised

    def matmuls(n: int) -> None:
        for _ in range(n):
            a @ a

    torch.cuda.synchronize(device)
    one = timed(torch.cuda.current_stream(device), lambda: matmuls(1))
    torch.cuda.synchronize(device)
    n = max(1, round(2 * nbytes / (alone[0] * 1e9) * 1e3 / one()))  # matmuls lasting about both copies
    best = dict.fromkeys(("alone ms", "beside ms", "d2h", "h2d"), float("inf"))
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        compute = timed(torch.cuda.current_stream(device), lambda: matmuls(n))
        torch.cuda.synchronize(device)
        best["alone ms"] = min(best["alone ms"], compute())
        compute = timed(torch.cuda.current_stream(device), lambda: matmuls(n))
        out_ = timed(side, lambda: host.copy_(source, non_blocking=True))
        in_ = timed(side, lambda: back.copy_(host, non_blocking=True))
        torch.cuda.synchronize(device)
        best["beside ms"] = min(best["beside ms"], compute())
        best["d2h"], best["h2d"] = min(best["d2h"], out_()), min(best["h2d"], in_())
    rows.append(f"| host link beside compute | {nbytes / best['d2h'] / 1e6:.1f} GB/s out, "
                f"{nbytes / best['h2d'] / 1e6:.1f} GB/s back on a side stream while {n} bf16 8192^3 matmuls run | | "
                f"matmuls alone {best['alone ms']:.1f} ms | beside the copies {best['beside ms']:.1f} ms "
                f"({100 * (best['beside ms'] / best['alone ms'] - 1):+.1f}%) | |")
    return rows


def offload_rows(device: torch.device, runs: int, layers: int, hidden: int, tokens: int, out: Path) -> list[str]:
    """Offload on the device: the host link measured when profiling, and at full activation checkpointing's predicted
    peak, ckplan with and without offload, full checkpointing with ckplan offloading its kept layer inputs down to
    a lower peak, and layer-input offload as Unsloth and transformers' ``offload`` flag do it (every layer checkpointed,
    its kept inputs copied to pinned host memory by torch's ``save_on_cpu``), each at its own measured peak: device
    peak allocated and reserved against the prediction, step time against the prediction, gradients against
    the plain model's."""
    from dataclasses import replace

    from offloading import cached_offloaded_plan

    from planner.capture.inputs import as_inputs
    from planner.memory.offload import MIN_OFFLOAD_BYTES
    from planner.pipeline import plan_for, plan_from_solution, prepare
    from planner.planning.offloading import host_link
    from planner.profiling.measure import step_times_ms
    from planner.profiling.record import save_profile
    from planner.solve.baselines import every_block
    from planner.solve.offload import OffloadLimits, choose_offloads

    model, batch = llama(layers, hidden, device, tokens=tokens)
    example = as_inputs(model, batch)
    prepared = prepare(model, inputs=batch, keep_output=False, follow_batch=False)
    prof = prepared.profile
    save_profile(prof, out / f"llama-offload-{torch.cuda.get_device_name(device).split()[-1].lower()}.json"
                 if device.type == "cuda" else out / "llama-offload-cpu.json")
    rows = [f"| host link | measured when profiled: {prof.d2h_gb_per_s:.1f} GB/s to pinned host memory, "
            f"{prof.h2d_gb_per_s:.1f} GB/s back | | | | |", *link_rows(device)]

    def grads(module) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        module(**batch).loss.backward()
        return [p.grad.detach().to("cpu", copy=True) for p in model.parameters()]

    reference = grads(model)  # on the host: the measured peaks below count the device's own tensors only
    model.zero_grad(set_to_none=True)  # measured peaks start without gradients
    full = plan_for(prepared, prepared.baseline.peak_bytes - 1, solver="every_block")
    peak = full.predicted_peak_bytes  # the plans below are compared at the same predicted peak
    plans = {"full AC (every layer)": full,
             "ckplan at full AC's peak, no offload": plan_for(prepared, peak, offload=False, time_limit_s=20,
                                                                   budget_bounds="allocated")}
    if device.type == "cuda":  # a CPU's host memory is its device memory: offload="auto" is refused there
        plans["ckplan at full AC's peak, offload auto"] = plan_for(prepared, peak, offload="auto", time_limit_s=20,
                                                                   budget_bounds="allocated")
    limits = OffloadLimits(link=host_link(prof), min_bytes=MIN_OFFLOAD_BYTES)
    every = every_block(prepared.memory, 0)  # layer-input offload planned by ckplan: full AC, its kept inputs moved
    kept = full.peak_breakdown.kept_activations_bytes if full.peak_breakdown else 0
    for share in (0.75, 0.5, 0.25):
        lower = full.predicted_peak_bytes - int(kept * share)
        offloads = choose_offloads(prepared.memory, every.plan, every.saves, lower, limits)
        if offloads is not None and offloads.n:
            plans[f"full AC, its kept layer inputs offloaded by ckplan down to {100 * share:.0f}% less kept"] = (
                plan_from_solution(prepared, replace(every, offloads=offloads), lower))
            break
    # whole layers keeping what torchtitan's op policy keeps (matmuls, attention), every cached output offloaded:
    # copied out when made, freed in place where the layer's forward ends, put back before its re-run
    try:
        plans["each layer keeping its matmuls and attention, those offloaded"] = cached_offloaded_plan(
            prepared, peak / prepared.baseline.peak_bytes, ("*mm*", "*scaled_dot_product*"))
    except AssertionError as exc:  # e.g. a size whose cached outputs are all under MIN_OFFLOAD_BYTES
        rows.append(f"| each layer keeping its matmuls and attention, those offloaded | not planned: {exc} | | | | |")

    class SaveOnCpu(torch.nn.Module):  # layer-input offload: full AC with what it keeps copied to pinned memory
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **kwargs):
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                return self.inner(**kwargs)

    modules = {name: plan.module for name, plan in plans.items()}
    modules["layer-input offload (full AC under save_on_cpu, as Unsloth / HF offload)"] = SaveOnCpu(full.module)
    times = step_times_ms([model, *modules.values()], example, runs=runs)
    for (name, module), ms in zip(modules.items(), times[1:]):
        allocated, reserved = allocator_peaks(module, example, device)
        worst = max(float((a.float() - b.float()).abs().max()) for a, b in zip(grads(module), reference))
        model.zero_grad(set_to_none=True)
        plan = plans.get(name)
        if plan is None:
            rows.append(f"| {name} | | {mib(allocated)} allocated, {mib(reserved)} reserved | | "
                        f"{ms:.1f} ms ({100 * (ms / times[0] - 1):+.1f}%) | max grad diff {worst:.2e} |")
            continue
        off = plan.offload
        what = (f"{off.storages} storages ({sum(t.cached for t in off.targets)} cached), "
                f"{mib(off.offloaded_bytes)} MiB; {off.link_busy()}; exposed {off.exposed_ms:.1f} ms" if off else "none")
        predicted_ms = prof.step_ms * (1 + plan.predicted_overhead)
        rows.append(f"| {name} | {what} | {mib(plan.predicted_peak_bytes)} / {mib(allocated)} allocated, "
                    f"{mib(reserved)} reserved ({100 * (plan.predicted_peak_bytes / allocated - 1):+.2f}%) | "
                    f"{predicted_ms:.1f} ms | {ms:.1f} ms ({100 * (ms / times[0] - 1):+.1f}%) | "
                    f"max grad diff {worst:.2e} |")
    rows.insert(1, f"| no checkpointing | | {mib(prepared.baseline.peak_bytes)} predicted | {prof.step_ms:.1f} ms | "
                   f"{times[0]:.1f} ms | |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--examples", nargs="*", default=[*EXAMPLES, "gpt_large"])
    parser.add_argument("--budgets", nargs="+", type=int, default=[70, 50, 30])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--spec", default="h200", help="bundled device spec for the roofline row ('' to skip)")
    parser.add_argument("--compiled", nargs="*", default=["gpt_large"], help="examples for the compiled rows")
    parser.add_argument("--llama", nargs=2, type=int, default=[16, 2048], metavar=("LAYERS", "HIDDEN"),
                        help="the Llama-shaped decoder's depth and width (default 16 x 2048: 1.1B parameters); "
                             "0 0 to skip")
    parser.add_argument("--offload", nargs=3, type=int, default=[8, 2048, 8192], metavar=("LAYERS", "HIDDEN", "TOKENS"),
                        help="the decoder the offload rows plan (default 8 x 2048, 1 x 8192 tokens); 0 0 0 to skip")
    parser.add_argument("--reserved", nargs=2, type=int, default=[16, 2048], metavar=("LAYERS", "HIDDEN"),
                        help="the decoder whose reserved memory is measured against the caching allocator's "
                             "simulation (default 16 x 2048); 0 0 to skip")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:  # the allocator's settings want an index
        device = torch.device("cuda", torch.cuda.current_device())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    what = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    lines = [f"# ckplan on {what}", "",
             f"`python bench/gpu_check.py --device {args.device} --examples {' '.join(args.examples)} "
             f"--budgets {' '.join(map(str, args.budgets))} --runs {args.runs}`, torch {torch.__version__}, "
             f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '(unset)')}. "
             "Peaks in MiB (predicted / measured at the allocator: `max_memory_allocated`); overhead = step time / "
             "un-checkpointed step - 1.", "",
             "| example | budget / plan | segments / saves | peak pred / meas | overhead pred | overhead meas | solver |",
             "|---|---|---|---|---|---|---|"]
    for name in args.examples:
        lines += example_rows(name, device, args.budgets, args.runs, out, args.spec)
        print("\n".join(lines[-1:]), flush=True)
    if args.compiled:
        lines += ["", "Compiled: peak MiB (compile's budget / ckplan's choice at that peak), overheads vs compile at "
                  "1.0 (compile's budget, then ckplan).", "",
                  "| example | row | | peak | theirs | ours | |", "|---|---|---|---|---|---|---|"]
    for name in args.compiled:
        lines += compiled_rows(name, device, args.runs)
        print(lines[-1], flush=True)
    if args.llama[0]:
        lines += ["", f"A Llama-shaped decoder, {args.llama[0]} x {args.llama[1]}, bf16, 1 x 2048 tokens, the logits "
                  "dropped before backward: peak MiB predicted / measured at the allocator; overhead predicted "
                  "(re-run ms), measured against the un-checkpointed step.", "",
                  "| model | plan | segments / ops kept | peak pred / meas | overhead pred | overhead meas | solver |",
                  "|---|---|---|---|---|---|---|"]
        lines += llama_rows(device, args.runs, *args.llama)
        print("\n".join(lines[-4:]), flush=True)
    if args.reserved[0]:
        lines += ["", "Reserved memory: measured from an emptied cache, allocated / reserved MiB (the simulation's "
                  "error on reserved), against the caching allocator simulated over the step's allocations as the "
                  "dispatcher records them: allocated / reserved with room to spare / reserved at the device's "
                  "limit; and the plan's own prediction (Plan.reserved: with room to spare / at the device's "
                  "limit). Run once as is and once with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.", "",
                  "| model | plan | expandable segments | measured | simulated | Plan.reserved |",
                  "|---|---|---|---|---|---|"]
        lines += reserved_rows(device, *args.reserved)
        print("\n".join(lines[-4:]), flush=True)
    if args.offload[0]:
        lines += ["", f"Offload, a Llama-shaped decoder {args.offload[0]} x {args.offload[1]}, bf16, 1 x {args.offload[2]} "
                  "tokens, the logits dropped before backward: peak MiB predicted / measured at the allocator; step "
                  "time predicted, and measured (median, interleaved) against the un-checkpointed step.", "",
                  "| plan | offloaded | peak pred / meas | step pred | step meas | gradients |",
                  "|---|---|---|---|---|---|"]
        lines += offload_rows(device, args.runs, *args.offload, out)
        print("\n".join(lines[-8:]), flush=True)
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
