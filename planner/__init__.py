"""ckplan: automatic activation-checkpoint planning for PyTorch training.

    from planner import optimize
    plan = optimize(model, "60%", inputs=(x,))
    loss_fn(plan.module(x)).backward()

The pipeline, one subpackage per stage: capture -> profiling -> memory -> solve -> rewrite;
``optimize`` wires them, ``report`` holds the views. See docs/architecture.md.

The public names below are imported on first use, so that the torch-free stages
(``planner.memory``, ``planner.solve``) can be imported without torch.
"""

import importlib

_PUBLIC = {
    "optimize": "planner.api", "prepare": "planner.pipeline", "plan_for": "planner.pipeline",
    "Prepared": "planner.pipeline", "enable": "planner.inplace", "disable": "planner.inplace",
    "Plan": "planner.plan", "Segment": "planner.plan", "load_plan": "planner.plan_file",
    "parse_budget": "planner.common.budget", "PlanOptions": "planner.options", "ShapeRange": "planner.follow.shapes",
    "PlannerError": "planner.errors", "CaptureError": "planner.errors", "InfeasibleBudget": "planner.errors",
    "OptionError": "planner.errors",
    "OutOfTime": "planner.errors", "CompileError": "planner.errors",
    "ProfileError": "planner.errors", "ProfileMismatch": "planner.errors", "ProfileFileError": "planner.errors",
    "profile": "planner.pipeline", "Profile": "planner.profiling.record",
    "load_profile": "planner.profiling.record",
    "device_names": "planner.profiling.devices",
    "sweep": "planner.report.explore", "Tradeoff": "planner.report.explore",
    "plot_timeline": "planner.report.plotting", "plot_shapes": "planner.report.plotting",
    "optimize_compiled": "planner.compiled.api", "CompiledPlan": "planner.compiled.api",
    "Pipeline": "planner.memory.pipeline", "Schedule": "planner.memory.pipeline", "CompiledStep": "planner.plan",
}
__all__ = list(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'planner' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
