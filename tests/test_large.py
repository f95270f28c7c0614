"""Llama-3.1-8B's shapes on the meta device, planned for one rank of FSDP2 over 8 H100s (bf16, AdamW, 1 x 8192
tokens, the logits dropped before backward as torchtitan's loop does): nothing is allocated, the memory comes
from a meta replay, the times from the H100 roofline (``bench/large_models.py`` has the full table)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from planner import plan_for, prepare
from planner.memory.simulate import simulate
from planner.solve.baselines import op_sac

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from large_models import SHAPES, build

pytestmark = pytest.mark.slow  # about 30 s: an 8B graph of 2421 nodes


@pytest.fixture(scope="module")
def llama_8b():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model, batch = build(SHAPES["8b"])
    return prepare(model, inputs=batch, device="h100", world_size=8, optimizer="adamw", keep_output=False,
                   mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))


def test_8b_on_8_ranks_keeps_ops_inside_layers_and_re_runs_less_than_whole_segments(llama_8b):
    """At 52 GB (torchtitan's logged peak for its default selective policy, 52.44 GiB), the plan keeps op outputs
    inside the decoder layers (FSDP2 units) and re-runs less than the best whole-segment plan."""
    plan = plan_for(llama_8b, "52GB", time_limit_s=30)
    whole = plan_for(llama_8b, "52GB", time_limit_s=30, selective=False)
    assert plan.predicted_peak_bytes <= 52e9 and whole.predicted_peak_bytes <= 52e9
    assert sum(len(s.saved_ops) for s in plan.segments) > 0
    assert plan.recompute_ms < whole.recompute_ms
    layers = [f"model.layers.{i}" for i in range(32)]
    for seg in plan.segments:  # each segment re-runs at most one FSDP unit
        assert len({u for u in layers for m in seg.chain if m == u or m.startswith(u + ".")}) <= 1


def test_at_torchtitans_selective_policy_peak_the_plan_re_runs_no_more_than_it(llama_8b):
    """torchtitan's default op-level policy (``op_sac``) in the same cost model, and ckplan's plan at its peak."""
    from planner.planning.prepared import chunked

    wide = chunked(llama_8b, 4 * 32)  # every layer edge a cut position
    policy = op_sac(wide.memory, 0)
    peak = simulate(wide.memory, policy.plan, policy.saves).peak_bytes
    plan = plan_for(llama_8b, peak, time_limit_s=30)
    assert plan.predicted_peak_bytes <= peak
    assert plan.recompute_ms <= policy.recompute_us / 1000
