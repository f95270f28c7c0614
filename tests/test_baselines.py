"""The strategies people use by hand, and the Rotor-style DP, as peers of CP-SAT."""

import pytest
import torch
from conftest import random_graph

from planner.memory.simulate import simulate
from planner.memory.synthetic import memory_model, random_profile
from planner.solve.baselines import every_block, no_checkpointing, sqrt_n
from planner.solve.deadline import Deadline
from planner.solve.default import solve
from planner.solve.peaks import min_peak
from planner.solve.result import NoSolution
from planner.solve.rotor import rotor


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(8))
def test_rotor_is_exact_on_small_chains(seed):
    model, table = random_graph(9, seed)
    lowest, highest = table.min_peak, simulate(model, ()).peak_bytes
    for budget in (lowest, (lowest + highest) // 2, highest - 1):
        assert rotor(model, budget, deadline=Deadline.after(30)).recompute_us == table.least_recompute(budget)
    with pytest.raises(NoSolution):
        rotor(model, lowest - 1, deadline=Deadline.after(30))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_rotor_equals_cpsat_on_50_node_chains(seed):
    model = memory_model(random_profile(50, seed))
    lowest = simulate(model, min_peak(model, deadline=Deadline.after(30))).peak_bytes
    highest = simulate(model, ()).peak_bytes
    for budget in (lowest, (lowest + highest) // 2, (lowest + 3 * highest) // 4):
        exact = solve(model, budget, deadline=Deadline.after(60))
        assert exact.status == "OPTIMAL"
        assert rotor(model, budget, deadline=Deadline.after(30)).recompute_us == exact.recompute_us


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_rotor_is_feasible_and_never_beats_cpsat_with_skip_connections(seed):
    model, table = random_graph(10, seed, True)
    lowest, highest = table.min_peak, simulate(model, ()).peak_bytes
    budget = (lowest + highest) // 2
    try:
        plan = rotor(model, budget, deadline=Deadline.after(30))
    except NoSolution:
        return  # conservative on storages that span chunks: may miss tight budgets
    assert simulate(model, plan.plan).peak_bytes <= budget
    assert plan.recompute_us >= table.least_recompute(budget)


def test_fixed_placements():
    model = memory_model(random_profile(16, 0))
    assert no_checkpointing(model, 0).plan == ()
    plan = sqrt_n(model, 0).plan  # no blocks: 16 chunks -> 4 groups, the last one not checkpointed
    assert plan == ((0, 4), (4, 8), (8, 12))
    with pytest.raises(ValueError, match="numbered blocks"):
        every_block(model, 0)


@pytest.mark.slow
def test_op_sac_keeps_torchtitans_ops_but_every_second_matmul_of_each_block():
    """torchtitan's default selective policy in the cost model: every block checkpointed, keeping each node whose
    fresh output comes from a listed op (matmuls with a bias, the attention kernel, communication ops) and every
    ``mm`` but the 2nd, 4th... of its block; at least every block's memory. On a Qwen2
    decoder, whose q/k/v projections have a bias (``addmm``) and whose others have none (``mm``)."""
    import transformers

    from planner import prepare
    from planner.solve.baselines import OP_SAC_MATMULS, OP_SAC_SAVES, op_sac

    config = transformers.Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    model = transformers.Qwen2ForCausalLM(config)
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    memory = prepare(model, inputs={"input_ids": ids, "labels": ids}, max_chunks=256).memory
    whole, selective = every_block(memory, 0), op_sac(memory, 0)
    assert len(whole.plan) == 3 and selective.plan == whole.plan
    for first, stop in whole.plan:
        lo, hi = memory.regions.starts[first], memory.regions.bounds(stop - 1)[1]
        matmuls = [i for i in range(lo, hi) if OP_SAC_MATMULS & set(memory.kernels[i])]
        others = [i for i in range(lo, hi) if (OP_SAC_SAVES - OP_SAC_MATMULS) & set(memory.kernels[i])]
        assert len(matmuls) == 4 and len(others) >= 3  # o, gate, up, down; q, k, v (addmm) and the attention
        kept = set(selective.saves) & set(range(lo, hi))
        assert kept <= set(matmuls[::2]) | set(others) and not kept & set(matmuls[1::2])
        assert len(kept) >= len(matmuls[::2]) + len(others) - 2  # all but what the cost model cannot express
    timeline = simulate(memory, selective.plan, selective.saves)  # what it re-runs depends on the op times (and
    assert timeline.recompute_us == selective.recompute_us      # on a CPU selective checkpointing's own cost)
    assert timeline.peak_bytes >= simulate(memory, whole.plan).peak_bytes
