"""ckplan: automatic activation-checkpoint planning for PyTorch training.

    from planner import optimize
    plan = optimize(model, "60%", inputs=(x,))
    loss_fn(plan.module(x)).backward()

The pipeline (one module per stage): capture -> profile -> regions -> simulate
-> solve -> rewrite, with measure as the check. See docs/architecture.md.
"""

from planner.budget import parse_budget
from planner.errors import CaptureError, InfeasibleBudget, PlannerError, ProfileError
from planner.explore import Tradeoff, sweep
from planner.optimize import Prepared, optimize, plan_for, prepare
from planner.plan import Plan, Segment, load_plan
from planner.costs import Profile
from planner.devices import device_names
from planner.errors import ProfileFileError, ProfileMismatch
from planner.profile_api import profile  # the function; the stage's module stays importable as planner.profile
from planner.profile_io import load_profile

__all__ = [
    "optimize", "prepare", "plan_for", "Prepared", "load_plan", "Plan", "Segment", "InfeasibleBudget", "PlannerError", "CaptureError",
    "ProfileError", "parse_budget", "sweep", "Tradeoff",
    "profile", "Profile", "load_profile", "ProfileMismatch", "ProfileFileError", "device_names",
]
__version__ = "0.1.0"
