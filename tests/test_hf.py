"""Hugging Face models as they are fine-tuned: the planned module is the model's own class, trains on
any batch shape and keyword subset, generates, saves, runs under Trainer and PEFT, and reaches what
Hugging Face's own gradient checkpointing reaches (tiny random-weight configs, nothing downloaded)."""

import inspect
import warnings

import pytest
import torch
from conftest import greedy_generations, training_step

from planner import InfeasibleBudget, disable, enable, optimize, prepare
from planner.capture.cache import no_cache
from planner.capture.inputs import as_inputs
from planner.profiling.measure import measure_peak

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

VOCAB = 512


def _qwen2(layers=3):
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return transformers.Qwen2ForCausalLM(config)


def _gpt2():  # dropout everywhere: the re-run must draw the same numbers
    config = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=256,
                                     resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    return transformers.GPT2LMHeadModel(config)


def _bert():
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
                                     num_attention_heads=4, max_position_embeddings=256)
    return transformers.BertForMaskedLM(config)


FAMILIES = {"qwen2": _qwen2, "gpt2": _gpt2, "bert": _bert}


def lm_batch(rows=4, length=64, *, mask=True, labels=True, seed=0):
    """A collator's batch: rows right-padded with 0, labels -100 on the padding."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=generator)
    lengths[0] = length
    attention_mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    ids = torch.randint(1, VOCAB, (rows, length), generator=generator) * attention_mask
    batch = {"input_ids": ids}
    if mask:
        batch["attention_mask"] = attention_mask
    if labels:
        batch["labels"] = ids.masked_fill(attention_mask == 0, -100)
    return batch


def _loss(output):
    return output.loss if output.loss is not None else output.logits.float().pow(2).mean()


@pytest.fixture(scope="module", params=list(FAMILIES))
def planned(request):
    torch.manual_seed(0)
    model = FAMILIES[request.param]()
    model.train()
    plan = optimize(model, "50%", inputs=lm_batch())
    return request.param, model, plan


def _same_step(model, module, batch, *, owner=None):
    """One step of ``module`` equals one of ``model`` (``owner``: whose parameters ``module`` uses)."""
    expected = training_step(model, model, batch, _loss, seed=7)
    actual = training_step(module, owner or model, batch, _loss, seed=7)
    assert _loss(actual[0]).item() == _loss(expected[0]).item()
    assert actual[1].keys() == expected[1].keys()
    for name in expected[1]:
        torch.testing.assert_close(actual[1][name], expected[1][name], rtol=1e-6, atol=1e-7, msg=name)


def test_planned_module_is_the_models_own_object(planned):
    _, model, plan = planned
    module = plan.module
    assert type(module) is type(model) and module is not model
    assert module.config is model.config
    ours = dict(module.named_parameters())
    assert all(ours[name] is p for name, p in model.named_parameters())
    assert list(module.state_dict()) == list(model.state_dict())
    assert plan.segments and all(s.module_paths for s in plan.segments)
    module.eval()  # the clone's modes are its own
    assert model.training and all(m.training for m in model.modules())
    module.train()


@pytest.mark.parametrize("shape", [dict(rows=4, length=64), dict(rows=2, length=64), dict(rows=4, length=37),
                                   dict(rows=1, length=16, mask=False), dict(rows=3, length=50, labels=False)],
                         ids=["planned", "short-batch", "short-seq", "no-mask", "no-labels"])
def test_any_batch_shape_and_keywords_train_exactly(planned, shape):
    _, model, plan = planned
    _same_step(model, plan.module, lm_batch(**shape))


def test_smaller_batches_take_less_memory(planned):
    _, model, plan = planned
    full = measure_peak(plan.module, as_inputs(model, lm_batch()), _loss)
    short = measure_peak(plan.module, as_inputs(model, lm_batch(rows=2, length=40)), _loss)
    assert short < full <= plan.budget_bytes


def test_generate_and_save_pretrained(planned, tmp_path):
    family, model, plan = planned
    if family == "bert":
        pytest.skip("a masked LM does not generate")
    prompt = lm_batch(rows=2, length=8, labels=False)
    ours, theirs = greedy_generations(plan.module, model, prompt)
    assert torch.equal(ours, theirs)
    plan.module.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_the_call_signature_and_its_errors_are_the_models_own(planned):
    _, model, plan = planned
    assert inspect.signature(plan.module.forward) == inspect.signature(model.forward)
    with pytest.raises(Exception) as theirs:
        model(**lm_batch(), input_ids_typo=torch.zeros(1, 2), inputs_embeds=torch.zeros(1, 2))
    with pytest.raises(type(theirs.value)) as ours:
        plan.module(**lm_batch(), input_ids_typo=torch.zeros(1, 2), inputs_embeds=torch.zeros(1, 2))
    assert str(ours.value) == str(theirs.value)


def test_larger_inputs_than_planned_warn_once_with_a_peak(planned):
    """A batch larger than the example that no plan fits in the budget: a plan that follows the batch (the
    default here) runs the example's plan with one warning naming the group and why; a plan for one shape
    (follow_batch=False) warns once with the peak it estimates there."""
    _, model, plan = planned
    single = optimize(model, "50%", inputs=lm_batch(), follow_batch=False)
    for module, says, names in ((plan.module, "run the plan made for the example's shape", "input_ids (8, 64)"),
                                (single.module, "larger than the inputs this plan was made for", "input_ids [8, 64]")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                _loss(module(**lm_batch(rows=8, length=64))).backward()
        module.zero_grad(set_to_none=True)
        said = [w for w in caught if says in str(w.message)]
        assert len(said) == 1 and names in str(said[0].message), [str(w.message) for w in caught]


def test_trainer_trains_the_plan_with_the_models_losses(tmp_path):
    """GPT-2 with dropout, 3 steps of transformers.Trainer from equal weights and seeds."""
    rows = [{k: v[0] for k, v in lm_batch(rows=1, length=128, seed=s).items()} for s in range(6)]

    def train(make_module):
        torch.manual_seed(0)
        model = _gpt2()
        args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                                              report_to=[], seed=1, data_seed=1, logging_steps=1, save_strategy="no",
                                              use_cpu=True, dataloader_num_workers=0)
        trainer = transformers.Trainer(model=make_module(model), args=args, train_dataset=rows)
        trainer.train()
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    plain = train(lambda m: m)
    plans = []

    def planned(model):
        plans.append(optimize(model, "70%", inputs=lm_batch(rows=2, length=128), keep_output=False))
        return plans[-1].module

    ours = train(planned)
    assert plans[0].segments and not plans[0].keep_output
    assert len(plain) == 3 and ours == plain


def test_lora_adapters_get_exact_gradients_within_budget():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = peft.get_peft_model(_qwen2(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model.train()
    plan = optimize(model, "70%", inputs=lm_batch())  # frozen weights: activations are less of the peak
    _same_step(model, plan.module, lm_batch())
    assert type(plan.module) is type(model)
    trainable = {n for n, p in plan.module.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert measure_peak(plan.module, as_inputs(model, lm_batch()), _loss) <= plan.budget_bytes


def test_enable_plans_the_model_in_place_and_disable_undoes_it():
    torch.manual_seed(0)
    model = _qwen2()
    model.train()
    reference = _qwen2()
    reference.load_state_dict(model.state_dict())
    before = {name: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for name, m in model.named_modules()}
    unplanned = measure_peak(model, as_inputs(model, lm_batch()), _loss)
    plan = enable(model, "50%", inputs=lm_batch())
    assert plan.module is model
    _same_step(reference, model, lm_batch(), owner=model)
    assert measure_peak(model, as_inputs(model, lm_batch()), _loss) <= plan.budget_bytes < unplanned
    disable(model)
    after = {name: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for name, m in model.named_modules()}
    assert after == before
    assert measure_peak(model, as_inputs(model, lm_batch()), _loss) == unplanned


def test_a_failed_plan_leaves_the_model_untouched():
    torch.manual_seed(0)
    model = _qwen2()
    model.train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    hooks = [(dict(m._forward_hooks), dict(m._forward_pre_hooks)) for m in model.modules()]
    with pytest.raises(InfeasibleBudget):
        enable(model, 1, inputs=lm_batch())
    assert [(dict(m._forward_hooks), dict(m._forward_pre_hooks)) for m in model.modules()] == hooks
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert model.config.use_cache and all(p.grad is None for p in model.parameters())


def test_reaches_the_peak_of_hugging_face_gradient_checkpointing():
    """At the measured peak of gradient_checkpointing_enable (non-reentrant), ckplan plans and fits."""
    torch.manual_seed(0)
    model = _qwen2(layers=6)
    model.train()
    inputs = as_inputs(model, lm_batch(length=96))
    hf = _qwen2(layers=6)
    hf.load_state_dict(model.state_dict())
    hf.train()
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf_peak = measure_peak(hf, inputs, _loss)
    plan = optimize(model, hf_peak, inputs=lm_batch(length=96))
    assert measure_peak(plan.module, inputs, _loss) <= hf_peak


def test_a_loop_that_drops_the_output_is_planned_and_predicted_as_such():
    """keep_output=False (Trainer's compute_loss): the logits are freed before backward, the baseline
    is lower by about their size, and the plan's prediction holds for that loop."""
    torch.manual_seed(0)
    model = _qwen2()
    model.train()
    batch = lm_batch(length=96)
    kept = optimize(model, "50%", inputs=batch)
    dropped = optimize(model, "50%", inputs=batch, keep_output=False)
    logits = 4 * 96 * VOCAB * 4
    assert kept.baseline_peak_bytes - dropped.baseline_peak_bytes >= logits // 2
    measured = measure_peak(dropped.module, as_inputs(model, batch), _loss, keep_output=False)
    assert measured <= dropped.budget_bytes
    assert abs(measured - dropped.predicted_peak_bytes) <= 0.01 * measured


def test_gpt2_baseline_is_the_step_without_its_cache():
    """The baseline is the step plans run, use_cache off (docs/huggingface.md, "use_cache"): exact against that
    step. GPT-2's own training call keeps its cache: each layer's attention gets contiguous copies of k and v
    (``DynamicLayer.update``'s ``torch.cat``), which ``scaled_dot_product_attention`` saves until that layer's
    backward, on top of the fused qkv its q view keeps: 2 x rows x length x n_embd floats per layer more."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=256,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    batch = lm_batch(mask=False)
    baseline = prepare(model, inputs=batch, keep_output=False).baseline.peak_bytes
    inputs = as_inputs(model, batch)
    with no_cache(model):
        assert measure_peak(model, inputs, _loss, keep_output=False) == baseline
    rows, length = batch["input_ids"].shape
    cache = 2 * config.n_layer * rows * length * config.n_embd * 4  # k and v, float32
    assert measure_peak(model, inputs, _loss, keep_output=False) == baseline + cache


@pytest.mark.parametrize("keep, rerun, kernel", [("*scaled_dot_product*", "**.self_attn:*cat*", "scaled_dot_product"),
                                                 ("*addmm*", "**.self_attn:*cat*", "addmm.default")])
def test_any_op_inside_a_layer_can_be_kept(keep, rerun, kernel):
    """An op that is no module of its own (the attention kernel inside ``self_attn``, a matmul) is kept by a plan
    run by module hooks: selective checkpointing finds it by its order among the segment's ops. With an op of
    the attention's own code re-run (the rotary ``cat``, so that a segment holds the whole attention), the plan
    keeps it (``Segment.saved_ops``), trains exactly, fits its budget and is predicted to within 1%."""
    torch.manual_seed(0)
    model = _qwen2(layers=4)
    model.train()
    batch = lm_batch(length=96)
    plan = optimize(model, "85%", inputs=batch, must_save=[keep], must_recompute=[rerun], time_limit_s=20)
    kept = [name for segment in plan.segments for name, _ in segment.saved_ops]
    assert any(kernel in name for name in kept), plan.segments
    _same_step(model, plan.module, batch)
    measured = measure_peak(plan.module, as_inputs(model, batch), _loss)
    assert measured <= plan.budget_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 0.01 * measured, (measured, plan.predicted_peak_bytes)
