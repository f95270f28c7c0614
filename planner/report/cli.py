"""``ckplan model.py --budget 75%``: plan a model file from the terminal or CI.

The model file defines module-level ``model`` (an nn.Module or a zero-argument
callable returning one), ``inputs`` (tuple or dict of tensors, or a callable
returning one) and optionally ``loss_fn(output) -> scalar``. This module parses
the command line (``arguments.py``), runs the file, calls ``optimize()`` and turns every user
mistake (a ``PlannerError`` or a ``UserError``) into one line and exit code 2;
any other exception is a bug in ckplan: one line, exit code 1, the traceback
with ``--debug``. ``render.py`` renders the results.
Exit codes: 0 success, 1 internal error, 2 user error, 3 infeasible budget (docs/cli.md).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from planner.api import optimize
from planner.capture.inputs import as_inputs
from planner.errors import InfeasibleBudget, PlannerError
from planner.options import PlanOptions
from planner.pipeline import profile
from planner.plan import Plan
from planner.profiling.measure import measure_peak, step_times_ms
from planner.profiling.record import Profile, load_profile
from planner.report import render as cli_report
from planner.report.arguments import MIXED_PRECISION, build_parser
from planner.report.model_file import ModelFile, UserError, load_model_file, located, to_device

EXIT_OK, EXIT_INTERNAL, EXIT_USAGE, EXIT_INFEASIBLE, EXIT_NOT_FOUND, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130
VERIFY_RUNS = 5




















# -- planning --------------------------------------------------------------------------------------------------


def _plan(args: argparse.Namespace, err: Console) -> tuple[ModelFile, Plan, cli_report.Verification | None]:
    """Loads the file, plans it, and verifies the plan when asked, with progress on stderr."""
    if args.fractions is not None:
        raise UserError("--fractions applies to --compiled only (the activation_memory_budget fractions it probes)")
    for flag, target in (("--save", args.save), ("--emit", args.emit), ("--save-profile", args.save_profile)):
        _check_output(flag, target, args.model_file)
    if args.emit and (args.follow_batch or args.shapes):
        raise UserError("--emit writes one plan's source, and a plan that follows the batch has one per shape "
                        "group: save it with --save and apply it with planner.load_plan(...).apply(model)")
    if args.profile and args.save_profile:
        raise UserError("--profile and --save-profile together would only copy the profile; give one of them")
    if args.verify and isinstance(args.device, str):
        raise UserError(f"--verify measures a step on this machine, but --device {args.device} plans for a device "
                        "that is not here: drop one of them")
    if args.verify and (args.world_size > 1 or args.parallel or args.tensor_parallel > 1):
        raise UserError("--verify measures one process, but --world-size/--parallel/--tensor-parallel plan one rank of "
                        "a job: measure "
                        "inside the job with planner.distributed.rank_peak_bytes (docs/distributed.md)")
    show = not args.quiet and sys.stderr.isatty()
    with (cli_report.StageProgress(err, enabled=show, solver=args.solver, time_limit_s=args.time_limit) as stage,
          _model_code(args.model_file)):
        found = _load(args, stage)
        saved = _profile_file(args, found)  # a user's mistake raises a PlannerError (exit 2), anything else
        plan = optimize(found.model, args.budget, inputs=found.inputs,  # is a bug (exit 1)
                        options=replace(_options(args, found, stage), profile=saved))
        verification = None
        if args.verify:
            stage("verify")
            verification = _verify(found, plan, keep_output=not args.drop_output)
    return found, plan, verification


@contextlib.contextmanager
def _model_code(model_file: str):
    """Where the file's code, factories, forward and loss_fn run: ``sys.exit()`` in them is the user's
    mistake (exit 2), not ckplan's exit code to give."""
    try:
        yield
    except SystemExit as exc:
        raise UserError(f"{located(exc, fallback=model_file)}: the model's code called sys.exit() while "
                        "ckplan ran it; forward and loss_fn must return a value, not exit") from exc






def _mixed_precision(name: str | None) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for ``--mixed-precision``, or None."""
    if name is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=getattr(torch, MIXED_PRECISION[name]), reduce_dtype=torch.float32)


def _options(args: argparse.Namespace, found: ModelFile, stage: Callable[[str], None]) -> PlanOptions:
    """The plan options the command line and the model file give."""
    return PlanOptions(loss_fn=found.loss_fn, keep_output=not args.drop_output, solver=args.solver,
                       time_limit_s=args.time_limit, max_chunks=args.max_chunks, selective=not args.whole_segments,
                       must_save=tuple(args.must_save), must_recompute=tuple(args.must_recompute),
                       world_size=args.world_size, parallel=args.parallel, optimizer=args.optimizer,
                       gradient_accumulation_steps=args.gradient_accumulation_steps,
                       batches_held=args.batches_held, zero_grad=args.zero_grad,
                       set_to_none=not args.zero_grad_keeps_tensors, autocast=args.autocast,
                       tensor_parallel=args.tensor_parallel,
                       mixed_precision=_mixed_precision(args.mixed_precision),
                       follow_batch=_follows(args), shapes=args.shapes,
                       offload={"auto": True, "off": False}.get(args.offload), host_budget=args.host_budget,
                       ranks_per_host=args.ranks_per_host,
                       compilable=args.compilable, compile_backend=args.compile_backend,
                       pipeline=args.pipeline, pipeline_rank=args.pipeline_rank,
                       budget_bounds=args.budget_bounds,
                       device=args.device if isinstance(args.device, str) else None, progress=stage)


def _load(args: argparse.Namespace, stage: Callable[[str], None]) -> ModelFile:
    """The model file's model, inputs and loss, on ``--device`` when given."""
    stage("load")
    found = load_model_file(args.model_file, model=args.model, inputs=args.inputs, loss=args.loss)
    return found if not isinstance(args.device, torch.device) else to_device(found, args.device)


def _follows(args: argparse.Namespace) -> bool | None:
    """``follow_batch`` from the flags: asked for (``--follow-batch``, ``--shapes``), refused (``--no-follow-batch``,
    or ``--emit``, which writes one plan's source), else the default (None: where it costs nothing)."""
    if args.follow_batch or args.shapes is not None:
        return True
    return False if args.follow_batch is False or args.emit else None


_EAGER_ONLY = ("--save", "--emit", "--profile", "--save-profile", "--verify", "--explain", "--whole-segments",
               "--must-save", "--must-recompute", "--world-size", "--parallel", "--optimizer", "--mixed-precision",
               "--follow-batch", "--shapes", "--tensor-parallel", "--offload", "--host-budget", "--budget-bounds",
               "--compilable", "--compile-backend", "--pipeline", "--pipeline-rank", "--ranks-per-host")


def _compiled(args: argparse.Namespace, out: Console, err: Console) -> int:
    """``--compiled``: ``optimize_compiled`` on the file's model, then its report."""
    from planner.compiled.api import optimize_compiled
    from planner.report.compiled import compiled_json, print_compiled

    defaults = build_parser()
    given = [flag for flag in (*_EAGER_ONLY, "--solver")
             if getattr(args, flag[2:].replace("-", "_")) != defaults.get_default(flag[2:].replace("-", "_"))]
    if given:
        raise UserError(f"{given[0]} applies to eager plans, and --compiled measures compiled partitions "
                        "(docs/compiled.md): drop one of them")
    show = not args.quiet and sys.stderr.isatty()
    with (cli_report.StageProgress(err, enabled=show, solver=args.solver, time_limit_s=args.time_limit) as stage,
          _model_code(args.model_file)):
        found = _load(args, stage)
        plan = optimize_compiled(found.model, args.budget, inputs=found.inputs, options=_options(args, found, stage),
                                 **({"fractions": args.fractions} if args.fractions else {}))
    if args.json:
        cli_report.print_json(compiled_json(plan, model_file=args.model_file))
    else:
        print_compiled(out, plan, model_file=args.model_file, quiet=args.quiet)
    return EXIT_OK


def _profile_file(args: argparse.Namespace, found: ModelFile) -> Profile | None:
    """The profile read from ``--profile``, or made and written to ``--save-profile``, or None."""
    if args.profile:
        return load_profile(args.profile)
    if not args.save_profile:
        return None
    made = profile(found.model, inputs=found.inputs, loss_fn=found.loss_fn, keep_output=not args.drop_output)
    try:
        made.save(args.save_profile)
    except OSError as exc:
        raise UserError(f"cannot write {exc.filename}: {exc.strerror}") from exc
    return made


def _verify(found: ModelFile, plan: Plan, *, keep_output: bool) -> cli_report.Verification:
    """One real step of the model and of the planned module: peaks, then interleaved median step times."""
    example = as_inputs(found.model, found.inputs)
    assert plan.module is not None  # optimize() always returns the module
    base_ms, planned_ms = step_times_ms([found.model, plan.module], example, found.loss_fn, runs=VERIFY_RUNS)
    return cli_report.Verification(
        baseline_peak_bytes=measure_peak(found.model, example, found.loss_fn, keep_output=keep_output),
        planned_peak_bytes=measure_peak(plan.module, example, found.loss_fn, keep_output=keep_output),
        baseline_step_ms=base_ms,
        planned_step_ms=planned_ms,
        runs=VERIFY_RUNS,
    )


def _check_output(flag: str, target: str | None, model_file: str) -> None:
    """Fails before planning when ``target`` cannot be written."""
    if target is None:
        return
    path = Path(target)
    if path.is_dir():
        raise UserError(f"{flag} {target} is a directory; give a file name")
    if not path.resolve().parent.is_dir():
        raise UserError(f"{flag} {target}: directory {path.parent} does not exist")
    if path.exists() and path.resolve() == Path(model_file).resolve():
        raise UserError(f"{flag} {target} would overwrite the model file")


def _write_outputs(args: argparse.Namespace, plan: Plan, model_class: str) -> None:
    try:
        if args.save:
            plan.save(args.save)
        if args.emit:
            Path(args.emit).write_text(cli_report.emitted_source(
                plan, model_file=args.model_file, model_class=model_class, budget=args.budget, save_path=args.save))
    except OSError as exc:
        raise UserError(f"cannot write {exc.filename}: {exc.strerror}") from exc


# -- entry point -----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Runs ``ckplan``; returns the exit code (argparse exits 2 itself on a bad command line). A reader that stops
    reading the report (``ckplan model.py | head``) ends it quietly, as any filter's output ends: exit 0."""
    try:
        return _main(build_parser().parse_args(argv))
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)  # Python flushes stdout at exit, into the closed pipe again
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


class _Console(Console):
    """rich's console, whose closed pipe reaches ``main`` (rich's own answer is to exit 1)."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError


def _main(args: argparse.Namespace) -> int:
    out, err = _Console(), _Console(stderr=True)
    try:
        if args.compiled:
            return _compiled(args, out, err)
        found, plan, verification = _plan(args, err)
        _write_outputs(args, plan, type(found.model).__name__)
    except InfeasibleBudget as exc:
        _show_debug(args, exc)
        if args.json:
            cli_report.print_json(cli_report.infeasible_json(exc))
        cli_report.print_infeasible(err, exc)
        return EXIT_INFEASIBLE if exc.proven else EXIT_NOT_FOUND
    except (UserError, PlannerError) as exc:
        _show_debug(args, exc)
        if args.json:
            cli_report.print_json({"error": "user_error", "message": str(exc)})
        cli_report.print_error(err, str(exc), full=args.debug)
        return EXIT_USAGE
    except KeyboardInterrupt:
        cli_report.print_error(err, "interrupted")
        return EXIT_INTERRUPTED
    except Exception as exc:
        _show_debug(args, exc)
        message = _internal_error(exc, debug=args.debug)
        if args.json:
            cli_report.print_json({"error": "internal_error", "message": message})
        cli_report.print_error(err, message)
        return EXIT_INTERNAL
    if args.json:
        cli_report.print_json(cli_report.plan_json(plan, model_file=args.model_file, solver=args.solver,
                                                   verification=verification, saved=args.save, emitted=args.emit))
    else:
        cli_report.print_report(out, plan, model_file=args.model_file, solver=args.solver, quiet=args.quiet,
                                explain=args.explain, verification=verification, saved=args.save,
                                emitted=args.emit)
    return EXIT_OK


def _internal_error(exc: BaseException, *, debug: bool) -> str:
    """One line for an exception that is not a user's mistake: what it was, that it is a bug, how to
    get the traceback a report needs."""
    first = (str(exc).strip().splitlines() or [""])[0]
    where = "the traceback above" if debug else "the traceback (rerun with --debug to see it)"
    return f"internal error ({type(exc).__name__}: {first}): this is a bug in ckplan; please report it with {where}"


def _show_debug(args: argparse.Namespace, exc: BaseException) -> None:
    if args.debug:
        traceback.print_exception(exc, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
