"""Every bundled example at every budget regime: same numerics, measured peak within budget and prediction; and
every fine-tuning script under examples/ runs as users run it, printing its plan and its losses."""

import ast
import math
import os
import re
import subprocess
import sys

import pytest
from conftest import EXAMPLES as FOLDER
from conftest import assert_plan_is_exact, load_example, plan_at, prepared_once

from planner import InfeasibleBudget

EXAMPLES = ["seed_cnn", "gpt", "resnet"]
BUDGETS = ["100%", "70%", "50%", "smallest"]


def _example(name: str):
    example = load_example(name)
    return example["model"], example["inputs"], example["loss_fn"]


@pytest.mark.slow
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("name", EXAMPLES)
def test_plan_matches_original_and_fits(name, budget, restore_buffers):
    model, inputs, loss_fn, prepared = prepared_once(name, lambda: _example(name))
    try:
        plan = plan_at(prepared, budget)
    except InfeasibleBudget as exc:  # a real regime for small models: say how low it can go
        assert exc.min_peak_bytes > exc.budget_bytes
        assert budget in ("70%", "50%") and name == "seed_cnn", f"{name} at {budget}: {exc}"
        return
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert (plan.segments == ()) == (budget == "100%")

    assert_plan_is_exact(model, plan, inputs, loss_fn, restore_buffers)


@pytest.mark.slow
def test_the_diffusers_fine_tuning_example_runs_as_a_script():
    """``python examples/diffusers_finetune.py``: the plan's summary, then five training steps of the planned UNet."""
    pytest.importorskip("diffusers")
    result = run_script([str(FOLDER / "diffusers_finetune.py")], timeout_s=300)
    losses = [float(line.split()[-1]) for line in result.stdout.splitlines() if line.startswith("step ")]
    assert "checkpointed segment" in result.stdout and len(losses) == 5, result.stdout
    assert losses[-1] < losses[0]


def run_script(command: list[str], *, timeout_s: float) -> subprocess.CompletedProcess:
    """``python <command>`` with one thread per process (the scripts' ranks share the test's cores); fails with the
    script's stderr unless it exits 0."""
    result = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=timeout_s,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    return result


STACKS = {  # script: (the stack it needs, the command after ``python``)
    "trl_sft": ("trl", ["examples/trl_sft.py"]),
    "hf_trainer": ("transformers", ["examples/hf_trainer.py"]),
    "accelerate_train": ("accelerate", ["examples/accelerate_train.py"]),
    "accelerate_train-2ranks": ("accelerate", ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                                               "examples/accelerate_train.py"]),
    "lightning_train": ("pytorch_lightning", ["examples/lightning_train.py"]),
    "llama_pipeline": ("transformers", ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                                        "examples/llama_pipeline.py"]),  # the last stage prints the losses
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STACKS))
def test_the_fine_tuning_stack_examples_run_as_scripts(name):
    """Each script plans a tiny random Qwen2 (a Llama split in 2 stages for the pipeline) and trains it 4 steps with
    its stack: the plan's summary, then each process's losses, all finite."""
    stack, command = STACKS[name]
    pytest.importorskip(stack)
    root = FOLDER.parent
    result = run_script([str(root / part) if part.startswith("examples/") else part for part in command],
                        timeout_s=180)
    # each "losses: [...]" wherever it is: two ranks' lines can run together on the launcher's shared stdout
    runs = [ast.literal_eval(found) for found in re.findall(r"losses: (\[[^\]]*\])", result.stdout)]
    assert "checkpointed segment" in result.stdout and runs, result.stdout
    assert len(runs) == (2 if name.endswith("2ranks") else 1), result.stdout
    assert all(len(losses) == 4 and all(math.isfinite(x) for x in losses) for losses in runs), result.stdout
