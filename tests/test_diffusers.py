"""diffusers models as they are fine-tuned: an SD-style UNet (cross-attention down/up blocks, a timestep, text
states), an SD3 transformer (MMDiT: joint attention over image and text tokens) and a VAE (encode, decode, a
reconstruction loss), built from tiny configs with random weights (nothing downloaded).

Each is planned with ``optimize`` and in place with ``enable``: every gradient equals the unplanned model's, the
measured peak fits the budget, the prediction is within 1% of it and never under; so with LoRA adapters on the
UNet (base frozen). At the measured peak of diffusers' own checkpointing (``enable_gradient_checkpointing()``,
every block) ckplan's plan re-runs fewer forward FLOPs (counted by ``FlopCounterMode``: a checkpointed step's
backward is the plain backward plus its re-runs). On a planned model, ``enable_gradient_checkpointing()`` leaves
diffusers' checkpointing off with a warning.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from conftest import Calls, training_step
from torch.utils.flop_counter import FlopCounterMode

from planner import disable, enable, optimize
from planner.capture.inputs import as_inputs
from planner.profiling.measure import measure_peak

diffusers = pytest.importorskip("diffusers")
pytestmark = pytest.mark.slow


def _unet() -> torch.nn.Module:
    """Stable Diffusion's UNet layout, narrow: a cross-attention down block, a plain one, the mid block, and back."""
    return diffusers.UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8)


def _sd3() -> torch.nn.Module:
    """SD3's MMDiT, 3 joint blocks of width 64 (the last one context-pre-only, as in SD3)."""
    return diffusers.SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=4, out_channels=4, num_layers=3, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=64, pooled_projection_dim=32,
        pos_embed_max_size=32)


def _vae() -> torch.nn.Module:
    return diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32), layers_per_block=1, latent_channels=4,
        norm_num_groups=8, sample_size=32)


@dataclass(frozen=True, kw_only=True)
class Family:
    build: Callable[[], torch.nn.Module]
    batch: dict[str, torch.Tensor]
    """The keyword arguments of one training call."""
    target: torch.Tensor
    """What the output's ``sample`` is regressed on: the noise (UNet), the flow target (SD3), the image (VAE)."""
    budget: str
    """Of the un-checkpointed peak; the smallest peaks the families reach are about 60%, 56% and 34% of it."""

    def model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        return self.build().train()

    def loss_fn(self, output) -> torch.Tensor:
        return F.mse_loss(output.sample, self.target)


def _families() -> dict[str, Family]:
    g = torch.Generator().manual_seed(0)
    text = torch.randn(2, 8, 32, generator=g)
    image = torch.randn(2, 3, 32, 32, generator=g)
    timestep = torch.tensor([10, 500])
    return {
        "unet": Family(build=_unet, batch={"sample": torch.randn(2, 4, 16, 16, generator=g), "timestep": timestep,
                                           "encoder_hidden_states": text},
                       target=torch.randn(2, 4, 16, 16, generator=g), budget="75%"),
        "sd3": Family(build=_sd3, batch={"hidden_states": torch.randn(2, 4, 32, 32, generator=g), "timestep": timestep,
                                         "encoder_hidden_states": text,
                                         "pooled_projections": torch.randn(2, 32, generator=g)},
                      target=torch.randn(2, 4, 32, 32, generator=g), budget="70%"),
        "vae": Family(build=_vae, batch={"sample": image}, target=image, budget="55%"),
    }


FAMILIES = _families()


def _same_step(family: Family, reference: torch.nn.Module, module: torch.nn.Module, owner: torch.nn.Module) -> None:
    """One step of ``module`` (with ``owner``'s parameters) equals one of ``reference``: loss and every gradient."""
    expected = training_step(reference, reference, family.batch, family.loss_fn, seed=7)
    actual = training_step(module, owner, family.batch, family.loss_fn, seed=7)
    assert family.loss_fn(actual[0]).item() == family.loss_fn(expected[0]).item()
    assert actual[1].keys() == expected[1].keys() == {n for n, p in owner.named_parameters() if p.requires_grad}
    for name in expected[1]:
        torch.testing.assert_close(actual[1][name], expected[1][name], rtol=1e-6, atol=1e-7, msg=name)


def _fits_and_is_predicted(family: Family, plan, module: torch.nn.Module) -> int:
    measured = measure_peak(module, as_inputs(module, family.batch), family.loss_fn)
    assert measured <= plan.budget_bytes
    assert measured <= plan.predicted_peak_bytes <= 1.01 * measured, (measured, plan.predicted_peak_bytes)
    return measured


@pytest.mark.parametrize("name", FAMILIES)
def test_optimize_trains_exactly_within_budget(name):
    family = FAMILIES[name]
    model = family.model()
    plan = optimize(model, family.budget, inputs=family.batch, loss_fn=family.loss_fn, time_limit_s=10)
    assert type(plan.module) is type(model) and plan.segments
    assert plan.capture_method == "aten"  # diffusers' forwards branch on tensors: recorded from one real forward
    _same_step(family, model, plan.module, model)
    _fits_and_is_predicted(family, plan, plan.module)


@pytest.mark.parametrize("name", FAMILIES)
def test_enable_plans_in_place_and_disable_undoes_it(name):
    family = FAMILIES[name]
    model, reference = family.model(), family.model()
    inputs = as_inputs(model, family.batch)
    hooks = {path: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for path, m in model.named_modules()}
    unplanned = measure_peak(model, inputs, family.loss_fn)
    plan = enable(model, family.budget, inputs=family.batch, loss_fn=family.loss_fn, time_limit_s=10)
    assert plan.module is model and plan.segments
    _same_step(family, reference, model, model)
    assert _fits_and_is_predicted(family, plan, model) < unplanned
    disable(model)
    assert {path: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for path, m in model.named_modules()} == hooks
    assert measure_peak(model, inputs, family.loss_fn) == unplanned


def test_lora_adapters_get_exact_gradients_within_budget():
    """LoRA as diffusers' fine-tuning scripts add it (base frozen, ``add_adapter`` on the attention projections): only
    the adapters train, their gradients equal the unplanned model's, the plan fits and is predicted."""
    pytest.importorskip("peft")
    from peft import LoraConfig

    family = FAMILIES["unet"]

    def lora_unet() -> torch.nn.Module:
        model = family.model().requires_grad_(False)
        model.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                     target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
        return model

    model = lora_unet()
    plan = optimize(model, "60%", inputs=family.batch, loss_fn=family.loss_fn, time_limit_s=10)
    assert plan.segments
    trainable = {n for n, p in plan.module.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    _same_step(family, lora_unet(), plan.module, model)
    _fits_and_is_predicted(family, plan, plan.module)


def _rerun_flops(module: torch.nn.Module, family: Family) -> int:
    """FLOPs of one step's backward (the plain backward plus whatever it re-runs)."""
    output = module(**family.batch)
    loss = family.loss_fn(output)
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    for p in module.parameters():
        p.grad = None
    return counter.get_total_flops()


@pytest.mark.parametrize("name", FAMILIES)
def test_at_the_peak_of_diffusers_checkpointing_the_plan_re_runs_less(name):
    """diffusers' own checkpointing (every resnet and transformer block, non-reentrant) and ckplan planned at its
    measured peak: ckplan measures no higher, is predicted within 1%, and re-runs fewer forward FLOPs."""
    family = FAMILIES[name]
    model, theirs = family.model(), family.model()
    theirs.enable_gradient_checkpointing()
    inputs = as_inputs(model, family.batch)
    peak = measure_peak(theirs, inputs, family.loss_fn)
    assert peak < measure_peak(model, inputs, family.loss_fn)
    plan = optimize(model, peak, inputs=family.batch, loss_fn=family.loss_fn, time_limit_s=10)
    _fits_and_is_predicted(family, plan, plan.module)
    plain = _rerun_flops(model, family)
    ours, diffusers_own = _rerun_flops(plan.module, family) - plain, _rerun_flops(theirs, family) - plain
    assert 0 < ours < diffusers_own, (ours, diffusers_own)


def _calls_per_step(module: torch.nn.Module, family: Family, path: str) -> int:
    calls = Calls(module.get_submodule(path))
    training_step(module, module, family.batch, family.loss_fn)
    calls.handle.remove()
    return calls.count


def test_a_planned_unet_leaves_diffusers_checkpointing_off():
    """``enable_gradient_checkpointing()`` on a model planned in place, and on ``plan.module``: a one-line warning,
    diffusers' checkpointing stays off, each block runs as often per step as under the plan alone (never
    checkpointed twice). A model planned with its own checkpointing on is planned for the step without it and keeps
    its setting; ``disable`` gives diffusers its method back."""
    family, block = FAMILIES["unet"], "down_blocks.0.resnets.0"  # diffusers checkpoints each resnet
    plain, theirs = family.model(), family.model()
    theirs.enable_gradient_checkpointing()
    assert _calls_per_step(theirs, family, block) == 2 * _calls_per_step(plain, family, block)  # diffusers re-runs it

    model = family.model()
    enable(model, family.budget, inputs=family.batch, loss_fn=family.loss_fn, time_limit_s=10)
    alone = _calls_per_step(model, family, block)
    with pytest.warns(UserWarning, match=r"enable_gradient_checkpointing\(\) left diffusers' checkpointing off"):
        model.enable_gradient_checkpointing()
    assert not model.is_gradient_checkpointing
    assert _calls_per_step(model, family, block) == alone  # the plan's re-runs, and no other
    disable(model)
    model.enable_gradient_checkpointing()
    assert model.is_gradient_checkpointing

    plan = optimize(theirs, family.budget, inputs=family.batch, loss_fn=family.loss_fn, time_limit_s=10)
    assert theirs.is_gradient_checkpointing and not plan.module.is_gradient_checkpointing
    _fits_and_is_predicted(family, plan, plan.module)
    with pytest.warns(UserWarning, match="left diffusers' checkpointing off"):
        plan.module.enable_gradient_checkpointing()
    assert not plan.module.is_gradient_checkpointing and theirs.is_gradient_checkpointing


def test_a_compilable_unet_plan_compiles_in_the_unplanned_models_graphs_and_trains_like_it():
    """``compilable=True``: every segment one module call (resnets, feed-forwards), run through
    ``torch.utils.checkpoint`` in compiled code; ``torch.compile`` of the plan makes the graphs the unplanned UNet
    makes, and a step of it gives the unplanned UNet compiled's loss and gradients (AOTAutograd without inductor,
    which a full suite's second worker slows past 3 minutes; within 1e-6)."""
    family = FAMILIES["unet"]
    model = family.model()
    reference = family.model()
    plan = optimize(model, family.budget, inputs=family.batch, loss_fn=family.loss_fn, compilable=True,
                    follow_batch=False)
    assert plan.segments and all(len(s.chain) == 1 for s in plan.segments)
    torch._dynamo.reset()
    graphs = torch._dynamo.explain(reference)(**family.batch).graph_count
    assert torch._dynamo.explain(plan.module)(**family.batch).graph_count == graphs
    torch._dynamo.reset()
    expected = training_step(torch.compile(reference, backend="aot_eager"), reference, family.batch, family.loss_fn,
                             seed=7)
    actual = training_step(torch.compile(plan.module, backend="aot_eager"), plan.module, family.batch, family.loss_fn,
                           seed=7)
    torch.testing.assert_close(family.loss_fn(actual[0]), family.loss_fn(expected[0]), rtol=1e-6, atol=1e-7)
    for name in expected[1]:
        torch.testing.assert_close(actual[1][name], expected[1][name], rtol=1e-5, atol=1e-6, msg=name)
