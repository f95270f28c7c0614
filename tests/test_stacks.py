"""The fine-tuning stacks as people run them, on a planned model: Trainer and TRL turn Hugging Face's own
checkpointing on from their defaults (TRL's ``SFTConfig`` by default); ckplan keeps its plan and leaves theirs
off with a one-line warning, so that no layer is checkpointed twice: each layer runs as often as under the plan
alone, and the losses are the unplanned run's with the same settings (to float rounding: with its checkpointing
flag TRL prepares the model otherwise, and an unplanned model trains with its key/value cache on)."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import Calls

from planner import disable, enable, optimize

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

VOCAB = 123


def tokenizer():
    """A word-level tokenizer built in memory (nothing downloaded): ``w0`` ... ``w119``, pad and eos."""
    import tokenizers

    vocab = {f"w{i}": i for i in range(120)} | {"[UNK]": 120, "[PAD]": 121, "[EOS]": 122}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]",
                                                unk_token="[UNK]")


def texts(n: int = 16) -> list[str]:
    g = torch.Generator().manual_seed(0)
    return [" ".join(f"w{int(i)}" for i in torch.randint(0, 120, (int(length),), generator=g))
            for length in torch.randint(24, 64, (n,), generator=g)]


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=121,
                                      eos_token_id=122)
    return transformers.Qwen2ForCausalLM(config)


def batch(rows: int = 4, length: int = 64) -> dict:
    ids = torch.randint(0, 120, (rows, length), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}  # as a collator makes it


def sft(module: torch.nn.Module, counted: str = "model.layers.0", **config) -> tuple[list[float], int]:
    """Three steps of TRL's SFTTrainer with its defaults (and ``config``): the losses, and how often the module
    ``counted`` (the first decoder layer) ran."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir="/tmp/ckplan-sft", max_steps=3, per_device_train_batch_size=4, report_to=[],
                     logging_steps=1, use_cpu=True, save_strategy="no", seed=0, **config)
    trainer = SFTTrainer(model=module, args=args, train_dataset=Dataset.from_dict({"text": texts()}),
                         processing_class=tokenizer())
    calls = Calls(trainer.model.get_submodule(counted))
    trainer.train()
    calls.handle.remove()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], calls.count


def test_trls_default_checkpointing_is_left_off_on_a_model_planned_in_place(timed_as_users_are):
    """SFTConfig turns Hugging Face's checkpointing on by default: on a model ckplan planned in place it stays off,
    with a warning; the layers run as often as under the plan alone (no double re-run), the losses are the
    unplanned run's."""
    from trl import SFTConfig

    assert SFTConfig(output_dir="/tmp/ckplan-sft", use_cpu=True).gradient_checkpointing  # TRL's default
    defaults, _ = sft(model())  # the unplanned model under TRL's defaults: Hugging Face's checkpointing
    planned = model()
    plan = enable(planned, "60%", inputs=batch(), keep_output=False, time_limit_s=10)
    assert plan.segments
    rerun = plan.segments[0].chain[0]  # the first module the plan re-runs (its choice varies with measured times)
    expected, plain_calls = sft(model(), rerun, gradient_checkpointing=False)
    initial = {k: v.clone() for k, v in planned.state_dict().items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sft(planned, gradient_checkpointing=False)  # plans the shape groups of TRL's padded batches (first sight:
    planned.load_state_dict(initial)                # the capture of a private copy runs the layer's hooks too)
    # each group is planned for the forward TRL runs (its fused LM head, a custom autograd.Function): the example's
    # group again, as its calls pass fused_lm_head=True. On CPU that head's tile buffer alone outgrows this tiny
    # model's budget, which the warning says: a verdict on the budget, never a capture or replay failure
    unplanned = [str(w.message) for w in caught if "could not be made" in str(w.message)]
    assert all("is below the smallest peak any checkpointing plan reaches" in m for m in unplanned), unplanned
    alone, alone_calls = sft(planned, rerun, gradient_checkpointing=False)
    planned.load_state_dict(initial)  # trained in place: from the same weights again
    with pytest.warns(UserWarning, match="left Hugging Face's checkpointing off: the model runs a ckplan plan"):
        losses, calls = sft(planned, rerun)
    torch.testing.assert_close(losses, defaults, rtol=1e-5, atol=0)  # the same training as TRL's defaults
    torch.testing.assert_close(alone, expected, rtol=1e-5, atol=0)
    assert calls == alone_calls > plain_calls  # the plan re-runs that module once per step, and nothing more
    assert not planned.is_gradient_checkpointing
    disable(planned)
    assert "gradient_checkpointing_enable" not in planned.__dict__
    planned.gradient_checkpointing_enable()  # Hugging Face's own again, once ckplan's plan is off
    assert planned.is_gradient_checkpointing


def test_trainers_gradient_checkpointing_flag_is_left_off_on_a_planned_module():
    """TrainingArguments(gradient_checkpointing=True) on plan.module: the plan runs alone, the losses are the
    unplanned model's."""
    from datasets import Dataset

    def train(module: torch.nn.Module, flag: bool) -> tuple[list[float], int]:
        rows = batch(rows=8)
        data = Dataset.from_dict({"input_ids": rows["input_ids"].tolist(), "labels": rows["labels"].tolist()})
        args = transformers.TrainingArguments(output_dir="/tmp/ckplan-trainer", max_steps=3, report_to=[],
                                              per_device_train_batch_size=4, logging_steps=1, use_cpu=True,
                                              save_strategy="no", seed=0, gradient_checkpointing=flag)
        trainer = transformers.Trainer(model=module, args=args, train_dataset=data)
        calls = Calls(trainer.model.model.layers[0])
        trainer.train()
        calls.handle.remove()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], calls.count

    expected, _ = train(model(), False)
    base = model()
    plan = optimize(base, "60%", inputs=batch(), keep_output=False, time_limit_s=10)
    initial = {k: v.clone() for k, v in base.state_dict().items()}
    alone, alone_calls = train(plan.module, False)
    base.load_state_dict(initial)  # the planned module trained the model's own parameters
    with pytest.warns(UserWarning, match="checkpointing_enable\\(\\) left Hugging Face's checkpointing off"):
        losses, calls = train(plan.module, True)
    assert losses == alone and calls == alone_calls
    torch.testing.assert_close(alone, expected, rtol=1e-5, atol=0)
    assert not base.is_gradient_checkpointing and "gradient_checkpointing_enable" not in base.__dict__


def test_a_model_with_hugging_faces_checkpointing_on_is_planned_without_it():
    """A model whose Hugging Face checkpointing is on when planned: the plan is made for the step without it (the
    planned module predicted exactly), the planned module runs the plan alone, the model keeps its setting."""
    from planner.capture.inputs import as_inputs
    from planner.profiling.measure import measure_peak

    base = model()
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    plan = optimize(base, "60%", inputs=batch(), keep_output=False, time_limit_s=10)
    assert base.is_gradient_checkpointing and not plan.module.is_gradient_checkpointing
    measured = measure_peak(plan.module, as_inputs(plan.module, batch()), keep_output=False)
    assert measured == plan.predicted_peak_bytes


@pytest.mark.parametrize("bf16", [False, True])
def test_the_trainer_callback_plans_the_step_trainer_runs_and_the_whole_run_fits(bf16):
    """``PlanCallback`` from a budget in bytes, Trainer with 4 micro-steps per optimizer step, AdamW, 2 optimizer
    steps, in fp32 and in bf16: the callback reads the optimizer, the precision and the accumulation, and the peak
    of the whole ``trainer.train()`` after planning (parameters, AdamW's state, the accumulated gradients, the
    batches, every step) stays within the budget. The budget is 80% of that loop's un-checkpointed peak, so the
    plan checkpoints. (Planning itself profiles the plain step where it fits: ``tests/test_fitting.py`` plans
    where it does not.)"""
    import copy

    from datasets import Dataset

    from planner import prepare
    from planner.profiling.memtrack import LiveStorages
    from planner.stacks.trainer import PlanCallback

    rows = batch(rows=32)
    data = Dataset.from_dict({"input_ids": rows["input_ids"].tolist(), "labels": rows["labels"].tolist()})
    base = model()
    first = {"input_ids": rows["input_ids"][:4], "labels": rows["labels"][:4]}
    loop = {"optimizer": "adamw", "gradient_accumulation_steps": 4, "keep_output": False,
            "autocast": "bf16" if bf16 else None}
    budget = int(0.8 * prepare(copy.deepcopy(base), inputs=first, **loop).baseline.peak_bytes)
    planning = PlanCallback(budget, time_limit_s=10)
    tracker = LiveStorages("cpu")

    class Tracked(transformers.TrainerCallback):
        """The live-storage tracker from the end of planning to the end of training."""

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            held = [t for values in optimizer.state.values() for t in values.values() if isinstance(t, torch.Tensor)]
            for t in [*model.parameters(), *model.buffers(), *held]:
                tracker.track(t)
            tracker.__enter__()

        def on_train_end(self, *args, **kwargs):
            tracker.__exit__(None, None, None)

    args = transformers.TrainingArguments(output_dir="/tmp/ckplan-trainer-loop", max_steps=2, report_to=[],
                                          per_device_train_batch_size=4, gradient_accumulation_steps=4, bf16=bf16,
                                          logging_steps=1, use_cpu=True, save_strategy="no", seed=0,
                                          disable_tqdm=True)
    trainer = transformers.Trainer(model=base, args=args, train_dataset=data, callbacks=[planning, Tracked()])
    trainer.train()
    plan = planning.plan
    assert plan is not None and plan.module is base and plan.segments
    assert plan.counted[0].startswith("AdamW state")
    assert plan.counted[1] == "gradients alive in forward and backward (4 micro-steps)"
    assert "4 micro-batches held at once" in plan.counted  # Trainer takes an optimizer step's batches together
    assert ("autocast to bfloat16" in plan.counted) == bf16
    assert trainer.state.global_step == 2
    assert tracker.peak_bytes <= plan.budget_bytes, (tracker.peak_bytes, plan.predicted_peak_bytes, budget)
