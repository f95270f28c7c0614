"""Offloading kept activations to host memory: the schedule by hand, the choice under a budget, and plans run by
both executors with exact gradients and the predicted device peak measured exactly (the host copies are the
tagged store ``LiveStorages`` leaves out on a CPU)."""

import sys
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import planner
from planner import OptionError, load_plan
from planner.capture.inputs import as_inputs
from planner.common.budget import format_bytes
from planner.memory.offload import NO_OFFLOADS, Host, HostLink, holding, marking_us, relief, schedule
from planner.memory.simulate import simulate
from planner.memory.synthetic import GraphBuilder, memory_model
from planner.options import PlanOptions
from planner.pipeline import plan_from_solution
from planner.planning.offloading import host_link, offload_limits
from planner.profiling.measure import measure_peak
from planner.rewrite.offload import offloader_of
from planner.solve.baselines import every_block
from planner.solve.offload import OffloadLimits, choose_offloads

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import gpt
from offloading import cached_offloaded_plan, offloaded_plan, offloaded_solution

MB = 10_000_000
FAST = HostLink.from_gb_per_s(10, 10, overlaps=True)
"""10 GB/s: 10 MB copies in 1 ms, as long as one synthetic op runs."""


def _chain():
    """a -> b -> c -> d, each 10 MB, each saved by the next op; 1 ms per op forward, 2 ms backward."""
    g = GraphBuilder()
    a = g.op("a", [0], [MB], kernels=("aten.a",))[0]
    b = g.op("b", [a], [MB], saves=[a], kernels=("aten.b",))[0]
    c = g.op("c", [b], [MB], saves=[b], kernels=("aten.c",))[0]
    d = g.op("d", [c], [MB], saves=[c], kernels=("aten.d",))[0]
    return memory_model(g.build([d])), a


def test_one_offloaded_storage_leaves_when_its_copy_is_done_and_comes_back_when_unpacked():
    model, a = _chain()
    held = holding(model, ())
    assert (held.pack[a], held.need[a], held.release[a]) == (1, 1, 1)  # packed, unpacked and freed by b
    off = schedule(model, (), frozenset(), [a], FAST)
    # the copy starts when b has packed it (end of b: 2 ms), takes 1 ms, so a is gone from node 3 (c ends at 3 ms)
    assert off.gone == (3,)
    # its reload is issued on demand when b's backward unpacks it: 1 ms the backward waits for
    assert off.trigger == (1,)
    assert off.exposed_us == 1000 + marking_us(model)
    fwd, bwd = relief(model, off)
    assert list(fwd) == [0, 0, 0, MB, MB]
    assert list(bwd) == [0, 0, MB, MB, MB]
    base, with_offload = simulate(model, ()), simulate(model, (), frozenset(), off)
    assert list(with_offload.fwd_bytes) == list(base.fwd_bytes - fwd)
    assert with_offload.peak_bytes <= base.peak_bytes


def test_on_a_link_that_does_not_overlap_compute_every_copy_costs_its_time():
    model, a = _chain()
    cpu = HostLink.from_gb_per_s(10, 10, overlaps=False)
    off = schedule(model, (), frozenset(), [a], cpu)
    assert off.gone == (2,)  # synchronous: off the device right after its last use
    assert off.exposed_us == 2000 + marking_us(model)


def test_a_copy_the_forward_cannot_finish_is_not_made():
    model, a = _chain()
    slow = HostLink.from_gb_per_s(1, 1, overlaps=True)  # 10 ms for 10 MB: the forward is over in 4
    assert schedule(model, (), frozenset(), [a], slow) is None


def test_offloads_bring_a_plan_under_a_budget_it_is_over():
    model, _ = _chain()
    base = simulate(model, ())
    limits = OffloadLimits(link=FAST, min_bytes=MB)
    budget = base.peak_bytes - MB // 2
    off = choose_offloads(model, (), frozenset(), budget, limits)
    assert off is not None and off.n >= 1
    assert simulate(model, (), frozenset(), off).peak_bytes <= budget
    assert choose_offloads(model, (), frozenset(), base.peak_bytes, limits).n == 0  # fits: nothing moves
    assert choose_offloads(model, (), frozenset(), budget, replace(limits, host_budget_bytes=MB // 2)) is None


@pytest.fixture(scope="module")
def gpt_prepared():
    """A GPT whose hidden states are 2 MiB (the smallest offloaded), captured and profiled once."""
    torch.manual_seed(0)
    config = gpt.Config(width=256, layers=4, context=256, dropout=0.0)
    model, x = gpt.GPT(config), torch.randint(0, config.vocab, (8, config.context))
    return model, x, planner.prepare(model, inputs=(x,))


def _grads(model, module, batch):
    model.zero_grad(set_to_none=True)
    out = module(**batch) if isinstance(batch, dict) else module(batch)
    (out.loss if hasattr(out, "loss") else out.sum()).backward()
    return [p.grad.clone() for p in model.parameters()]


def _check(plan, model, batch):
    """Exact gradients, and the device peak measured is the predicted one; the host store holds the planned bytes."""
    inputs = as_inputs(plan.module, batch if isinstance(batch, dict) else (batch,))
    measured = measure_peak(plan.module, inputs)
    offloader = offloader_of(plan.module)
    assert offloader.missed == 0
    assert measured == plan.predicted_peak_bytes <= plan.budget_bytes
    assert offloader.host_peak_bytes == plan.offload.offloaded_bytes
    expected = _grads(model, model, batch)
    for got, want in zip(_grads(model, plan.module, batch), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("plan_fraction", [1.0, 0.5])
def test_a_rewritten_graph_offloads_exactly_as_predicted(gpt_prepared, plan_fraction):
    model, x, prepared = gpt_prepared
    plan = offloaded_plan(prepared, plan_fraction)
    assert plan.offload is not None and "offloads" in plan.summary() and "host link busy" in plan._repr_html_()
    _check(plan, model, x)


def _qwen2():
    """A small Qwen2 causal LM, its batch, and the model prepared for one plan (run by its own modules)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model = transformers.Qwen2ForCausalLM(config).train()
    ids = torch.randint(1, 512, (4, 512))
    batch = {"input_ids": ids, "labels": ids}
    return model, batch, planner.prepare(model, inputs=batch, follow_batch=False)


@pytest.mark.slow
def test_a_hugging_face_model_offloads_exactly_as_predicted_through_its_own_modules():
    model, batch, prepared = _qwen2()
    assert prepared.executor.kind.value == "hooks"
    plan = offloaded_plan(prepared, 1.0)
    _check(plan, model, batch)


def test_op_outputs_selective_checkpointing_cached_offload_exactly_as_predicted(gpt_prepared):
    """The cache holds them, no hook sees them: copied when made, freed in place where the segment's forward ends,
    brought back in place before its re-run."""
    model, x, prepared = gpt_prepared
    plan = cached_offloaded_plan(prepared, 0.6, ("*gelu*",))
    assert all(t.cached for t in plan.offload.targets)
    _check(plan, model, x)


@pytest.mark.slow
def test_a_hugging_face_models_cached_op_outputs_offload_exactly_as_predicted():
    model, batch, prepared = _qwen2()
    plan = cached_offloaded_plan(prepared, 0.45, ("*silu*", "*scaled_dot_product*"))
    _check(plan, model, batch)


def test_a_saved_plan_with_offloads_applies_and_runs_them(gpt_prepared, tmp_path):
    model, x, prepared = gpt_prepared
    plan = offloaded_plan(prepared, 1.0)
    plan.save(tmp_path / "plan.json")
    loaded = load_plan(tmp_path / "plan.json")
    assert loaded.offload == plan.offload and loaded.timeline == plan.timeline
    module = loaded.apply(model, inputs=(x,))
    assert offloader_of(module) is not None
    measured = measure_peak(module, as_inputs(module, (x,)))
    assert measured == plan.predicted_peak_bytes


def test_a_call_of_another_shape_offloads_the_same_tensors_at_its_own_size(gpt_prepared):
    """Targets are found by op, occurrence and output, not by size: a short last batch runs the plan's offloads on
    its own, smaller tensors, with exact gradients and no warning."""
    model, x, prepared = gpt_prepared
    plan = offloaded_plan(prepared, 1.0)
    assert all(t.output is not None for t in plan.offload.targets)
    short = x[:3]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a target missed warns
        measured = measure_peak(plan.module, as_inputs(plan.module, (short,)))
        got = _grads(model, plan.module, short)
    offloader = offloader_of(plan.module)
    assert offloader.missed == 0
    assert 0 < offloader.host_peak_bytes < plan.offload.offloaded_bytes  # 3 rows of 8: smaller copies
    assert measured < plan.predicted_peak_bytes
    for a, b in zip(got, _grads(model, model, short)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_ranks_of_one_host_share_its_memory_bandwidth_and_its_pinned_memory():
    """Eight ranks copying at once into one host's memory each get at most an eighth of its bandwidth, and an
    eighth of the half of its memory that offloads may pin; a copy on the shared link takes longer."""
    link = HostLink.from_gb_per_s(53, 53, overlaps=True, source="spec")
    dgx = Host(ranks=8, memory_bytes=2 * 2**40, bandwidth_gb_per_s=563.2)
    assert dgx.link(link) == link  # 70.4 GB/s each: the PCIe link binds first
    assert dgx.budget_bytes == 2**40 // 8
    narrow = Host(ranks=8, memory_bytes=None, bandwidth_gb_per_s=200)
    shared = narrow.link(link)
    assert shared.d2h_bytes_per_us == shared.h2d_bytes_per_us == 25_000  # 25 GB/s
    assert "shared by 8 ranks" in shared.source and narrow.budget_bytes is None
    assert Host(ranks=1, memory_bytes=None, bandwidth_gb_per_s=200).link(link) == link
    model, a = _chain()
    alone = schedule(model, (), frozenset(), [a], FAST)
    halved = schedule(model, (), frozenset(), [a], Host(ranks=2, memory_bytes=None, bandwidth_gb_per_s=10).link(FAST))
    assert alone is not None and halved is not None and halved.d2h_busy_us == 2 * alone.d2h_busy_us
    assert halved.exposed_us > alone.exposed_us  # the reload b's backward waits for takes twice as long


def _meta_llama(*, width: int, intermediate: int, layers: int, heads: int):
    """A Llama-shaped Hugging Face decoder in bf16 on the meta device (vocabulary 4096, 4 key/value heads, SDPA) and
    a batch of one 8192-token sequence that is its labels."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=width, intermediate_size=intermediate,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=4,
                                      use_cache=False, attn_implementation="sdpa")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        ids = torch.randint(0, 4096, (1, 8192))
    return model, {"input_ids": ids, "labels": ids}


@pytest.mark.slow
def test_a_plan_for_a_spec_shares_its_hosts_link_and_pinned_memory_among_the_ranks_on_it(tmp_path):
    """A Llama-shaped decoder on meta for a GH200-like spec (170 GB/s out, 410 back) whose host of eight GPUs
    has memory moving 400 GB/s: planned for one rank of the eight, each rank's copies get 50 GB/s, and the plan at
    full checkpointing's peak offloads less and costs more than with the host to itself; the default pinned budget
    is the rank's share."""
    import json

    spec = json.loads((Path(planner.__file__).parent / "profiling" / "device_specs" / "gh200.json").read_text())
    spec.update(name="gh200-shared-host", gpus_per_host=8, host_memory_bandwidth_gb_per_s=400)
    path = tmp_path / "gh200-shared-host.json"
    path.write_text(json.dumps(spec))
    model, batch = _meta_llama(width=1024, intermediate=2816, layers=4, heads=8)
    prepared = planner.prepare(model, inputs=batch, keep_output=False, device=str(path), follow_batch=False)
    limits = offload_limits(prepared, replace(prepared.options, ranks_per_host=8))
    assert limits.link.d2h_bytes_per_us == limits.link.h2d_bytes_per_us == 50_000
    assert limits.host_budget_bytes == spec["host_memory_bytes"] // 2 // 8
    alone = offload_limits(prepared, replace(prepared.options, ranks_per_host=1))
    assert (alone.link.d2h_bytes_per_us, alone.link.h2d_bytes_per_us) == (170_000, 410_000)
    assert alone.host_budget_bytes == spec["host_memory_bytes"] // 2
    assert offload_limits(prepared, prepared.options).link == alone.link  # one rank (world_size 1): alone
    full = plan_from_solution(prepared, every_block(prepared.memory, 0), prepared.baseline.peak_bytes)
    plans = {ranks: planner.plan_for(prepared, full.predicted_peak_bytes, offload="auto", time_limit_s=15,
                                     budget_bounds="allocated", ranks_per_host=ranks) for ranks in (1, 8)}
    assert plans[1].offload is not None and plans[1].offload.offloaded_bytes > 0
    shared = plans[8].offload.offloaded_bytes if plans[8].offload is not None else 0
    assert shared < plans[1].offload.offloaded_bytes
    assert plans[8].predicted_overhead >= plans[1].predicted_overhead
    assert plans[8].offload is None or "shared by 8 ranks" in plans[8].offload.link
    for plan in plans.values():
        assert plan.predicted_peak_bytes <= full.predicted_peak_bytes


def test_offload_is_off_on_a_cpu_unless_asked_and_its_options_are_checked(gpt_prepared):
    _, _, prepared = gpt_prepared
    assert offload_limits(prepared, PlanOptions()) is None  # a CPU's host memory is its device memory
    with pytest.raises(OptionError, match="the same memory: nothing would be freed"):
        offload_limits(prepared, PlanOptions(offload="auto"))
    assert host_link(prepared.profile).overlaps is False  # measured: a memcpy, synchronous
    assert PlanOptions(host_budget="2GB").host_budget == 2_000_000_000
    with pytest.raises(OptionError, match="offload must be"):
        PlanOptions(offload="yes")
    with pytest.raises(OptionError, match="host_budget"):
        PlanOptions(host_budget="lots")


@pytest.mark.slow
def test_a_gpu_plan_offloads_where_the_link_is_fast_and_re_runs_less():
    """A Llama-shaped decoder on meta for the GH200 spec (NVLink-C2C: 170 GB/s out, 410 back), planned at full
    checkpointing's own peak: the plan offloads, fits, and its re-runs plus exposed copies cost less."""
    from planner.solve.baselines import every_block

    model, batch = _meta_llama(width=2048, intermediate=5632, layers=8, heads=16)
    prepared = planner.prepare(model, inputs=batch, keep_output=False, device="gh200")
    full = plan_from_solution(prepared, every_block(prepared.memory, 0), prepared.baseline.peak_bytes)
    plan = planner.plan_for(prepared, full.predicted_peak_bytes, offload="auto", time_limit_s=15,
                            budget_bounds="allocated")  # full checkpointing's peak counts what is allocated
    # (it follows the batch, as a Hugging Face model's plan does by default: plan.offload is the example group's)
    assert plan.offload is not None and plan.offload.offloaded_bytes > 0
    assert plan.predicted_peak_bytes <= full.predicted_peak_bytes
    assert plan.predicted_overhead < full.predicted_overhead
    assert 0 < plan.offload.d2h_busy_ms <= plan.offload.forward_ms  # every copy out within the forward
    # how far it can be from the best plan with offloads: a proven bound on the re-runs of any of them
    assert plan.solver_status == "FEASIBLE" and plan.recompute_bound_ms is not None
    assert 0 <= plan.recompute_bound_ms <= plan.recompute_ms


def test_the_timeline_shows_what_the_offloads_keep_in_host_memory(gpt_prepared, tmp_path):
    """The notebook's timeline: the plan's line, and above it the band of what its offloads keep off the device,
    which is what the same plan holds without them; the legend says how much and how busy the link is."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    _, _, prepared = gpt_prepared
    solved, solution, budget = offloaded_solution(prepared, 1.0)
    plan = plan_from_solution(solved, solution, budget)
    timeline = plan.timeline
    without = plan_from_solution(solved, replace(solution, offloads=NO_OFFLOADS), budget)
    on_device = [*timeline.forward_bytes, *(b for b in timeline.backward_bytes if b is not None)]
    off = [*timeline.offloaded_forward_bytes, *(b for b in timeline.offloaded_backward_bytes if b is not None)]
    assert max(off) > 0 and max(b for b in timeline.offloaded_backward_bytes if b is not None) > 0
    whole = [*without.timeline.forward_bytes, *(b for b in without.timeline.backward_bytes if b is not None)]
    assert [a + b for a, b in zip(on_device, off)] == whole
    fig = planner.plot_timeline(plan)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    band = next(label for label in labels if label.startswith("offloaded to host memory"))
    assert "host link busy" in band and format_bytes(plan.offload.offloaded_bytes) in band
    fig.savefig(tmp_path / "timeline.png")
    assert not planner.plot_timeline(without).axes[0].collections  # no offloads, no band


def _llama_at_4096():
    """A Llama of 2 layers, width 1024, 4096 tokens, on this CPU, prepared for the GH200 spec (NVLink-C2C): where
    offloading pays at full checkpointing's peak, and a plan still runs here."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, use_cache=False,
                                      attn_implementation="sdpa", max_position_embeddings=4096)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(1, 512, (1, 4096))
    return model, ids


@pytest.mark.slow
def test_a_hugging_face_plan_that_follows_the_batch_offloads_per_group_with_exact_gradients():
    """Default options for a GPU spec: the plan follows the batch and offloads where ``offload="auto"`` for one
    shape does; each shape group gets its own offloads, chosen with its plan, and the root's offloader switches
    with the group (4096 tokens, then 3584, then 4096 again), on this CPU's tagged host store, with the unplanned
    model's gradients and every target found."""
    model, ids = _llama_at_4096()
    batch = {"input_ids": ids, "labels": ids}
    prepared = planner.prepare(model, inputs=batch, device="gh200")
    full = plan_from_solution(prepared, every_block(prepared.memory, 0), prepared.baseline.peak_bytes)
    plan = planner.plan_for(prepared, full.predicted_peak_bytes, time_limit_s=10, budget_bounds="allocated")
    one = planner.plan_for(planner.prepare(model, inputs=batch, device="gh200", follow_batch=False),
                           full.predicted_peak_bytes, time_limit_s=10, budget_bounds="allocated", offload="auto")
    assert plan.family is not None and plan.offload is not None and one.offload is not None
    assert plan.predicted_overhead < full.predicted_overhead
    offloader = offloader_of(plan.module)
    for tokens in (4096, 3584, 4096):
        call = {"input_ids": ids[:, :tokens], "labels": ids[:, :tokens]}
        offloader.host_peak_bytes = 0
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a target missed warns
            got = _grads(model, plan.module, call)
        group = plan.family.groups[plan.family.grid.group({"input_ids": (1, tokens), "labels": (1, tokens)})]
        assert offloader.missed == 0
        assert offloader.host_peak_bytes == (group.offload.offloaded_bytes if group.offload else 0)
        for a, b in zip(got, _grads(model, model, call)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(plan.family.groups) == 2 and "offloaded" in plan.summary()


@pytest.mark.parametrize(("n", "seed"), [(6, 0), (7, 1)])
def test_what_offloads_keep_off_the_device_bounds_every_plan_with_offloads_exactly(n, seed):
    """The bound on plans with offloads (``planning.offloading._offload_bound``) rests on one inequality, checked
    here on every plan of small random graphs and every set of its offloadable storages the link can carry: a plan
    whose offloads bring it under a budget peaks, without them, at most ``carried_bytes`` above that budget. So it
    re-runs at least the least any plan without offloads re-runs at that higher budget (the bound, brute force
    here), and the plan chosen with offloads is within its cost of the best one."""
    from itertools import combinations

    from conftest import random_graph

    from planner.memory.synthetic import all_plans
    from planner.planning.offloading import carried_bytes

    model, table = random_graph(n, seed)
    forward_us = int(model.node_cost_us.sum())
    top = simulate(model, ()).peak_bytes
    checked = 0
    for rate, host in ((1000 / forward_us, None), (3000 / forward_us, 1200), (10.0, None)):
        limits = OffloadLimits(link=HostLink(d2h_bytes_per_us=rate, h2d_bytes_per_us=rate, overlaps=True),
                               host_budget_bytes=host, min_bytes=1)
        carried = carried_bytes(limits, model, top)
        for plan in all_plans(model):
            plain = simulate(model, plan).peak_bytes
            held = holding(model, plan, frozenset())  # what the hooks or a cache hold (synthetic ops are unnamed,
            pool = [int(s) for s in np.flatnonzero(held.eligible & (model.size > 0))][:6]  # so none is markable)
            for k in range(1, len(pool) + 1):
                for chosen in combinations(pool, k):
                    if host is not None and sum(int(model.size[s]) for s in chosen) > host:
                        continue
                    offloads = schedule(model, plan, frozenset(), list(chosen), limits.link)
                    if offloads is None:
                        continue
                    peak = simulate(model, plan, frozenset(), offloads).peak_bytes
                    assert plain <= peak + carried, (plan, chosen)
                    bound = table.least_recompute(peak + carried)
                    assert bound is not None and bound <= simulate(model, plan).recompute_us
                    checked += 1
    assert checked > 100
