"""The memory model and the solver run without torch (docs/architecture.md: planning from a saved
profile needs no torch, and the solver never imports it).

A fresh interpreter blocks every ``torch`` import, imports every module of ``planner.common``,
``planner.memory`` and ``planner.solve``, and plans a small synthetic graph with the registry's two planners (``cpsat``,
``rotor``) and with CP-SAT alone. A module that reaches torch, directly or through another planner
module, fails here.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent('''
    import importlib
    import importlib.abc
    import pkgutil
    import sys

    class BlockTorch(importlib.abc.MetaPathFinder):
        """Any import of torch or a torch submodule fails, as if torch were not installed."""
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is blocked in this test (import of {name!r})")
            return None

    assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules)
    sys.meta_path.insert(0, BlockTorch())
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        raise AssertionError("the torch blocker does not work")

    import planner.common
    import planner.memory
    import planner.solve

    imported = []
    for package in (planner.common, planner.memory, planner.solve):
        for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            importlib.import_module(info.name)
            imported.append(info.name)

    from planner.memory.simulate import simulate
    from planner.memory.synthetic import brute_force, graph_profile, memory_model, min_peak_brute
    from planner.solve.cpsat import search
    from planner.solve.deadline import Deadline
    from planner.solve.registry import SOLVERS

    # Five nodes and the loss: each allocates its output and saves its input or its output.
    profile = graph_profile(sizes=[400, 800, 200, 800, 400], costs_ms=[1.0, 3.0, 0.5, 3.0, 1.0],
                            saves_input=[True, False, True, False, True])
    model = memory_model(profile)
    baseline = simulate(model, ()).peak_bytes
    smallest = min_peak_brute(model)
    assert smallest < baseline, (smallest, baseline)
    budget = (smallest + baseline) // 2
    best_us = brute_force(model, budget)
    for name in ("cpsat", "rotor"):  # the planners: a plan that fits, as cheap as any
        solution = SOLVERS[name](model, budget, deadline=Deadline.after(5.0))
        assert simulate(model, solution.plan).peak_bytes <= budget, name
        assert solution.recompute_us == best_us, (name, solution.recompute_us, best_us)
    alone = search(model, budget, deadline=Deadline.after(5.0))  # CP-SAT itself, without the DPs in front
    assert simulate(model, alone.plan).peak_bytes <= budget
    assert alone.recompute_us == best_us

    leaked = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    assert not leaked, leaked
    print("imported", len(imported), " ".join(imported))
''')


def test_memory_model_and_solver_import_and_plan_without_torch():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    names = done.stdout.split()[2:]
    assert "planner.memory.simulate" in names and "planner.solve.cpsat" in names, done.stdout
    assert len(names) >= 12, done.stdout  # every module of both packages, not a lucky few
