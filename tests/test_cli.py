"""The ckplan command, run as a subprocess: every option, every error path, on the bundled examples
and on model files the tests write. User errors exit 2 with one line and no traceback; an
infeasible budget exits 3 with the smallest peak.

The error cases only import torch and fail, so they run concurrently (one module fixture). Every test
that starts the command is marked slow (each run starts Python and imports torch); the user errors
that go through ``main()`` in this process stay in the quick run.
"""

from __future__ import annotations

import json
import os
import pty
import re
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from planner import load_plan, parse_budget
from planner.report.cli import main
from planner.report.model_file import MODEL_MODULE, load_model_file
from planner.solve.registry import SOLVERS

ROOT = Path(__file__).resolve().parent.parent
SEED_CNN = str(ROOT / "examples" / "seed_cnn.py")
TRACEBACK = "Traceback (most recent call last)"
STAGES = ("capture: tracing", "profile: one training step", "solve: choosing segments")

MLP = """\
import torch
from torch import nn

model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64))
inputs = (torch.randn(512, 64),)
"""

NAMED = """\
import sys
import torch
from torch import nn
from helper import WIDTH  # a module next to the model file


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(WIDTH, 256)
        self.b = nn.Linear(256, WIDTH)

    def forward(self, x, scale):
        return self.b(torch.relu(self.a(x))) * scale


def build():
    return Net()


def make_batch():
    return {"x": torch.randn(256, WIDTH), "scale": torch.tensor(2.0)}


def criterion(out):
    print("criterion called", file=sys.stderr)
    return out.square().mean()


if __name__ == "__main__":
    raise SystemExit("the model file's main block ran")
"""


def _env() -> dict[str, str]:
    """A plain environment: no forced colours, a fixed width so tables do not wrap."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "CLICOLOR_FORCE")}
    env.update(COLUMNS="120", TERM="xterm-256color")
    return env


def ckplan(*args: str, cwd: Path = ROOT, command: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    command = command or (sys.executable, "-m", "planner")
    return subprocess.run([*command, *args], capture_output=True, text=True, cwd=cwd, env=_env(), timeout=300)


def ckplan_tty(*args: str, cwd: Path) -> tuple[subprocess.CompletedProcess, str]:
    """Runs ckplan with stderr on a pseudo-terminal; returns the result and what the terminal received."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "planner", *args], cwd=cwd, env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO once the process has closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain)
    reader.start()
    stdout, _ = proc.communicate(timeout=300)
    reader.join(timeout=10)
    os.close(master)
    terminal = b"".join(chunks).decode(errors="replace")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, ""), terminal


def no_traceback(result: subprocess.CompletedProcess) -> bool:
    return TRACEBACK not in result.stderr and TRACEBACK not in result.stdout


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A directory with the model files of the success tests."""
    path = tmp_path_factory.mktemp("models")
    (path / "mlp.py").write_text(MLP)
    (path / "named.py").write_text(NAMED)
    (path / "helper.py").write_text("WIDTH = 64\n")
    return path


# -- success: the report, --save, --emit, --solver, --time-limit, --device, --verify ----------------------------


@pytest.fixture(scope="module")
def planned(work) -> subprocess.CompletedProcess:
    return ckplan("mlp.py", "--budget", "90%", "--save", "plan.json", "--emit", "out.py", "--solver", "cpsat",
                  "--time-limit", "10", "--device", "cpu", "--verify", cwd=work)


@pytest.mark.slow
def test_report_has_a_header_and_a_segment_table(planned):
    assert planned.returncode == 0, planned.stderr
    out = planned.stdout
    assert re.search(r"peak\s+3\.31 MiB → [\d.]+ (KiB|MiB) \(-\d+\.\d%\)", out), out
    assert re.search(r"budget\s+[\d.]+ MiB \(90% of the un-checkpointed peak\)", out), out
    assert re.search(r"overhead\s+\+\d+\.\d% predicted", out), out
    assert "solver cpsat OPTIMAL" in out and "on cpu" in out
    assert "checkpointed segments" in out
    row = re.search(r"^\s*0\s+(\S.*?)\s+(\d+)\s+([\d.]+ (?:B|KiB|MiB))\s+([\d.]+) ms\s*$", out, re.M)
    assert row is not None, out
    assert int(row.group(2)) >= 1 and row.group(3) != "0 B"


@pytest.mark.slow
def test_no_progress_when_stderr_is_not_a_terminal(planned):
    assert planned.returncode == 0
    assert not any(stage in planned.stderr for stage in STAGES), planned.stderr


@pytest.mark.slow
def test_save_writes_a_plan_load_plan_reads(planned, work):
    assert planned.returncode == 0, planned.stderr
    assert "plan saved to plan.json" in planned.stdout
    plan = load_plan(work / "plan.json")
    assert plan.segments and plan.budget_bytes < plan.baseline_peak_bytes and plan.device == "cpu"
    assert all(seg.module_paths and seg.freed_bytes > 0 for seg in plan.segments)


@pytest.mark.slow
def test_emit_writes_the_rewritten_source(planned, work):
    assert planned.returncode == 0, planned.stderr
    assert "module source written to out.py" in planned.stdout
    text = (work / "out.py").read_text()
    assert "torch.utils.checkpoint.checkpoint" in text and "class Checkpointed" in text
    assert "_ckplan_base" in text.split("class ")[0] and "load_plan('plan.json').apply(model)" in text
    compile(text, str(work / "out.py"), "exec")


@pytest.mark.slow
def test_empty_plan_emits_and_explains(work, tmp_path):
    result = ckplan(str(work / "mlp.py"), "--budget", "100%", "--emit", "empty.py", "--explain", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "0 checkpointed segments" in result.stdout and "already fits the budget" in result.stdout
    assert "saved for backward by" in result.stdout  # what stays at the peak, even with nothing checkpointed
    text = (tmp_path / "empty.py").read_text()
    assert text.startswith("# Generated by ckplan") and "checkpoint(" not in text
    compile(text, "empty.py", "exec")


# -- --json, --verify, --explain, --quiet, progress ---------------------------------------------------------------


@pytest.mark.slow
def test_json_with_verify_is_one_object_on_stdout(work):
    result = ckplan("mlp.py", "--budget", "90%", "--json", "--verify", cwd=work)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)  # nothing else on stdout
    for key in ("budget_bytes", "predicted_peak_bytes", "baseline_peak_bytes", "predicted_overhead",
                "solver_status", "solve_time_s"):
        assert key in data, key
    assert data["predicted_peak_bytes"] <= data["budget_bytes"] < data["baseline_peak_bytes"]
    assert data["solver"] == "cpsat" and data["solver_status"] in ("OPTIMAL", "FEASIBLE")
    assert data["segments"] and all(seg["module_paths"] and seg["nodes"] for seg in data["segments"])
    assert all(seg["freed_bytes"] > 0 and seg["recompute_ms"] >= 0 for seg in data["segments"])
    verify = data["verify"]
    assert verify["planned_peak_bytes"] == pytest.approx(data["predicted_peak_bytes"], rel=0.1)
    assert verify["baseline_peak_bytes"] == pytest.approx(data["baseline_peak_bytes"], rel=0.1)
    assert verify["planned_peak_bytes"] < verify["baseline_peak_bytes"]
    assert verify["baseline_step_ms"] > 0 and verify["planned_step_ms"] > 0 and verify["runs"] == 5


@pytest.mark.slow
def test_verify_prints_measured_next_to_predicted(planned):
    assert planned.returncode == 0, planned.stderr
    out = planned.stdout
    assert "verify: real training steps (median of 5)" in out
    row = re.search(r"peak with the plan\s+([\d.]+ [KM]iB)\s+([\d.]+ [KM]iB) (✓ fits|✗ over budget)", out)
    assert row is not None, out
    assert re.search(r"peak without the plan\s+3\.31 MiB\s+[\d.]+ MiB", out), out
    assert re.search(r"step without the plan\s+[\d.]+ ms\s+[\d.]+ ms", out), out
    assert re.search(r"step with the plan\s+[\d.]+ ms\s+[\d.]+ ms", out), out
    assert re.search(r"overhead\s+\+[\d.]+%\s+[+-][\d.]+%", out), out


@pytest.mark.slow
def test_explain_on_the_seed_example():
    result = ckplan(SEED_CNN, "--budget", "95%", "--explain")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "checkpointed segments in detail" in out
    row = re.search(r"^\s*0\s+(\S+)\s+([\d.]+ [KM]iB)\s+([\d.]+) ms\s+[\d,]+\s*$", out, re.M)  # paths, frees, ms
    assert row is not None, out
    assert row.group(2) != "0 B" and re.search(r"\d+ nodes?: ", out)
    assert "what the peak" in out and "parameters and buffers" in out
    assert "largest activations kept at the peak" in out and "why it stays" in out
    assert "saved for backward by relu" in out


@pytest.mark.slow
def test_quiet_prints_the_header_only_and_no_progress(work):
    result, terminal = ckplan_tty("mlp.py", "--budget", "90%", "--quiet", cwd=work)
    assert result.returncode == 0, terminal
    assert "peak" in result.stdout and "overhead" in result.stdout and "budget" in result.stdout
    assert "checkpointed segments" not in result.stdout.replace("1 checkpointed segment", "")
    assert not any(stage in terminal for stage in STAGES), terminal


@pytest.mark.slow
def test_progress_on_a_terminal_stderr(work):
    result, terminal = ckplan_tty("mlp.py", "--budget", "90%", cwd=work)
    assert result.returncode == 0, terminal
    assert all(stage in terminal for stage in STAGES), terminal
    assert "checkpointed segments" in result.stdout and "capture:" not in result.stdout


@pytest.mark.slow
def test_other_names_callables_and_dict_inputs(work):
    result = ckplan("named.py", "--model", "build", "--inputs", "make_batch", "--loss", "criterion",
                    "--budget", "100%", "--json", cwd=work)
    assert result.returncode == 0, result.stderr
    assert "criterion called" in result.stderr and "main block ran" not in result.stderr
    assert json.loads(result.stdout)["segments"] == []


# -- exit 3: infeasible ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_infeasible_budget_on_the_seed_example_exits_3():
    result = ckplan(SEED_CNN, "--budget", "70%")
    assert result.returncode == 3, result.stderr
    err = result.stderr
    assert "infeasible" in err and "smallest peak any checkpointing plan reaches" in err
    assert "parameters and buffers" in err and re.search(r"total\s+[\d.]+ MiB", err)
    assert re.search(r"--budget \d+", err) and no_traceback(result)
    assert result.stdout == ""


@pytest.mark.slow
def test_infeasible_budget_in_json(work):
    result = ckplan("mlp.py", "--budget", "50%", "--json", cwd=work)
    assert result.returncode == 3, result.stderr
    data = json.loads(result.stdout)
    assert data["error"] == "infeasible" and data["min_peak_bytes"] > data["budget_bytes"] > 0
    assert data["breakdown"]["parameters and buffers"] > 0 and no_traceback(result)


# -- exit 2: user errors, one line, no traceback ------------------------------------------------------------------
# The errors the issue names run as subprocesses, concurrently (each only starts Python, imports torch and
# fails); the other user errors go through the same main() in this process, which is fast.

LINEAR = "import torch\nmodel = torch.nn.Linear(2, 2)\ninputs = (torch.randn(3, 2),)\n"
SUBPROCESS_ERRORS = {
    # id: (model.py source or None for a missing file, arguments after the file, text stderr must contain)
    "unknown-flag": (LINEAR, ["--frobnicate"], "unrecognized arguments: --frobnicate"),
    "missing-file": (None, [], "model file missing.py does not exist"),
    "syntax-error": ("import torch\nmodel = (\n", [], "model.py:2: SyntaxError"),
    "raises": ("import torch\n\nraise RuntimeError('boom [1]')\n", [], "model.py:3: RuntimeError: boom [1]"),
    "no-model": ("import torch\ninputs = (torch.randn(2, 2),)\n", [], "defines no `model`: define a module-level"),
    "no-inputs": ("import torch\nmodel = torch.nn.Linear(2, 2)\n", [], "or name another with --inputs NAME"),
    "bad-budget": (LINEAR, ["--budget", "12XB"], "unknown unit 'XB'"),
}
IN_PROCESS_ERRORS = {
    "factory-raises": ("import torch\ndef model():\n    return torch.nn.Linear(2, 2, bogus=1)\n"
                       "inputs = (torch.randn(3, 2),)\n", [], "model.py:3: TypeError"),
    "not-a-module": ("model = 3\ninputs = ()\n", [], "`model` in model.py is of type int, not a torch.nn.Module"),
    "bad-inputs": ("import torch\nmodel = torch.nn.Linear(2, 2)\ninputs = 5\n", [],
                   "`inputs` in model.py: inputs must"),
    "bad-percent": (LINEAR, ["--budget", "150%"], "a percentage must be in (0, 100]"),
    "zero-budget": (LINEAR, ["--budget", "0"], "must be a positive number of bytes"),
    "unknown-solver": (LINEAR, ["--solver", "nope"], "argument --solver: invalid choice: 'nope'"),
    "bad-time-limit": (LINEAR, ["--time-limit", "0"], "'0' is not a positive number of seconds"),
    "unknown-device": (LINEAR, ["--device", "tpu9"], "'tpu9' is not a device ckplan can plan on; use cpu, cuda"),
    "absent-device": (LINEAR, ["--device", "cuda:99"], "argument --device: cuda:99: "),
    "model-name": (LINEAR, ["--model", "net"], "defines no `net`: check the name given to --model"),
    "inputs-name": (LINEAR, ["--inputs", "batch"], "defines no `batch`: check the name given to --inputs"),
    "loss-name": (LINEAR, ["--loss", "criterion"], "defines no `criterion` (named by --loss)"),
    "loss-not-callable": (LINEAR + "loss_fn = 3\n", [], "`loss_fn` in model.py is of type int, not a function"),
    "exits": ("import sys\nsys.exit(4)\n", [], "model.py:2: SystemExit: 4: the model file exited while loading"),
    "nothing-to-train": ("import torch\nclass M(torch.nn.Module):\n    def forward(self, x):\n"
                         "        return x if x.sum() > 0 else -x\nmodel = M()\ninputs = (torch.randn(3, 2),)\n",
                         [], "M has no parameter that requires grad"),
    "fails-to-run": ("import torch\nmodel = torch.nn.Linear(2, 2)\ninputs = (torch.randn(3, 5),)\n", [],
                     "mat1 and mat2 shapes cannot be multiplied"),
    "save-dir-missing": (LINEAR, ["--save", "nowhere/plan.json"], "--save nowhere/plan.json: directory nowhere"),
    "emit-over-model": (LINEAR, ["--emit", "model.py"], "--emit model.py would overwrite the model file"),
    "compiled-with-verify": (LINEAR, ["--compiled", "--verify"], "--verify applies to eager plans, and --compiled"),
    "compiled-with-solver": (LINEAR, ["--compiled", "--solver", "rotor"], "--solver applies to eager plans"),
    "fractions-alone": (LINEAR, ["--fractions", "0.5"], "--fractions applies to --compiled only"),
    "bad-pipeline": (LINEAR, ["--pipeline", "1f1b:4"], "give SCHEDULE:STAGES:MICROBATCHES[:CHUNKS]"),
    "pipeline-rank-alone": (LINEAR, ["--pipeline-rank", "2"], "give pipeline= too"),
    "compiled-with-backend": (LINEAR, ["--compiled", "--compile-backend", "inductor"],
                              "--compile-backend applies to eager plans, and --compiled"),
    "compile-backend-for-a-spec": (LINEAR, ["--compile-backend", "inductor", "--device", "h100"],
                                   "compile_backend= fits the plan to the compiled step measured on this device"),
    "bad-fractions": (LINEAR, ["--compiled", "--fractions", "0.5,2"], "--fractions must be numbers in [0, 1]"),
}
DEBUG = ("import torch\n\nraise RuntimeError('boom')\n", ["--debug"], "model.py:3: RuntimeError: boom")
JSON_ERROR = ("import torch\nmodel = torch.nn.Linear(2, 2)\n", ["--json"], "defines no `inputs`")


@pytest.fixture(scope="module")
def error_runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every subprocess error case, run concurrently."""
    cases = {**SUBPROCESS_ERRORS, "debug": DEBUG, "json": JSON_ERROR}

    def run(name: str) -> subprocess.CompletedProcess:
        source, args, _ = cases[name]
        cwd = tmp_path_factory.mktemp(name)
        if source is not None:
            (cwd / "model.py").write_text(source)
        return ckplan("model.py" if source is not None else "missing.py", *args, cwd=cwd)

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return dict(zip(cases, pool.map(run, cases)))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SUBPROCESS_ERRORS))
def test_user_errors_exit_2_with_one_message_and_no_traceback(error_runs, case):
    result = error_runs[case]
    assert result.returncode == 2, result.stderr
    assert SUBPROCESS_ERRORS[case][2] in result.stderr, result.stderr
    assert "ckplan: error:" in result.stderr and no_traceback(result) and result.stdout == ""


@pytest.mark.slow
def test_debug_shows_the_traceback_with_the_same_exit_code(error_runs):
    result = error_runs["debug"]
    assert result.returncode == 2
    assert TRACEBACK in result.stderr and DEBUG[2] in result.stderr


@pytest.mark.slow
def test_json_user_error_is_a_json_object(error_runs):
    result = error_runs["json"]
    assert result.returncode == 2
    data = json.loads(result.stdout)
    assert data["error"] == "user_error" and JSON_ERROR[2] in data["message"] and no_traceback(result)


@pytest.mark.parametrize("case", list(IN_PROCESS_ERRORS))
def test_more_user_errors_exit_2(case, tmp_path, monkeypatch, capsys):
    source, args, message = IN_PROCESS_ERRORS[case]
    (tmp_path / "model.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # main() makes the model file's directory importable
    monkeypatch.delitem(sys.modules, MODEL_MODULE, raising=False)
    try:
        code = main(["model.py", *args])
    except SystemExit as exc:  # argparse
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2, err
    assert message in err and "ckplan: error:" in err and TRACEBACK not in err and out == ""
    assert err.count("\n") == 1 or err.startswith("usage: ckplan"), err  # one line (argparse adds its usage)


def test_the_readme_model_file_follows_the_convention(tmp_path, monkeypatch):
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### The command line"):readme.index("## What was measured")]
    (tmp_path / "model.py").write_text(re.search(r"```python\n(.*?)```", section, re.S).group(1))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, MODEL_MODULE, raising=False)
    found = load_model_file(str(tmp_path / "model.py"))
    assert isinstance(found.model, torch.nn.Module) and isinstance(found.inputs, tuple)
    found.loss_fn(found.model(*found.inputs)).backward()


def test_inputs_default_to_the_models_example_inputs(tmp_path, monkeypatch):
    (tmp_path / "model.py").write_text("import torch\nclass M(torch.nn.Linear):\n    def example_inputs(self):\n"
                                       "        return (torch.randn(8, 4),)\nmodel = M(4, 4)\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, MODEL_MODULE, raising=False)
    found = load_model_file(str(tmp_path / "model.py"))
    assert isinstance(found.inputs, tuple) and found.inputs[0].shape == (8, 4) and found.loss_fn is None


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--budget", "--solver", "--time-limit", "--device", "--json", "--save", "--emit", "--verify",
                 "--explain", "--quiet", "--debug", "--model", "--inputs", "--loss", "--compiled", "--fractions"):
        assert flag in text, flag
    assert all(name in text for name in SOLVERS)  # --solver choices come from the registry


@pytest.mark.slow
def test_compiled_json_reports_every_probe_and_a_peak_that_fits(tmp_path):
    """``--compiled --json``: compile's partition and the asked fraction probed, ckplan's plan too; the
    chosen one fits the budget and is the fastest that fits."""
    (tmp_path / "wide.py").write_text(MLP.replace("torch.randn(512, 64)", "torch.randn(8192, 64)"))
    result = ckplan("wide.py", "--compiled", "--budget", "85%", "--fractions", "0.5", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert [(p["source"], p["fraction"]) for p in data["probes"]] == [("knapsack", 1.0), ("knapsack", 0.5),
                                                                      ("plan", 1.0)]
    assert data["budget_bytes"] == parse_budget("85%", baseline_peak_bytes=data["baseline_peak_bytes"])
    assert data["peak_bytes"] <= data["budget_bytes"]
    fitting = [p for p in data["probes"] if p["peak_bytes"] <= data["budget_bytes"]]
    assert data["step_ms"] == min(p["step_ms"] for p in fitting)


# -- python -m planner is ckplan ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_python_m_planner_behaves_like_the_ckplan_script(tmp_path):
    script = shutil.which("ckplan", path=str(Path(sys.executable).parent)) or shutil.which("ckplan")
    if script is None:
        pytest.skip("the ckplan script is not installed (pip install -e .)")
    with ThreadPoolExecutor(max_workers=2) as pool:
        by_script, by_module = pool.map(lambda command: ckplan("missing.py", "--json", cwd=tmp_path, command=command),
                                        [(script,), ()])
    assert by_script.returncode == by_module.returncode == 2
    assert (by_script.stdout, by_script.stderr) == (by_module.stdout, by_module.stderr)
    assert json.loads(by_module.stdout)["error"] == "user_error"


def test_shapes_plans_each_shape_group_ahead_and_saves_them_all(work):
    result = ckplan("mlp.py", "--budget", "90%", "--shapes", "32x64,224x64..256x64", "--json", "--save", "follow.json",
                    "--time-limit", "10", cwd=work)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    groups = data["shape_groups"]
    assert [g["shapes"]["input"] for g in groups] == [[32, 64], [224, 64], [256, 64], [512, 64]]  # range: 2
    assert groups[0]["segments"] == 0 and groups[-1]["segments"] == len(data["segments"]) > 0
    assert all(g["predicted_peak_bytes"] <= data["budget_bytes"] for g in groups)
    assert len(load_plan(work / "follow.json").family.groups) == 4


@pytest.mark.parametrize("flags, message", [
    (("--shapes", "32x0"), "--shapes takes shapes such as 4x64,4x128"),
    (("--shapes", "32x64x2"), "give it 2 dims"),
    (("--shapes", "64x64..32x64"), "must run from a smaller shape to a larger one"),
    (("--shapes", "1x1..512x64"), "covers 256 shape groups (16 x 16); plan at most 64 ahead"),
    (("--follow-batch", "--emit", "out.py"), "--emit writes one plan's source"),
    (("--follow-batch", "--world-size", "2"), "cannot follow the batch on the ranks of an FSDP job"),
])
def test_bad_follow_batch_flags_are_one_line_and_exit_2(work, flags, message):
    result = ckplan("mlp.py", *flags, cwd=work)
    assert result.returncode == 2 and message in result.stderr and no_traceback(result), result.stderr


@pytest.mark.slow
def test_a_reader_that_stops_reading_ends_the_report_quietly(work):
    """``ckplan model.py | head``: a reader that closes the pipe before the report is written leaves no traceback,
    and the plan made is exit 0 (rich's console would exit 1)."""
    read, write = os.pipe()
    os.close(read)  # closed before ckplan writes: every write meets a broken pipe
    try:
        result = subprocess.run([sys.executable, "-m", "planner", "mlp.py", "--budget", "90%"], stdout=write,
                                stderr=subprocess.PIPE, text=True, cwd=work, env=_env(), timeout=300)
    finally:
        os.close(write)
    assert result.returncode == 0 and TRACEBACK not in result.stderr and "Exception" not in result.stderr, result


def test_offload_flags_reach_the_plan_and_a_share_is_no_host_budget(work):
    off = ckplan(str(work / "mlp.py"), "--budget", "90%", "--offload", "off", "--json", "--time-limit", "5")
    assert off.returncode == 0, off.stderr
    assert json.loads(off.stdout)["offload"] is None
    bad = ckplan(str(work / "mlp.py"), "--offload", "auto", "--host-budget", "50%")
    assert bad.returncode == 2 and no_traceback(bad)
    assert "--host-budget is a size such as 64GB" in bad.stderr
    bad = ckplan(str(work / "mlp.py"), "--ranks-per-host", "0")
    assert bad.returncode == 2 and no_traceback(bad)
    assert "ranks_per_host must be an integer >= 1" in bad.stderr
