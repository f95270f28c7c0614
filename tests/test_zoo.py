"""Convnets with BatchNorm and in-place ops, and a ViT with SDPA dropout: exact, within budget."""

import pytest
import torch
from conftest import assert_plan_is_exact, plan_at, prepared_once
from zoo import MobileNetV2, ResNet18, ViT, images, labels_loss

from planner import InfeasibleBudget, optimize, plan_for
from planner.capture.api import FX

# (builder, batch, image size, reaches 50%): ResNet-18's stride-2 stem makes its first activations and
# their gradients the floor of any plan (~70-80% of the un-checkpointed peak at these sizes).
MODELS = {
    "resnet18": (lambda: ResNet18(8), 16, 128, False),
    "mobilenetv2": (MobileNetV2, 16, 64, True),
    "vit": (ViT, 16, 32, True),
}


@pytest.mark.slow
@pytest.mark.parametrize("budget", ["50%", "smallest"])
@pytest.mark.parametrize("name", list(MODELS))
def test_zoo_model(name, budget, restore_buffers):
    build, batch, size, reaches_half = MODELS[name]

    def made():
        torch.manual_seed(0)
        return build(), images(batch, size), labels_loss(batch)

    model, inputs, loss_fn, prepared = prepared_once(name, made)
    if budget == "50%" and not reaches_half:
        with pytest.raises(InfeasibleBudget) as info:
            plan_for(prepared, budget)
        assert info.value.min_peak_bytes > info.value.budget_bytes
        return
    plan = plan_at(prepared, budget)
    assert plan.capture_method == FX and plan.segments
    assert_plan_is_exact(model, plan, inputs, loss_fn, restore_buffers)


@pytest.mark.slow
@pytest.mark.parametrize("budget", ["50%", "smallest"])
def test_value_dependent_blocks_are_planned_on_their_own_forward(budget, restore_buffers):
    """fx cannot trace the blocks (value-dependent branch): the model is captured from one real forward
    (ATen tier) and its plan runs the model's own code with module hooks, so any branch runs exactly."""
    from zoo import GatedTower

    from planner.capture.api import ATEN

    torch.manual_seed(0)
    model, inputs = GatedTower(), (torch.randn(2048, 16),)
    loss_fn = labels_loss(2048)
    if budget == "smallest":
        with pytest.raises(InfeasibleBudget) as info:
            optimize(model, 1, inputs=inputs, loss_fn=loss_fn)
        budget = info.value.min_peak_bytes
    plan = optimize(model, budget, inputs=inputs, loss_fn=loss_fn)
    assert plan.capture_method == ATEN and len(plan.capture_notes) == 1
    assert plan.segments and all(seg.chain for seg in plan.segments)
    assert type(plan.module) is GatedTower
    assert_plan_is_exact(model, plan, inputs, loss_fn, restore_buffers)


def test_blocks_are_kept_opaque_when_no_real_forward_can_be_recorded(monkeypatch, restore_buffers):
    """The last tier: fx with the repeated blocks as single calls, when the ATen tier fails too."""
    from zoo import GatedTower

    import planner.capture.api as capture_api
    from planner.capture.api import FX_BLOCKS

    def refuse(*args, **kwargs):
        raise RuntimeError("no real forward here")

    monkeypatch.setattr(capture_api, "aten_graph", refuse)
    torch.manual_seed(0)
    model, inputs = GatedTower(), (torch.randn(2048, 16),)
    loss_fn = labels_loss(2048)
    plan = optimize(model, "50%", inputs=inputs, loss_fn=loss_fn)
    assert plan.capture_method == FX_BLOCKS and len(plan.capture_notes) == 2
    assert "no real forward here" in plan.capture_notes[1]
    assert plan.segments and all(path.startswith("layers.") or ":" in path or path in ("embed", "head")
                                 for seg in plan.segments for path in seg.module_paths)
    assert_plan_is_exact(model, plan, inputs, loss_fn, restore_buffers)
