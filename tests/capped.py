"""A training step in a process whose memory is capped (``RLIMIT_AS``), for ``test_fitting.py``.

``python tests/capped.py WHAT GROWTH_BYTES BUDGET [MODEL]`` builds the model (``gpt``: the bundled example;
``hf-gpt2``: Hugging Face GPT-2 on a padded batch, whose forward reads the mask's values), then caps the address space
this process may still map at ``GROWTH_BYTES`` beyond what it maps already, then does WHAT:

- ``plain``: one un-checkpointed training step;
- ``plan``: ``optimize(model, BUDGET)`` and one step of the planned module, measured;
- ``follow``: the same with ``follow_batch=True``, then one measured step at each of ``SMALLER`` shapes (rows x
  tokens cut from the example batch; the first call of a new group plans it), each with its group's plan.

It prints one JSON line: ``{"ok": ...}`` and what it measured, or the error. ``GROWTH_BYTES`` 0: no cap,
and ``VmPeak`` growth reported (how much address space the step needs).
"""

import json
import resource
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import gpt  # noqa: E402

CONFIG = gpt.Config(vocab=512, context=256, width=256, heads=4, layers=6, dropout=0.1)
ROWS = 24
HF_ROWS = 12  # Hugging Face GPT-2 runs slower per token: half the rows keep its run near the other's time
SMALLER = ((12, 128), (4, 64), (12, 200))


def build(kind: str):
    torch.manual_seed(0)
    if kind == "hf-gpt2":
        import transformers

        config = transformers.GPT2Config(vocab_size=CONFIG.vocab, n_embd=CONFIG.width, n_head=CONFIG.heads,
                                         n_layer=CONFIG.layers, n_positions=CONFIG.context, use_cache=False)
        model = transformers.GPT2LMHeadModel(config)
        ids = torch.randint(0, CONFIG.vocab, (HF_ROWS, CONFIG.context))
        mask = (torch.arange(CONFIG.context) < torch.randint(CONFIG.context // 2, CONFIG.context + 1, (HF_ROWS, 1)))
        inputs = {"input_ids": ids, "attention_mask": mask.long(), "labels": ids.masked_fill(~mask, -100)}
        return model, inputs, None
    model = gpt.GPT(CONFIG)
    tokens = torch.randint(0, CONFIG.vocab, (ROWS, CONFIG.context + 1))
    return model, (tokens[:, :-1],), lambda logits: torch.nn.functional.cross_entropy(
        logits.reshape(-1, CONFIG.vocab), tokens[:, 1:].reshape(-1))


def step(model, inputs, loss_fn) -> None:
    from planner.capture.inputs import as_inputs
    from planner.capture.step import default_loss

    given = as_inputs(model, inputs)
    (loss_fn or default_loss)(model(*given.args, **given.kwargs)).backward()


def followed(plan, inputs: dict, rows: int, tokens: int) -> dict:
    """One measured step of a plan that follows the batch, at the example batch cut to ``rows`` x ``tokens``:
    the call's shape, its group's upper shape, segments and predicted peak, and the measured peak."""
    from planner.capture.inputs import as_inputs
    from planner.profiling.measure import measure_peak

    call = {name: value[:rows, :tokens] for name, value in inputs.items()}
    for p in plan.module.parameters():
        p.grad = None
    measured = measure_peak(plan.module, as_inputs(plan.module, call))  # a new group: planned during the call
    key = plan.family.grid.group({name: tuple(value.shape) for name, value in call.items()})
    group = plan.family.groups[key]
    return {"shape": [rows, tokens], "group": list(dict(key)["input_ids"]), "segments": len(group.segments),
            "predicted": group.predicted_peak_bytes, "baseline": group.baseline_peak_bytes, "measured": measured}


def vm(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def main() -> None:
    what, growth, budget = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    kind = sys.argv[4] if len(sys.argv) > 4 else "gpt"
    torch.set_num_threads(1)
    from planner import optimize
    from planner.capture.inputs import as_inputs
    from planner.profiling.measure import measure_peak

    model, inputs, loss_fn = build(kind)
    base = vm("VmSize")
    if growth:
        resource.setrlimit(resource.RLIMIT_AS, (base + growth, resource.RLIM_INFINITY))
    out: dict = {"base": base}
    try:
        if what == "plain":
            step(model, inputs, loss_fn)
        else:
            plan = optimize(model, int(budget), inputs=inputs, loss_fn=loss_fn, time_limit_s=20,
                            follow_batch=what == "follow")
            out.update(predicted=plan.predicted_peak_bytes, budget=plan.budget_bytes, pieces=plan.profile_pieces,
                       profile_peak=plan.profile_peak_bytes, baseline=plan.baseline_peak_bytes,
                       segments=len(plan.segments))
            for p in model.parameters():
                p.grad = None
            out["measured"] = measure_peak(plan.module, as_inputs(model, inputs), loss_fn)
            if what == "follow":
                out["shapes"] = [followed(plan, inputs, rows, tokens) for rows, tokens in SMALLER]
        out.update(ok=True, growth=vm("VmPeak") - base)
    except Exception as exc:
        out.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:400], trace=traceback.format_exc()[-800:])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
