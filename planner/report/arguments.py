"""What the ``ckplan`` command line accepts: the argument parser (``build_parser``) and the argparse types that
check each value where it is read, so that a bad one is one line and exit code 2 before any model runs.
``planner.report.cli`` runs what was asked."""

from __future__ import annotations

import argparse
import re

import torch

from planner.common.budget import ACCEPTED_FORMS, BudgetBounds, check_budget, parse_budget
from planner.common.loop import ZeroGrad
from planner.errors import BudgetError, OptionError
from planner.follow.shapes import ShapeRange
from planner.options import AUTOCAST_DTYPES
from planner.profiling.devices import device_names
from planner.profiling.optimizer import NAMED
from planner.solve.registry import SOLVERS

DEVICE_FORMS = "cpu, cuda or cuda:N, or a device spec name (h100, a100-80gb...)"
MIXED_PRECISION = {"bf16": "bfloat16", "fp16": "float16"}
"""``--mixed-precision`` choices: the dtype FSDP2 gathers and computes in (gradients are reduced in float32)."""


def build_parser() -> argparse.ArgumentParser:
    """The ``ckplan`` argument parser; ``--solver`` choices come from ``planner.solve.registry.SOLVERS``."""
    p = argparse.ArgumentParser(
        prog="ckplan",
        description="Plan activation checkpointing so one training step of a PyTorch model fits a memory budget.",
        epilog="exit codes: 0 success, 1 internal error (a bug in ckplan), 2 user error, 3 infeasible budget (proven), "
               "4 no plan found within the cut positions tried (--max-chunks; not proven infeasible). "
               "Full reference: docs/cli.md",
    )
    p.add_argument("model_file", help="Python file defining `model`, `inputs` and optionally `loss_fn`")
    p.add_argument("--budget", type=_budget, default="75%",
                   help=f"peak memory of one training step: {ACCEPTED_FORMS.replace('%', '%%')} (default: 75%%)")
    p.add_argument("--solver", choices=list(SOLVERS), default="cpsat", help="planning strategy (default: cpsat)")
    p.add_argument("--time-limit", type=_seconds, default=30.0, metavar="SECONDS",
                   help="solver time limit; past it the best plan found is used (default: 30)")
    p.add_argument("--device", type=_device,
                   help=f"{DEVICE_FORMS}: move the model and inputs there first, or plan for the named device "
                        "without it (memory from meta tensors, times from its datasheet; docs/profiles.md) "
                        "(default: measure where the file puts them)")
    p.add_argument("--world-size", type=_ranks, default=1, metavar="N",
                   help="plan for one rank of a job on N ranks (docs/distributed.md; default: 1)")
    p.add_argument("--tensor-parallel", type=_degree, default=1, metavar="N",
                   help="plan one rank of a job that also splits each layer over N ranks by tensor parallelism "
                        "(a Hugging Face config's base_model_tp_plan), estimated for --device; --world-size then "
                        "counts the data-parallel ranks (docs/distributed.md; default: 1)")
    p.add_argument("--parallel", choices=["fsdp", "ddp"],
                   help="data-parallel engine the budget is per rank of (default: fsdp when --world-size > 1)")
    p.add_argument("--optimizer", type=_optimizer, metavar="NAME|BYTES",
                   help=f"count this optimizer's state and step in the budget: {', '.join(NAMED)}, or the bytes of its "
                        "state (default: none)")
    p.add_argument("--gradient-accumulation-steps", type=_micro_steps, default=1, metavar="N",
                   help="micro-steps per optimizer step: the earlier ones' gradients are alive through the next "
                        "forward and backward (default: 1)")
    p.add_argument("--batches-held", type=_at_least_one("--batches-held", " (micro-batches alive at once)"),
                   default=1, metavar="N",
                   help="micro-batches the loop holds at once: Trainer and TRL take an optimizer step's together, "
                        "so N = their gradient_accumulation_steps (default: 1)")
    p.add_argument("--zero-grad", choices=[z.value for z in ZeroGrad], default=ZeroGrad.BEFORE_FORWARD.value,
                   help="where the loop clears the gradients: before_backward is Lightning's order, which keeps the "
                        "last step's through the forward (default: before_forward)")
    p.add_argument("--zero-grad-keeps-tensors", action="store_true",
                   help="the loop calls zero_grad(set_to_none=False): zero-filled gradients alive through every step")
    p.add_argument("--autocast", choices=list(AUTOCAST_DTYPES),
                   help="the training step runs under torch.autocast in this dtype (default: none)")
    p.add_argument("--mixed-precision", choices=list(MIXED_PRECISION),
                   help="FSDP2 mixed precision: parameters gathered and computed in this dtype, gradients reduced "
                        "in float32 (MixedPrecisionPolicy; docs/distributed.md)")
    p.add_argument("--max-chunks", type=_chunks, default=None, metavar="N",
                   help="most cut positions for segments: more give finer plans, slower solves (default: 64, or two "
                        "per repeated block for a model of 33 to 128)")
    p.add_argument("--drop-output", action="store_true",
                   help="the training loop drops the model's output before backward, as Hugging Face Trainer "
                        "does (default: a plain loop that keeps it; docs/huggingface.md)")
    p.add_argument("--offload", choices=["auto", "off"],
                   help="copy kept activations to host memory and back where that costs less than re-running them: "
                        "auto turns it on, off turns it off (default: on where the device has a host link that runs "
                        "beside compute, a GPU or a GPU's spec; off on a CPU, whose host memory is its own; "
                        "docs/offload.md)")
    p.add_argument("--host-budget", type=_host_budget, metavar="SIZE",
                   help="most pinned host memory the offloaded activations may hold, per rank, e.g. 64GB (default: "
                        "half of the host's memory split among --ranks-per-host; no limit where it is unknown)")
    p.add_argument("--ranks-per-host", type=int, metavar="N",
                   help="ranks whose offloads share one host's memory bandwidth and pinned memory (default: for a "
                        "device spec, world size x tensor parallel up to the spec's gpus_per_host; on a GPU, "
                        "torchrun's LOCAL_WORLD_SIZE, else 1; docs/offload.md)")
    p.add_argument("--budget-bounds", choices=[b.value for b in BudgetBounds], default=BudgetBounds.RESERVED.value,
                   help="on a GPU, what the budget bounds: what the CUDA caching allocator reserves, its rounding and "
                        "segments included (what runs out), or what it allocates (max_memory_allocated) "
                        "(default: reserved; docs/memory-model.md)")
    p.add_argument("--whole-segments", action="store_true",
                   help="re-run whole segments (no op-level saves inside them; docs/selective.md)")
    p.add_argument("--compilable", action="store_true",
                   help="plan for torch.compile: a plan run by module hooks (Hugging Face models) gets segments of "
                        "one module call each, which compiled code runs (docs/compiled.md)")
    p.add_argument("--pipeline", metavar="SCHEDULE:STAGES:MICROBATCHES[:CHUNKS]",
                   help="plan one stage of a pipeline-parallel job (1f1b:4:8; schedules gpipe, 1f1b, "
                        "interleaved_1f1b): the model file's model is the stage, its inputs one microbatch, and the "
                        "budget bounds the stage with the microbatches its schedule keeps in flight "
                        "(docs/distributed.md)")
    p.add_argument("--pipeline-rank", type=int, default=0, metavar="R",
                   help="the stage's place in the pipeline, 0 for the first (with --pipeline)")
    p.add_argument("--compile-backend", metavar="NAME",
                   help="the step runs under torch.compile with this backend (inductor, aot_eager): the plan "
                        "compiles and is fitted to the compiled step, measured here (docs/compiled.md)")
    p.add_argument("--follow-batch", action=argparse.BooleanOptionalAction, default=None,
                   help="each training call runs the plan of its own shape's group: none where the step fits "
                        "(default: where the plan runs by module hooks and the loss is the model's own output)")
    p.add_argument("--shapes", type=_shapes, metavar="SHAPE,...",
                   help="shapes to plan ahead when following the batch (implies --follow-batch), e.g. 4x64,4x128, "
                        "or every group of a range, 4x64..4x512: each given to the inputs shaped like the largest")
    p.add_argument("--must-save", action="append", default=[], metavar="PATTERN",
                   help="module path or op name (glob) never re-run in backward; repeatable")
    p.add_argument("--must-recompute", action="append", default=[], metavar="PATTERN",
                   help="module path or op name (glob) always re-run in backward, never kept; repeatable")
    p.add_argument("--model", default="model", metavar="NAME", help="name of the model in the file (default: model)")
    p.add_argument("--inputs", default="inputs", metavar="NAME", help="name of the inputs (default: inputs)")
    p.add_argument("--loss", metavar="NAME", help="name of the loss function (default: loss_fn, if defined)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of the report")
    p.add_argument("--save", metavar="PLAN.json", help="write the plan as JSON (read it with planner.load_plan)")
    p.add_argument("--profile", metavar="PROFILE.json",
                   help="plan from a saved profile instead of profiling (it must match the model and inputs)")
    p.add_argument("--save-profile", metavar="PROFILE.json",
                   help="write this run's profile as JSON, to plan later with --profile (docs/profiles.md)")
    p.add_argument("--emit", metavar="OUT.py", help="write the Python source of the rewritten module")
    p.add_argument("--verify", action="store_true",
                   help="run a real training step with and without the plan and report measured peak and time")
    p.add_argument("--explain", action="store_true",
                   help="per segment, bytes freed and ms recomputed; the largest activations kept and why")
    p.add_argument("--compiled", action="store_true",
                   help="for torch.compile: the fastest compiled partition whose measured peak fits the budget "
                        "(one compilation per probe; docs/compiled.md)")
    p.add_argument("--fractions", type=_fractions, metavar="F,F,...",
                   help="with --compiled: the activation_memory_budget fractions to probe (default: "
                        "1,0.8,0.6,0.5,0.4,0.3,0.2,0.1,0)")
    p.add_argument("--quiet", action="store_true", help="no progress and no segment table: the header only")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return p


def _budget(text: str) -> int | str:
    """A budget as the API takes it: digits (``4000000000``, ``4_000_000_000``) are bytes."""
    digits = re.fullmatch(r"\s*[0-9][0-9_]*\s*", text) and len(text) <= 100  # int() refuses 4300 digits
    value: int | str = int(text) if digits else text
    try:
        check_budget(value)
    except BudgetError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _host_budget(text: str) -> int | str:
    """``--host-budget``: a size (``64GB``) or bytes, not a share (pinned memory has no un-checkpointed peak)."""
    value = _budget(text)
    if isinstance(value, str) and value.strip().endswith("%"):
        raise argparse.ArgumentTypeError(f"--host-budget is a size such as 64GB, not a share ({text!r})")
    return value


def _fractions(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"--fractions must be numbers in [0, 1] separated by commas, got {text!r}")
    return values


def _shapes(text: str) -> tuple[tuple[int, ...] | ShapeRange, ...]:
    """``4x64,4x128`` or ``4x64..4x512``: shapes as tuples of positive ints, ranges as ``ShapeRange``."""
    shape = r"[1-9][0-9]*(?:x[1-9][0-9]*)*"
    parts = [part.strip() for part in text.split(",")]
    if not all(re.fullmatch(rf"{shape}(?:\.\.{shape})?", part) for part in parts):
        raise argparse.ArgumentTypeError(f"--shapes takes shapes such as 4x64,4x128 (positive sizes joined by x, "
                                         f"separated by commas) or a range such as 4x64..4x512, got {text!r}")
    specs: list[tuple[int, ...] | ShapeRange] = []
    for part in parts:
        ends = [tuple(int(d) for d in end.split("x")) for end in part.split("..")]
        try:
            specs.append(ShapeRange(*ends) if len(ends) == 2 else ends[0])
        except OptionError as exc:
            raise argparse.ArgumentTypeError(f"--shapes {part}: {exc}") from None
    return tuple(specs)


def _at_least_one(flag: str, meaning: str = ""):
    """The argparse type of ``flag``: an integer >= 1, else one line naming the flag and ``meaning``."""
    def parse(text: str) -> int:
        if not re.fullmatch(r"\s*\d+\s*", text) or int(text) < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer >= 1{meaning}, got {text!r}")
        return int(text)

    return parse


_ranks = _at_least_one("--world-size", " (the number of ranks)")
_degree = _at_least_one("--tensor-parallel", " (the ranks each layer is split over)")
_chunks = _at_least_one("--max-chunks")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _device(text: str) -> torch.device | str:
    """``cpu``, ``cuda`` or ``cuda:N``, present on this machine; or the name of a bundled device spec."""
    if text in device_names():
        return text
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device ckplan can plan on; use {DEVICE_FORMS}")
    device = torch.device(text)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text}: CUDA is not available on this machine; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s), numbered from 0")
    return device


def _optimizer(text: str) -> str | int:
    if text.lower() in NAMED:
        return text.lower()
    try:
        return parse_budget(text)  # bytes, in any of the budget's byte forms
    except BudgetError:
        raise argparse.ArgumentTypeError(f"unknown optimizer {text!r}; use one of {', '.join(NAMED)}, or the bytes "
                                         "of its state (e.g. 2GiB)") from None


def _micro_steps(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of micro-steps >= 1")
    return int(text)
