"""A Hugging Face causal LM for ``ckplan``: a small Qwen2-style decoder with random weights (nothing is
downloaded) and the batch a language-modelling collator produces (rows right-padded, labels -100 on
padding).

    ckplan examples/hf_causal_lm.py --budget 50%

The planned module is a ``Qwen2ForCausalLM`` sharing this model's parameters: it trains with
``transformers.Trainer``, generates with ``generate()`` and saves with ``save_pretrained()``.
"""

import torch
import transformers

VOCAB, BATCH, SEQ = 8000, 4, 256


def build() -> transformers.Qwen2ForCausalLM:
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=6,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config)


def batch(rows: int = BATCH, length: int = SEQ, seed: int = 0) -> dict[str, torch.Tensor]:
    """What ``DataCollatorForLanguageModeling(mlm=False)`` gives for ``rows`` texts of up to ``length``
    tokens: right padding, ``attention_mask`` 0 and ``labels`` -100 on the padding."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=generator)
    lengths[0] = length
    input_ids = torch.randint(1, VOCAB, (rows, length), generator=generator)
    attention_mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    input_ids = input_ids * attention_mask  # pad token 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


model = build
inputs = batch
