"""Plans that follow the batch (``follow_batch=True``): each training call runs the plan of its own shape's
group, planned when first seen; the same losses and gradients as the unplanned model at every shape, each
shape's measured peak within the budget, no checkpoint where the plain step fits."""

from __future__ import annotations

import pytest
import torch
from conftest import greedy_generations
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from planner import InfeasibleBudget, PlanOptions, disable, enable, load_plan, optimize
from planner.capture.inputs import as_inputs
from planner.follow.shapes import ShapeGrid, ShapeRange
from planner.profiling.measure import measure_peak

VOCAB = 1000


def make_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=384,
                                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2))
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=128, n_layer=3, n_head=4))


def batch(rows: int, length: int, padded: bool = False) -> dict:
    """A batch of token ids; ``padded``: rows right-padded to ``length`` as a padding collator gives them (the
    model's forward then reads the mask's values and attends with a mask)."""
    ids = torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(rows * 1000 + length))
    if not padded:
        return {"input_ids": ids, "labels": ids}
    mask = (torch.arange(length)[None, :] < torch.linspace(length // 2, length, rows).long()[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def grads_after_step(module: torch.nn.Module, inputs: dict) -> tuple[float, list[torch.Tensor]]:
    for p in module.parameters():
        p.grad = None
    torch.manual_seed(1)
    loss = module(**inputs).loss
    loss.backward()
    grads = [p.grad.clone() for p in module.parameters() if p.requires_grad]
    for p in module.parameters():
        p.grad = None
    return loss.item(), grads


@pytest.fixture(scope="module", params=["qwen2", "gpt2"])
def followed(request):
    model = make_model(request.param)
    plan = optimize(model, "70%", inputs=batch(4, 128), follow_batch=True, keep_output=False, time_limit_s=10,
                    selective=False)
    return model, plan


SHAPES = [(4, 128), (4, 64), (2, 16), (4, 96), (3, 128), (4, 100)]


@pytest.mark.slow
def test_every_shape_runs_its_own_plan_with_exact_gradients_within_the_budget(followed):
    model, plan = followed
    assert plan.family is not None and plan.segments
    for rows, length in SHAPES:
        inputs = batch(rows, length)
        expected, reference = grads_after_step(model, inputs)
        loss, grads = grads_after_step(plan.module, inputs)
        assert loss == expected and all(torch.equal(a, b) for a, b in zip(grads, reference)), (rows, length)
        peak = measure_peak(plan.module, as_inputs(plan.module, inputs), keep_output=False)
        key = plan.family.grid.group({k: tuple(v.shape) for k, v in inputs.items()})
        group = plan.family.groups[key]
        assert peak <= plan.budget_bytes, (rows, length, peak)
        assert group.predicted_peak_bytes >= peak, (rows, length)  # the group's plan covers its shapes
        if dict(key)["input_ids"] == (rows, length):  # the group's own upper shape: predicted within 1%
            assert group.predicted_peak_bytes <= 1.01 * peak, (rows, length)
    small = plan.family.groups[plan.family.grid.group({"input_ids": (2, 16), "labels": (2, 16)})]
    assert small.baseline_peak_bytes <= plan.budget_bytes and not small.segments  # fits: nothing checkpointed
    assert len({g.segments for g in plan.family.groups.values()}) > 2  # lighter plans for lighter groups


@pytest.mark.slow
def test_a_shape_above_the_example_is_planned_within_the_budget_or_refused(followed):
    model, plan = followed
    inputs = batch(4, 144)
    loss, grads = grads_after_step(plan.module, inputs)
    expected, reference = grads_after_step(model, inputs)
    assert loss == expected and all(torch.equal(a, b) for a, b in zip(grads, reference))
    assert measure_peak(plan.module, as_inputs(plan.module, inputs), keep_output=False) <= plan.budget_bytes
    with pytest.raises(InfeasibleBudget):  # far above: no plan fits the same budget
        plan.module(**batch(16, 512)).loss.backward()


@pytest.mark.slow
def test_the_saved_family_keeps_every_group(followed, tmp_path):
    model, plan = followed
    plan.module(**batch(4, 64)).loss.backward()  # a second group, planned now
    plan.save(tmp_path / "plan.json")
    loaded = load_plan(tmp_path / "plan.json")
    assert loaded.family is not None and loaded.family.groups == plan.family.groups
    module = loaded.apply(model)
    for rows, length in ((4, 128), (4, 64), (4, 32)):  # 4 x 32: planned by the loaded family
        inputs = batch(rows, length)
        loss, grads = grads_after_step(module, inputs)
        expected, reference = grads_after_step(model, inputs)
        assert loss == expected and all(torch.equal(a, b) for a, b in zip(grads, reference))


def test_the_grid_groups_shapes_up_to_lines_through_the_example():
    grid = ShapeGrid.around({"input_ids": (8, 512)})
    assert grid.steps == {"input_ids": (1, 32)}
    assert grid.group({"input_ids": (8, 512)}) == (("input_ids", (8, 512)),)
    assert grid.group({"input_ids": (8, 481)}) == (("input_ids", (8, 512)),)
    assert grid.group({"input_ids": (8, 480)}) == (("input_ids", (8, 480)),)
    assert grid.group({"input_ids": (3, 513)}) == (("input_ids", (3, 544)),)
    assert grid.group({"input_ids": (8,)}) is None  # another number of dims: refused with its name
    assert grid.group({"other": (8, 500)}) == (("other", (8, 500)),)  # an argument the example lacks: as it is
    two = ShapeGrid.around({"input_ids": (8, 512), "attention_mask": (8, 512)})
    assert two.group({"input_ids": (8, 500)}) == (("input_ids", (8, 512)),)  # without the mask: its own group
    masked = grid.group({"input_ids": (8, 500), "attention_mask": (8, 500)})  # a mask the example lacked
    assert masked == (("attention_mask", (8, 512)), ("input_ids", (8, 512)))  # rounded as input_ids is


def test_a_range_is_planned_as_every_group_that_covers_it():
    from planner import OptionError

    grid = ShapeGrid.around({"input_ids": (8, 512)})
    assert grid.covering("input_ids", ShapeRange((8, 64), (8, 160))) == [(8, 64), (8, 96), (8, 128), (8, 160)]
    covered = grid.covering("input_ids", ShapeRange((7, 70), (8, 100)))  # 70 and 100 fall in the 96 and 128 groups
    assert covered == [(7, 96), (7, 128), (8, 96), (8, 128)]
    assert {grid.group({"input_ids": (rows, n)}) for rows in (7, 8) for n in range(70, 101)} == \
        {(("input_ids", shape),) for shape in covered}
    with pytest.raises(OptionError, match=r"covers 512 shape groups \(32 x 16\); plan at most 64 ahead"):
        grid.covering("input_ids", ShapeRange((1, 1), (32, 512)))
    with pytest.raises(OptionError, match="must run from a smaller shape to a larger one"):
        ShapeRange((8, 128), (4, 512))
    span = ShapeRange((4, 64), (4, 128))
    assert PlanOptions(shapes=span).shapes == (span,) and PlanOptions(shapes=span).follow_batch


@pytest.mark.slow
def test_enable_follows_the_batch_on_the_models_own_object_and_disable_takes_it_off():
    model = make_model("qwen2")
    expected, reference = grads_after_step(model, batch(4, 64))
    plan = enable(model, "60%", inputs=batch(4, 128), follow_batch=True, keep_output=False, time_limit_s=10,
                  selective=False)
    assert plan.module is model
    loss, grads = grads_after_step(model, batch(4, 64))
    assert loss == expected and all(torch.equal(a, b) for a, b in zip(grads, reference))
    assert disable(model) and not model._forward_pre_hooks


def _snapshot(model: torch.nn.Module) -> dict:
    """Everything of ``model`` a planning must leave as it was: each parameter and buffer object with its value,
    device and gradient, every module's train flag and hooks."""
    return {"parameters": [(name, p, p.detach().clone(), p.grad, p.requires_grad)
                           for name, p in model.named_parameters()],
            "buffers": [(name, b, b.clone()) for name, b in model.named_buffers()],
            "modules": [(name, m.training, {key: list(value) for key, value in vars(m).items()
                                            if key.endswith("hooks") or "hooks_" in key})
                        for name, m in model.named_modules()]}


def _assert_as_before(model: torch.nn.Module, before: dict) -> None:
    for (name, p, value, grad, requires), (now, q) in zip(before["parameters"], model.named_parameters()):
        assert now == name and q is p and not p.is_meta and torch.equal(p.detach(), value), name
        assert p.grad is grad and p.requires_grad == requires, name
    for (name, b, value), (now, c) in zip(before["buffers"], model.named_buffers()):
        assert now == name and c is b and torch.equal(b, value), name
    assert [(name, m.training, {key: list(value) for key, value in vars(m).items()
                                if key.endswith("hooks") or "hooks_" in key})
            for name, m in model.named_modules()] == before["modules"]


@pytest.mark.slow
@pytest.mark.parametrize("where", ["capture", "meta replay", "solve"])
def test_an_interrupted_first_sight_planning_leaves_the_model_as_it_was(where, monkeypatch):
    """A group first seen in training is planned inside the forward of the user's own object (enable). A
    Ctrl-C there, wherever it lands, leaves every parameter, gradient, buffer and hook as it was; during
    the planning the model's own parameters are never swapped for meta tensors; the next call plans the
    group and trains exactly."""
    import planner.capture.api as capture_api
    import planner.follow.family as family_module
    from planner.profiling.recorder import MemoryRecorder

    model = make_model("qwen2")
    plan = enable(model, "60%", inputs=batch(4, 128), follow_batch=True, keep_output=False, time_limit_s=10,
                  selective=False)
    for p in model.parameters():  # an accumulated gradient, as between two micro-batches
        p.grad = torch.ones_like(p)
    before = _snapshot(model)
    seen = []

    def interrupt(*args, **kwargs):  # a Ctrl-C at that point
        assert not any(p.is_meta for p in model.parameters())  # the user's tree is never swapped
        seen.append(where)
        raise KeyboardInterrupt

    targets = {"capture": (capture_api, "aten_graph"), "meta replay": (MemoryRecorder, "step"),
               "solve": (family_module, "solve_prepared")}
    owner, name = targets[where]
    monkeypatch.setattr(owner, name, interrupt)  # enable() has planned: this is the new group's planning
    with pytest.raises(KeyboardInterrupt):
        model(**batch(4, 64)).loss.backward()
    assert seen == [where]
    _assert_as_before(model, before)
    monkeypatch.undo()
    for p in model.parameters():
        p.grad = None
    reference_model = make_model("qwen2")
    expected, reference = grads_after_step(reference_model, batch(4, 64))
    loss, grads = grads_after_step(model, batch(4, 64))  # planned now, in this call
    assert loss == expected and all(torch.equal(a, b) for a, b in zip(grads, reference))
    assert len(plan.family.groups) == 2


@pytest.mark.slow
def test_trainer_with_dynamic_padding_trains_like_the_unplanned_model(tmp_path):
    """transformers.Trainer with DataCollatorForLanguageModeling (each batch padded to its longest row), the
    plan following the batch: the same losses as the unplanned model, several shape groups planned."""
    import transformers
    from tokenizers import Tokenizer, models

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")), pad_token="[PAD]", unk_token="[UNK]")
    generator = torch.Generator().manual_seed(0)
    lengths = [128, 40, 96, 24, 64, 120, 32, 80]
    rows = [{"input_ids": torch.randint(2, VOCAB, (n,), generator=generator).tolist()} for n in lengths]
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)

    def train(make_module):
        model = make_model("gpt2")
        args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2,
                                              report_to=[], seed=1, data_seed=1, logging_steps=1, save_strategy="no",
                                              use_cpu=True, dataloader_num_workers=0)
        trainer = transformers.Trainer(model=make_module(model), args=args, train_dataset=rows, data_collator=collator)
        trainer.train()
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    plain = train(lambda m: m)
    plans = []

    def planned(model):
        plans.append(optimize(model, "70%", inputs=collator(rows[:2]), keep_output=False, follow_batch=True,
                              time_limit_s=10, selective=False))
        return plans[-1].module

    ours = train(planned)
    assert len(plain) == 4 and ours == plain
    assert len(plans[0].family.groups) > 1


@pytest.mark.slow
def test_shapes_named_ahead_are_planned_before_training_and_run_without_planning():
    model = make_model("qwen2")
    plan = optimize(model, "70%", inputs=batch(4, 128), shapes=[(2, 16), {"input_ids": (4, 64), "labels": (4, 64)}],
                    keep_output=False, time_limit_s=10, selective=False)
    assert plan.family is not None and len(plan.family.groups) == 3
    rows = plan.family.table()
    assert [r["shapes"]["input_ids"] for r in rows] == [(2, 16), (4, 64), (4, 128)]
    assert rows[0]["segments"] == 0 and rows[0]["baseline_peak_bytes"] <= plan.budget_bytes  # fits: none
    assert all(r["predicted_peak_bytes"] <= plan.budget_bytes for r in rows)
    assert rows[2]["overhead"] >= rows[1]["overhead"] >= rows[0]["overhead"] == 0
    for rows_, length in ((2, 16), (4, 64)):
        inputs = batch(rows_, length)
        expected, reference = grads_after_step(model, inputs)
        loss, grads = grads_after_step(plan.module, inputs)
        assert loss == expected and all(torch.equal(a, b) for a, b in zip(grads, reference))
    assert len(plan.family.groups) == 3  # nothing planned while training


@pytest.mark.slow
def test_every_group_counts_the_optimizer_state_also_when_planned_from_a_saved_plan(tmp_path):
    """``optimizer="adamw"``: each group's step holds AdamW's state besides its own, as ``optimize`` at that
    shape counts it; a saved family planning a new group on a fresh model counts it too. (The meta replay at a
    group's shape reads a few KiB above the measured profile there; AdamW's state here is 6.5 MiB.)"""
    model = make_model("qwen2")
    plan = optimize(model, "70%", inputs=batch(4, 128), follow_batch=True, keep_output=False, time_limit_s=10,
                    selective=False, optimizer="adamw", must_save=["lm_head"])
    direct = optimize(model, plan.budget_bytes, inputs=batch(4, 64), keep_output=False, time_limit_s=10,
                      selective=False, optimizer="adamw")
    group = plan.family.plan_ahead((4, 64))[0]
    assert direct.baseline_peak_bytes <= group.baseline_peak_bytes <= 1.001 * direct.baseline_peak_bytes
    plan.save(tmp_path / "plan.json")
    loaded = load_plan(tmp_path / "plan.json")
    assert loaded.family.loop == plan.family.loop and loaded.family.options.must_save == ("lm_head",)
    assert loaded.family.loop.optimizer is not None and loaded.family.loop.optimizer.kind == "AdamW"
    module = loaded.apply(make_model("qwen2"))
    module(**batch(4, 32)).loss.backward()  # a new group, planned by the loaded family on the fresh model
    direct = optimize(model, plan.budget_bytes, inputs=batch(4, 32), keep_output=False, time_limit_s=10,
                      selective=False, optimizer="adamw")
    key = loaded.family.grid.group({"input_ids": (4, 32), "labels": (4, 32)})
    group = loaded.family.groups[key]
    assert direct.baseline_peak_bytes <= group.baseline_peak_bytes <= 1.001 * direct.baseline_peak_bytes


def test_a_loss_bound_to_the_example_targets_names_the_group_it_cannot_follow():
    from planner import ProfileError

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    x, targets = torch.randn(64, 16), torch.randint(0, 4, (64,))
    with pytest.raises(ProfileError, match=r"planning calls shaped input \(32, 16\) .*loss_fn holding the example "
                                           r"batch's targets cannot follow it") as err:
        optimize(model, "100%", inputs=(x,), loss_fn=lambda out: torch.nn.functional.cross_entropy(out, targets),
                 shapes=[(32, 16)], time_limit_s=5)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("shapes, message", [
    ([(4, 0)], "positive ints"),
    (["4x128"], "must be a shape"),
    ([{"input_ids": (4,)}], "give it 2 dims"),
    ([{"pixel_values": (4, 3)}], "not a tensor argument"),
])
def test_a_bad_shape_to_plan_ahead_is_one_line_naming_it(shapes, message):
    from planner import OptionError
    from planner.follow.shapes import check_spec, realize

    example = batch(4, 128)
    with pytest.raises(OptionError, match=message) as err:
        for spec in shapes:
            realize(check_spec(spec), example)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_lora_follows_the_batch_and_generate_runs_no_checkpoint():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(make_model("qwen2"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model.train()
    plan = optimize(model, "70%", inputs=batch(4, 128), follow_batch=True, keep_output=False, time_limit_s=10,
                    selective=False)
    for rows, length in ((4, 128), (2, 32)):
        inputs = batch(rows, length)
        expected, reference = grads_after_step(model, inputs)
        loss, grads = grads_after_step(plan.module, inputs)
        assert loss == expected and all(torch.equal(a, b) for a, b in zip(grads, reference))
    assert {n for n, p in plan.module.named_parameters() if p.requires_grad} == \
        {n for n, p in model.named_parameters() if p.requires_grad}
    groups = len(plan.family.groups)
    prompt = {"input_ids": batch(2, 8)["input_ids"]}
    ours, theirs = greedy_generations(plan.module, model, prompt)
    assert torch.equal(ours, theirs) and len(plan.family.groups) == groups  # generating plans nothing


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen2", "gpt2"])
def test_padded_batches_are_predicted_exactly_at_their_groups_shapes(kind):
    """Padded batches (attention with a mask, the forward reading the mask's values): each group's plan,
    from the meta replay at its shape, predicts the measured peak within 1% and never under; exact gradients."""
    model = make_model(kind)
    plan = optimize(model, "70%", inputs=batch(4, 128, padded=True), follow_batch=True, keep_output=False,
                    time_limit_s=10, selective=False)
    for rows, length in ((4, 128), (4, 88), (4, 40)):
        inputs = batch(rows, length, padded=True)
        expected, reference = grads_after_step(model, inputs)
        loss, grads = grads_after_step(plan.module, inputs)
        assert loss == expected and all(torch.equal(a, b) for a, b in zip(grads, reference)), (rows, length)
        peak = measure_peak(plan.module, as_inputs(plan.module, inputs), keep_output=False)
        group = plan.family.groups[plan.family.grid.group({k: tuple(v.shape) for k, v in inputs.items()})]
        assert peak <= plan.budget_bytes and peak <= group.predicted_peak_bytes <= 1.01 * peak, (rows, length)


def test_plot_shapes_draws_each_group_of_a_plan_that_follows_the_batch():
    pytest.importorskip("matplotlib")
    from planner import plot_shapes

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                                torch.nn.GELU(), torch.nn.Linear(256, 64))
    plan = optimize(model, "90%", inputs=(torch.randn(512, 64),), shapes=[(32, 64), (256, 64)], time_limit_s=10)
    fig = plot_shapes(plan)
    overhead, peaks = fig.axes
    rows = plan.family.table()
    assert list(overhead.lines[0].get_xdata()) == [32 * 64, 256 * 64, 512 * 64]
    assert list(overhead.lines[0].get_ydata()) == [100 * r["overhead"] for r in rows]
    assert list(peaks.lines[1].get_ydata()) == [r["predicted_peak_bytes"] / 2**20 for r in rows]
    with pytest.raises(ValueError, match="does not follow the batch"):
        plot_shapes(optimize(model, "90%", inputs=(torch.randn(512, 64),), time_limit_s=10))


def test_a_hugging_face_plan_follows_the_batch_by_default_and_says_when_it_plans(capsys):
    """No follow_batch given: a plan run by module hooks whose loss is the model's own output follows the batch.
    A training call of a new shape group plans it, with one line on stderr that names the group and what it
    planned; the next call of that group plans nothing and prints nothing."""
    model = make_model("qwen2")
    plan = optimize(model, "70%", inputs=batch(4, 128), keep_output=False, time_limit_s=10, selective=False)
    assert plan.family is not None and len(plan.family.groups) == 1
    capsys.readouterr()
    for _ in range(2):
        plan.module(**batch(2, 16)).loss.backward()
    lines = capsys.readouterr().err.splitlines()
    said = [line for line in lines if line.startswith("ckplan: planned a new shape group")]
    assert len(said) == 1 and "input_ids (2, 16)" in said[0] and "predicted peak" in said[0], lines
    assert len(plan.family.groups) == 2


@pytest.mark.parametrize("how", ["follow_batch=False", "loss_fn", "fx graph"])
def test_one_plan_runs_every_shape_where_following_is_turned_off_or_could_go_wrong(how):
    """follow_batch=False, a loss function of the user's own (it may hold the example batch's targets), or a plan
    run as a rewritten graph (made for one shape): no family, unless asked for."""
    if how == "fx graph":
        from models import tower, tower_inputs

        plan = optimize(tower(), "70%", inputs=tower_inputs(), time_limit_s=10)
    else:
        model, inputs = make_model("qwen2"), batch(4, 64)
        options = {"follow_batch": False} if how == "follow_batch=False" else {"loss_fn": lambda out: out.loss}
        plan = optimize(model, "70%", inputs=inputs, keep_output=False, time_limit_s=10, selective=False,
                        **options)
    assert plan.family is None


def test_follow_batch_false_is_taken_where_following_does_not_apply():
    """follow_batch=False asks an entry point that plans one shape for nothing it does not do anyway."""
    from planner.options import resolve

    assert resolve(None, {"follow_batch": False}, where="optimize_compiled").follow_batch is False
    with pytest.raises(ValueError, match="follow_batch"):
        resolve(None, {"follow_batch": True}, where="optimize_compiled")


def test_a_forward_set_on_the_instance_runs_the_copy_it_was_cloned_into():
    """accelerate sets ``model.forward`` on the instance, bound to the model (its autocast wrapper): a copy ckplan
    plans a shape group on calls its own modules through it, never the user's model."""
    from types import MethodType

    from planner.capture.tree import clone_tree, private_copy

    model = make_model("qwen2")
    plain = type(model).forward

    def wrapped(self, *args, **kwargs):
        return plain(self, *args, **kwargs)

    model.forward = MethodType(wrapped, model)
    for copy in (clone_tree(model)[0], private_copy(model)[0]):
        assert copy.forward.__self__ is copy and model.forward.__self__ is model


def _memory_of(prof) -> tuple:
    """What a profile says about memory, node by node and storage by storage (times are measured, so noisy)."""
    nodes = tuple((n.name, n.fwd_start_bytes, n.fwd_peak_bytes, n.bwd_start_bytes, n.bwd_peak_bytes, n.inputs,
                   n.outputs, n.saves) for n in prof.nodes)
    return (nodes, tuple(prof.storages), prof.param_bytes, prof.grad_bytes, prof.baseline_peak_bytes,
            prof.fingerprint, prof.keep_output)


@pytest.mark.parametrize("autocast", [None, "bf16"])
def test_profile_optimize_and_a_shape_group_profile_the_same_step(autocast):
    """``planner.profile``, ``prepare`` (what ``optimize`` and ``enable`` plan from) and a shape group of a plan
    that follows the batch, planned at the example's own shape, go through one step preparation: the same
    graph and the same bytes, node by node (the fp32 group's from a meta replay, the others measured; under
    autocast, which meta tensors do not run, a group no larger than the example's is measured too)."""
    from planner import prepare, profile
    from planner.capture.inputs import bind
    from planner.follow.family import Family

    model, inputs = make_model("qwen2"), batch(2, 32)
    alone = profile(model, inputs=inputs, keep_output=False, autocast=autocast)
    prepared = prepare(model, inputs=inputs, keep_output=False, follow_batch=True, autocast=autocast)
    family = Family.around(prepared, prepared.baseline.peak_bytes, prepared.options)
    group = family.prepared(family.example_group, bind(model, (), inputs) or {}).profile
    assert _memory_of(prepared.profile) == _memory_of(alone)
    assert _memory_of(group) == _memory_of(alone)


def test_a_group_larger_than_the_example_under_autocast_is_predicted_high_not_low():
    """Under bf16 autocast a group larger than the example is planned from a meta replay, which runs no autocast
    (activations at float32, no bf16 weight casts: docs/limits.md). On an LM, where activations outweigh the
    weights, that reads high: the group's measured peak is within the budget and at most its prediction."""
    import copy

    from planner import prepare
    from planner.common.loop import TrainingLoop
    from planner.profiling.measure import measure_loop_peak

    model, large = make_model("qwen2"), batch(4, 160)
    plain = prepare(copy.deepcopy(model), inputs=large, keep_output=False, autocast="bf16").baseline.peak_bytes
    plan = enable(model, int(0.8 * plain), inputs=batch(4, 64), keep_output=False, autocast="bf16",
                  time_limit_s=10)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the first call plans the group
        loss = model(**large).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    group = plan.family.groups[plan.family.grid.group({k: tuple(v.shape) for k, v in large.items()})]
    measured = measure_loop_peak(model, [as_inputs(model, large)], loop=TrainingLoop(keep_output=False,
                                                                                     autocast="bfloat16"))
    assert measured <= plan.budget_bytes and measured <= group.predicted_peak_bytes, (measured, group)
    disable(model)
