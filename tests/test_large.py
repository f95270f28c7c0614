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


def _tiny_llama(**config) -> tuple[torch.nn.Module, dict]:
    import transformers

    settings = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=2, use_cache=False, tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**settings, **config}))
        ids = torch.randint(0, 4096, (2, 512))
    return model, {"input_ids": ids, "labels": ids}


def test_a_rank_of_a_tensor_parallel_job_holds_its_share_of_every_layer():
    """tensor_parallel=2 plans one rank from the config: the projections of the config's base_model_tp_plan hold
    half their parameters (embeddings, norms and head replicated), and each row-parallel output is all-reduced
    in forward (one more buffer of it at that node) and each column-parallel input's gradient in backward."""
    from planner.distributed.tensor import local_model

    model, batch = _tiny_llama()
    one = prepare(model, inputs=batch, device="h100", keep_output=False)
    two = prepare(model, inputs=batch, device="h100", keep_output=False, tensor_parallel=2)
    split = sum(p.numel() for name, p in model.named_parameters() if name.endswith("_proj.weight")) * 4
    assert one.profile.param_bytes - two.profile.param_bytes == split // 2
    rank, plan = local_model(model, 2)
    assert rank.config.num_attention_heads == 4 and rank.config.head_dim == 32  # the head size is kept
    assert plan.rowwise == ("model.layers.*.self_attn.o_proj", "model.layers.*.mlp.down_proj")
    alone = prepare(rank, inputs=batch, device="h100", keep_output=False)  # the same rank without collectives
    hidden = 2 * 512 * 256 * 4  # one all-reduced activation, float32
    rises = [b.fwd_peak_bytes - a.fwd_peak_bytes for a, b in zip(alone.profile.nodes, two.profile.nodes)]
    assert sorted(set(rises)) == [0, hidden] and rises.count(hidden) == 2 * 4  # o_proj, down_proj per layer
    grads = [b.bwd_peak_bytes - a.bwd_peak_bytes for a, b in zip(alone.profile.nodes, two.profile.nodes)
             if a.bwd_peak_bytes is not None]
    assert grads.count(hidden) == 5 * 4  # q, k, v, gate, up per layer
    assert two.profile.step_ms > alone.profile.step_ms  # the all-reduces take time on the interconnect


@pytest.mark.parametrize("model, options, says", [
    ("plain", {"tensor_parallel": 2, "device": "h100"}, "has not: parallelise the model with parallelize_module"),
    ("llama", {"tensor_parallel": 3, "device": "h100"}, "tensor_parallel=3 does not divide the model's"),
    ("llama", {"tensor_parallel": 2}, "pass device= \\(a device spec such as 'h100'\\)"),
    ("llama", {"tensor_parallel": 0, "device": "h100"}, "tensor_parallel must be an integer >= 1"),
])
def test_tensor_parallel_errors_say_what_to_do(model, options, says):
    from planner import OptionError

    net, batch = _tiny_llama() if model == "llama" else (torch.nn.Linear(4, 4), (torch.randn(2, 4),))
    with pytest.raises(OptionError, match=says):
        prepare(net, inputs=batch, **options)


def test_the_cli_plans_a_rank_of_fsdp_over_tensor_parallel(tmp_path):
    import json
    import subprocess

    model_file = tmp_path / "llama.py"
    model_file.write_text(f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                          "from test_large import _tiny_llama\nmodel, inputs = _tiny_llama()\n")
    done = subprocess.run([sys.executable, "-m", "planner", str(model_file), "--budget", "60%", "--device", "h100",
                           "--world-size", "2", "--tensor-parallel", "2", "--drop-output", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["segments"] and report["predicted_peak_bytes"] <= report["budget_bytes"]
