"""The ckplan command: success, saved plans, and exit codes without tracebacks for user errors."""

import subprocess
import sys
from pathlib import Path

import pytest

from planner import load_plan

ROOT = Path(__file__).resolve().parent.parent


def ckplan(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planner", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def test_plans_an_example_and_saves_it(tmp_path):
    out = tmp_path / "plan.json"
    result = ckplan("examples/resnet.py", "--budget", "60%", "--save", str(out))
    assert result.returncode == 0, result.stderr
    assert "checkpointed segment" in result.stdout and "layers." in result.stdout
    assert load_plan(out).segments


def test_infeasible_budget_exits_3_with_the_smallest_peak():
    result = ckplan("examples/seed_cnn.py", "--budget", "1KB")
    assert result.returncode == 3
    assert "smallest peak" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("source", "args", "message"),
    [
        (None, [], "does not exist"),
        ("model = (\n", [], "SyntaxError"),
        ("raise RuntimeError('boom')\n", [], "model.py:1: RuntimeError: boom"),
        ("import torch\ninputs = (torch.randn(2, 2),)\n", [], "defines no `model`"),
        ("import torch\nmodel = torch.nn.Linear(2, 2)\n", [], "defines no `inputs`"),
        ("import torch\nmodel = torch.nn.Linear(2, 2)\ninputs = (torch.randn(3, 2),)\n", ["--budget", "12XB"],
         "unknown unit"),
    ],
)
def test_user_errors_exit_2_without_traceback(tmp_path, source, args, message):
    target = "missing.py"
    if source is not None:
        (tmp_path / "model.py").write_text(source)
        target = "model.py"
    result = ckplan(target, *args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_unknown_flag_exits_2():
    assert ckplan("examples/seed_cnn.py", "--frobnicate").returncode == 2
