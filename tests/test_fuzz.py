"""The model fuzzer: random block models (tests/fuzz.py) planned at random budgets, each plan checked
against the un-checkpointed model, its budget and its prediction.

CI runs a fixed set of seeds; ``CKPLAN_FUZZ_SEEDS=300 python -m pytest tests/test_fuzz.py -m slow``
runs hundreds (as does ``python bench/reliability.py``, which writes the table of
bench/results/reliability.md).
"""

import os
import random

import pytest
from fuzz import KINDS, budgets, check_budget, loss_fn, random_model

from planner.pipeline import prepare

CI_SEEDS = range(10)
FOUND_SEEDS = (121, 192)
"""Seeds that once failed (bench/results/reliability.md): 121 and 192 measured over budget (a frozen
Linear's weight pack moves the re-run's stop)."""
MANY_SEEDS = range(100, 100 + int(os.environ.get("CKPLAN_FUZZ_SEEDS", "0")))


def _fuzz(seed: int, *, per_model: int = 3, **draw) -> None:
    drawn = random_model(seed, **draw)
    prepared = prepare(drawn.model, inputs=drawn.inputs, loss_fn=loss_fn, keep_output=drawn.keep_output)
    rng = random.Random(seed)
    for budget in budgets(prepared, rng, per_model):
        outcome = check_budget(drawn, prepared, budget, selective=rng.random() < 0.5)
        assert not outcome.problems(), f"{drawn.describe()}, budget {budget} B: {outcome.problems()}"


@pytest.mark.parametrize("seed", [*CI_SEEDS, *FOUND_SEEDS])
def test_random_model(seed):
    _fuzz(seed)


def test_the_ci_seeds_cover_every_kind_of_block_and_both_capture_paths():
    drawn = [random_model(seed) for seed in CI_SEEDS]
    assert {kind for d in drawn for kind in d.kinds} == set(KINDS)
    assert {d.model.value_branch for d in drawn} == {True, False}  # fx graphs and module hooks
    assert any(d.frozen for d in drawn) and {d.keep_output for d in drawn} == {True, False}


@pytest.mark.slow
@pytest.mark.parametrize("kinds", [("mlp", "inplace"), ("gated", "batchnorm", "dropout")])
def test_a_deep_chain_of_hundreds_of_blocks(kinds):
    _fuzz(7, per_model=2, depth=300, kinds=kinds)


@pytest.mark.slow
@pytest.mark.parametrize("seed", MANY_SEEDS)
def test_many_random_models(seed):
    _fuzz(seed)
