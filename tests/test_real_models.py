"""Hugging Face models (random weights from small configs), captured with torch.export."""

import pytest
import torch
from conftest import assert_plan_is_exact, plan_at, prepared_once

from planner.capture.api import ATEN

transformers = pytest.importorskip("transformers")


def _gpt2():
    config = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=1000, n_positions=128,
                                     bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 1000, (4, 128))
    return transformers.GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids, "use_cache": False}


def _llama():
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    ids = torch.randint(0, 1000, (4, 128))
    return transformers.LlamaForCausalLM(config), {"input_ids": ids, "labels": ids, "use_cache": False}


def _bert():
    config = transformers.BertConfig(vocab_size=1000, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                                     num_attention_heads=4, max_position_embeddings=256)
    ids = torch.randint(0, 1000, (4, 128))
    return transformers.BertForMaskedLM(config), {"input_ids": ids, "labels": ids}


def _loss(output):
    return output.loss


@pytest.mark.slow
@pytest.mark.parametrize("build", [_gpt2, _llama, _bert], ids=["gpt2", "llama", "bert"])
@pytest.mark.parametrize("budget", ["50%", "smallest"])
def test_hugging_face_model(build, budget, restore_buffers):
    def made():
        torch.manual_seed(0)
        model, inputs = build()
        return model.train(), inputs, None

    model, inputs, _, prepared = prepared_once(build.__name__, made)
    model.train()
    plan = plan_at(prepared, budget)
    assert plan.capture_method == ATEN and plan.capture_notes and "symbolic_trace failed" in plan.capture_notes[0]
    assert plan.segments and all(seg.chain for seg in plan.segments)
    assert type(plan.module) is type(model)
    assert_plan_is_exact(model, plan, inputs, _loss, restore_buffers)
    plan.module.eval()
    model.eval()
    with torch.no_grad():  # outside training the plan's hooks do nothing
        torch.testing.assert_close(plan.module(**inputs).logits, model(**inputs).logits, rtol=0, atol=0)
    assert not model.training
