"""One options object: every entry point takes ``options=PlanOptions(...)`` and the same names as keyword
arguments, refuses names that are not options, and hands them on (a bad value is refused before any work)."""

from __future__ import annotations

import inspect
import typing
from dataclasses import fields
from types import SimpleNamespace

import pytest
from models import tower, tower_inputs

from planner import (
    OptionError,
    Plan,
    PlanOptions,
    enable,
    optimize,
    optimize_compiled,
    plan_for,
    prepare,
    profile,
    sweep,
)
from planner.distributed import plan_on_rank0
from planner.options import NAMES, PREPARED, OptionArgs

ENTRY_POINTS = {
    "optimize": lambda **kw: optimize(tower(), "60%", inputs=tower_inputs(), **kw),
    "prepare": lambda **kw: prepare(tower(), inputs=tower_inputs(), **kw),
    "plan_for": lambda **kw: plan_for(SimpleNamespace(options=PlanOptions()), "60%", **kw),
    "sweep": lambda **kw: sweep(tower(), ["60%"], inputs=tower_inputs(), **kw),
    "optimize_compiled": lambda **kw: optimize_compiled(tower(), "60%", inputs=tower_inputs(), **kw),
    "enable": lambda **kw: enable(tower(), "60%", inputs=tower_inputs(), **kw),
    "plan_on_rank0": lambda **kw: plan_on_rank0(tower(), "60%", inputs=tower_inputs(), **kw),
    "profile": lambda **kw: profile(tower(), inputs=tower_inputs(), **kw),
    "Plan.apply": lambda **kw: Plan.apply(SimpleNamespace(family=None), tower(), **kw),
}
FUNCTIONS = [optimize, prepare, plan_for, sweep, optimize_compiled, enable, plan_on_rank0, profile, Plan.apply]


def test_the_keyword_arguments_are_the_options():
    assert set(typing.get_type_hints(OptionArgs)) == {f.name for f in fields(PlanOptions)} == set(NAMES)


@pytest.mark.parametrize("function", FUNCTIONS, ids=lambda f: f.__qualname__)
def test_every_entry_point_takes_options_and_every_option_as_a_keyword(function):
    parameters = inspect.signature(function).parameters
    assert parameters["options"].kind is inspect.Parameter.KEYWORD_ONLY
    overrides = next(p for p in parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD)
    assert "Unpack[OptionArgs]" in str(overrides.annotation)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_a_name_that_is_not_an_option_is_refused_naming_the_entry_point(name):
    with pytest.raises(OptionError, match=rf"{name}\(\) got an unknown option 'max_chunk'; the options are"):
        ENTRY_POINTS[name](max_chunk=8)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_keywords_become_options_before_any_work(name):
    with pytest.raises(OptionError, match="max_chunks must be an int >= 1"):
        ENTRY_POINTS[name](max_chunks=0)
    with pytest.raises(OptionError, match="max_chunks must be an int >= 1"):
        ENTRY_POINTS[name](options=PlanOptions(max_chunks=4), max_chunks=-1)  # keywords override options


READS_OPTIONS = {  # what each entry point says about PlanOptions(world_size=2, units=("nope.*",)), before any work
    "optimize": "unit 'nope.*' matches no submodule", "prepare": "unit 'nope.*' matches no submodule",
    "sweep": "unit 'nope.*' matches no submodule", "plan_for": "world_size= is fixed when the model is prepared",
    "optimize_compiled": r"optimize_compiled\(\) does not take world_size=: it compiles and measures every "
                         "partition here", "enable": r"enable\(\) does not take world_size=: it plans the model for "
                                                    "this process and its own device",
    "profile": r"profile\(\) does not take world_size=: profile\(\) measures one step as it is",
    "Plan.apply": r"Plan.apply\(\) does not take world_size=: a saved plan is applied as it was made",
}


@pytest.mark.parametrize("name", READS_OPTIONS)
def test_every_entry_point_reads_its_options_object(name):
    with pytest.raises(OptionError, match=READS_OPTIONS[name]):
        ENTRY_POINTS[name](options=PlanOptions(world_size=2, units=("nope.*",)))


def test_options_object_must_be_plan_options():
    with pytest.raises(OptionError, match=r"optimize\(options=...\) takes a planner.PlanOptions, not dict"):
        optimize(tower(), "60%", inputs=tower_inputs(), options={"max_chunks": 8})


def test_patterns_become_tuples_and_numbers_are_checked():
    opts = PlanOptions(must_save="blocks.*.fc1", must_recompute=["a", "b"], units=["blocks.*"])
    assert opts.must_save == ("blocks.*.fc1",) and opts.must_recompute == ("a", "b") and opts.units == ("blocks.*",)
    for bad in ({"world_size": 0}, {"time_limit_s": -1}, {"time_limit_s": float("inf")}, {"max_chunks": True}):
        with pytest.raises(OptionError):
            PlanOptions(**bad)


@pytest.mark.slow
def test_sweep_plans_with_the_options_it_is_given():
    """sweep honours the prepare-time options (keep_output, max_chunks) as optimize does."""
    tradeoff = sweep(tower(), ["70%"], inputs=tower_inputs(), keep_output=False, max_chunks=4, selective=False)
    assert tradeoff.prepared.options.keep_output is False and tradeoff.prepared.profile.keep_output is False
    assert tradeoff.prepared.regions.n_chunks <= 4
    plan = tradeoff.rows[0].plan
    assert plan.keep_output is False and not any(s.saved_nodes for s in plan.segments)


def test_plan_for_refuses_to_change_what_was_prepared():
    prepared = SimpleNamespace(options=PlanOptions(keep_output=True))
    with pytest.raises(OptionError, match="keep_output= is fixed when the model is prepared"):
        plan_for(prepared, "60%", keep_output=False)


REFUSED = [(option.name, where) for option in fields(PlanOptions) for where in option.metadata["refused"]]
NOT_DEFAULT = {"keep_output": False, "solver": "rotor", "time_limit_s": 5.0, "max_chunks": 8, "selective": False,
               "must_save": ("fc*",), "must_recompute": ("fc*",), "profile": object(), "device": "h100",
               "world_size": 2, "parallel": "ddp", "units": ("blocks.*",), "tensor_parallel": 2, "optimizer": "adamw",
               "gradient_accumulation_steps": 4, "batches_held": 4, "zero_grad": "before_backward",
               "set_to_none": False, "autocast": "bf16", "mixed_precision": object(), "follow_batch": True,
               "shapes": ((4, 8),), "offload": "auto", "host_budget": "1GB", "ranks_per_host": 8,
               "budget_bounds": "allocated", "compilable": True,
               "compile_backend": "aot_eager", "pipeline": "1f1b:2:4", "pipeline_rank": 1}


@pytest.mark.parametrize("name, where", REFUSED, ids=[f"{w}-{n}" for n, w in REFUSED])
def test_an_option_that_does_not_apply_to_an_entry_point_is_one_line_naming_both(name, where):
    """What each entry point accepts is derived from PlanOptions' fields: an option set for an entry point it
    does not apply to is refused before any work, in one line that names the entry point, the option and why."""
    with pytest.raises(OptionError, match=rf"^{where.replace('.', '[.]')}\(\) does not take {name}=: [^\n]+$"):
        ENTRY_POINTS[where](**{name: NOT_DEFAULT[name]})


def test_every_option_that_shapes_capture_or_profile_is_fixed_when_prepared():
    assert set(PREPARED) == {"loss_fn", "keep_output", "profile", "device", "world_size", "parallel", "units",
                             "optimizer", "gradient_accumulation_steps", "batches_held", "zero_grad", "set_to_none",
                             "autocast", "mixed_precision", "follow_batch", "shapes", "tensor_parallel", "compilable",
                             "compile_backend"}
    prepared = SimpleNamespace(options=PlanOptions())
    for name, value in (("mixed_precision", object()), ("follow_batch", True)):
        with pytest.raises(OptionError, match=f"{name}= is fixed when the model is prepared"):
            plan_for(prepared, "60%", **{name: value})
