"""Hostile input (issue 17): every malformed budget, model file, plan or profile file gets one
``PlannerError`` naming the problem (and the file), never another exception; the CLI answers it with
exit code 2 and one line; the model is left as it was; loading a plan or profile runs no code.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import pickle
import re
import subprocess
import sys
from dataclasses import MISSING, fields
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import Tower, tower, tower_inputs

import planner
from planner import PlannerError, load_plan, load_profile, optimize
from planner.common.budget import _UNITS, ACCEPTED_FORMS, check_budget, parse_budget
from planner.errors import BudgetError, PlanFileError, PlanMismatch, ProfileFileError, ProfileMismatch
from planner.plan import MemoryTimeline, Plan, Segment
from planner.profiling.record import NodeCost, Profile, StorageCost
from planner.report.cli import main
from planner.report.model_file import MODEL_MODULE, load_model_file

FEW = settings(max_examples=100, deadline=None, derandomize=True)
TRACEBACK = "Traceback (most recent call last)"

# -- budgets ---------------------------------------------------------------------------------------------------

VALID = {"4 GB": 4 * 10**9, "4gib": 4 * 2**30, " 512MiB ": 512 * 2**20, "0.5%": 5 * 10**6, "4.35GB": 4_350_000_000,
         4096: 4096, 2**63 - 1: 2**63 - 1}  # budget -> bytes at a 10**9-byte baseline
NEAR_MISSES = ["1e3MB", "nan%", "inf", "-1GB", "0", "100.5%", "", "%", "1" * 5000 + "GB", "1" * 400 + "%", "\u0664GB",
               "\uff14GB", "4GB\x00", "0.0001B", "0x10GB", "4 G B", 0, -1, 2**63, 10**5000, -10**5000, 1.5,
               float("nan"), None, True, b"4GB"]


def _budget_outcome(budget):
    """A positive int64 of bytes, or the BudgetError naming the accepted forms; ``check_budget`` agrees."""
    try:
        nbytes = parse_budget(budget, baseline_peak_bytes=10**9)
    except BudgetError as exc:
        assert ACCEPTED_FORMS in str(exc) and "\n" not in str(exc)
        with pytest.raises(BudgetError):
            check_budget(budget)
        return None
    assert type(nbytes) is int and 0 < nbytes < 2**63
    check_budget(budget)
    return nbytes


@pytest.mark.parametrize("budget", [*VALID, *NEAR_MISSES],
                         ids=lambda b: f"int{b.bit_length()}" if isinstance(b, int) else ascii(b)[:24])
def test_near_miss_budgets(budget):
    assert _budget_outcome(budget) == VALID.get(budget)


@FEW
@given(st.one_of(st.text(), st.from_regex(r"\s?-?[0-9\u0664]{0,25}(\.[0-9]{0,3})?(e9)?\s?(B|kb|MiB|GIB|XB|%)?\s?",
                                          fullmatch=True), st.integers(), st.floats()))
def test_any_budget_is_bytes_or_a_budget_error(budget):
    _budget_outcome(budget)


@FEW
@given(st.integers(1, 10**6), st.sampled_from(sorted(_UNITS)), st.sampled_from(["{}{}", " {} {} "]))
def test_budget_forms_round_trip(n, unit, form):
    assert parse_budget(form.format(n, unit.lower())) == parse_budget(form.format(n, unit)) == n * _UNITS[unit]
    assert parse_budget(n) == n and parse_budget(f"{n % 100 + 1}%", baseline_peak_bytes=10**6) == (n % 100 + 1) * 10**4

# -- model files, through the CLI ------------------------------------------------------------------------------

MODEL = '''import sys, torch, torch.nn as nn
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)
    def forward(self, x):
        h = self.bn(self.fc(x))
        {body}
model = M()
inputs = ({inputs},)
{extra}
SNAPSHOT = {{k: v.clone() for k, v in model.state_dict().items()}}
'''
X = "torch.randn(8, 4)"
MODEL_ERRORS = {  # id: (forward's last line, inputs, more code, what the message must say)
    "forward-raises": ("raise RuntimeError('forward is broken')", X, "",
                       ["model.py:8: raise RuntimeError", "make the model's forward run"]),
    "long-inputs": ("return h", "torch.ones(8, 4, dtype=torch.long)", "",
                    ["model.py:7: h = self.bn", "Long and Float", "int64[8, 4]", "run on inputs of these dtypes"]),
    "meta-inputs": ("return h", "torch.randn(8, 4, device='meta')", "", ["input is on meta", ".to('cpu')"]),
    "no-trainable": ("return h", X, "model.requires_grad_(False)", ["M has no parameter that", "requires_grad_()"]),
    "returns-none": ("return None", X, "", ["model returned None", "define loss_fn"]),
    "returns-str": ("return 'out'", X, "", ["model returned 'out'", "define loss_fn"]),
    "returns-int": ("return 3", X, "", ["model returned 3", "define loss_fn"]),
    "forward-exits": ("sys.exit(0)", X, "", ["model.py:8: SystemExit: 0", "not exit"]),
}
FILE_ERRORS = {  # id: (the file's text, None for no file; what the message must say)
    "syntax-error": ("import torch\nmodel = (\n", ["model.py:2: SyntaxError"]),
    "module-raises": ("import torch\nraise ValueError('bad config')\n", ["model.py:2: ValueError: bad config"]),
    "no-model": ("import torch\ninputs = (torch.randn(2, 2),)\n", ["defines no `model`: define a module-level"]),
    "null-bytes": ("x = 1\x00\n", ["null bytes", "give the Python file"]),
    "missing-file": (None, ["model file model.py does not exist"]),
}


def _run_cli(tmp_path, monkeypatch, capsys, source: str | None, *flags: str) -> str:
    """``ckplan model.py --budget 50%`` in this process: asserts exit 2 with one line and no traceback."""
    if source is not None:
        (tmp_path / "model.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, MODEL_MODULE, raising=False)
    code = main(["model.py", "--budget", "50%", *flags])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", err
    # torch's own log lines are torch's (a CUDA build of torch compiling on a machine without CUDA warns so)
    err = "".join(line for line in err.splitlines(keepends=True) if not TORCH_LOG.match(line))
    assert err.startswith("ckplan: error: ") and err.count("\n") == 1 and TRACEBACK not in err, err
    return err


TORCH_LOG = re.compile(r"[DIWE]\d{4} [\d:.]+ \d+ \S*torch/")
"""A line of torch's logging (``W1204 01:05:30.015000 6655 torch/utils/cpp_extension.py:183] ...``), the path
relative to the working directory (``.venv/lib/python3.11/site-packages/torch/...`` where the venv lies there)."""


@pytest.mark.parametrize("case", [*MODEL_ERRORS, *FILE_ERRORS])
def test_a_failing_model_file_is_one_line_and_the_model_untouched(case, tmp_path, monkeypatch, capsys):
    if case in FILE_ERRORS:
        source, says = FILE_ERRORS[case]
    else:
        body, inputs, extra, says = MODEL_ERRORS[case]
        source = MODEL.format(body=body, inputs=inputs, extra=extra)
    err = _run_cli(tmp_path, monkeypatch, capsys, source)
    assert all(s in err for s in says), err
    if case in FILE_ERRORS:  # the CLI's UserError is a PlannerError too
        with pytest.raises(PlannerError):
            load_model_file("model.py")
        return
    ns = sys.modules[MODEL_MODULE].__dict__
    model = ns["model"]
    assert type(model) is ns["M"] and "forward" not in vars(model) and model.training
    for key, value in model.state_dict().items():  # BatchNorm statistics too: a failed forward updated them
        assert torch.equal(value, ns["SNAPSHOT"][key]), key
    assert all(p.grad is None for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules())


def test_a_forward_that_exits_under_compiled_is_one_line(tmp_path, monkeypatch, capsys):
    """``--compiled`` runs the file's forward under torch.compile: sys.exit() there is the user's mistake
    too (exit 2), not an exit code ckplan passes on."""
    body, inputs, extra, _says = MODEL_ERRORS["forward-exits"]
    err = _run_cli(tmp_path, monkeypatch, capsys, MODEL.format(body=body, inputs=inputs, extra=extra),
                   "--compiled", "--fractions", "1")
    assert "SystemExit: 0" in err and "not exit" in err, err


@pytest.mark.slow
def test_no_traceback_reaches_a_real_terminal(tmp_path):
    (tmp_path / "model.py").write_text(MODEL.format(body="raise RuntimeError('boom')", inputs=X, extra=""))
    result = subprocess.run([sys.executable, "-m", "planner", "model.py", "--budget", "50%"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stdout == "" and result.stderr.count("\n") == 1
    assert "model.py:8: raise RuntimeError('boom')" in result.stderr and TRACEBACK not in result.stderr

# -- plan and profile files ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A real plan and profile of the tower saved in ``root``: their ``text`` by kind, and the ``profile``
    (estimated for a device spec: the file a measured profile writes, in 2 s instead of 20)."""
    root = tmp_path_factory.mktemp("hostile")
    prof = planner.profile(tower(), inputs=tower_inputs(), device="generic-cpu")
    optimize(tower(), "60%", inputs=tower_inputs(), profile=prof, selective=False).save(root / "plan.json")
    prof.save(str(root / "profile.json"))
    return SimpleNamespace(root=root, profile=prof, text={k: (root / f"{k}.json").read_text() for k in LOADERS})


LOADERS = {"plan": (load_plan, PlanFileError), "profile": (load_profile, ProfileFileError)}
KINDS = st.sampled_from(sorted(LOADERS))
LEAVES = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=4),
                   st.sampled_from([-1, 10**30, -10**30, 2**62, float("nan"), float("inf"), [0] * 10_000]))
GARBAGE = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner,
                                                                                           max_size=3), max_leaves=6)


def _load(saved, kind: str, content: str | bytes):
    """The loaded record, or the loader's own error naming the file in one line (anything else propagates)."""
    path = saved.root / f"hostile-{kind}.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    loader, error = LOADERS[kind]
    try:
        loaded = loader(path)
    except PlannerError as exc:
        assert isinstance(exc, error) and str(path) in str(exc) and "\n" not in str(exc), exc
        return exc
    if kind == "plan":  # what a loaded plan is for: reports of its numbers
        loaded.summary(), loaded._repr_html_(), loaded.to_dict()
    return loaded


def _paths(value, at=()):
    """Where values sit in a JSON document (the first two items of each list)."""
    yield at
    items = value.items() if isinstance(value, dict) else enumerate(value[:2]) if isinstance(value, list) else ()
    for key, item in items:
        yield from _paths(item, (*at, key))


def _at(data, at: tuple):
    return _at(data[at[0]], at[1:]) if at else data


def _edit(text: str, at: tuple, value=None, *, delete=False) -> str:
    data = json.loads(text)
    if delete:
        del _at(data, at[:-1])[at[-1]]
    else:
        _at(data, at[:-1])[at[-1]] = value
    return json.dumps(data)


@FEW
@given(kind=KINDS, cut=st.integers(0, 10**6))
def test_a_truncated_file_is_refused(saved, kind, cut):
    text = saved.text[kind].rstrip()
    assert isinstance(_load(saved, kind, text.encode()[:cut % len(text)]), PlannerError)


@FEW
@given(kind=KINDS, data=st.data())
def test_garbage_in_any_field_loads_well_typed_or_is_refused(saved, kind, data):
    text = saved.text[kind]
    at = data.draw(st.sampled_from([p for p in _paths(json.loads(text)) if p]))
    _load(saved, kind, _edit(text, at, data.draw(GARBAGE)))


HEADER = ("format", "schema", "version")
RECORDS = {"plan": {(): Plan, ("segments",): Segment, ("timeline",): MemoryTimeline},
           "profile": {(): Profile, ("nodes",): NodeCost, ("storages",): StorageCost}}


def _required(kind: str, at: tuple) -> bool:
    """Whether the record holding field ``at`` has no default for it (or it is the file's format/version)."""
    holder = tuple(k for k in at[:-1] if isinstance(k, str))  # ("segments", 0, "nodes") is held by a Segment
    cls = RECORDS[kind].get(holder)
    return (not holder and at[-1] in HEADER) or (cls is not None and any(
        f.name == at[-1] and f.default is MISSING and f.default_factory is MISSING for f in fields(cls)))


@FEW
@given(kind=KINDS, data=st.data())
def test_a_missing_field_is_named_unless_optional(saved, kind, data):
    text = saved.text[kind]
    at = data.draw(st.sampled_from([p for p in _paths(json.loads(text)) if p and isinstance(p[-1], str)]))
    result = _load(saved, kind, _edit(text, at, delete=True))
    if _required(kind, at):
        assert isinstance(result, PlannerError) and (at[-1] in str(result) or at[-1] in HEADER), result
    else:  # loads, unless the other records refer to what it held (a node's inputs, its saves)
        assert not isinstance(result, PlannerError) or "corrupt" in str(result), result


@FEW
@given(kind=KINDS, data=st.data(), key=st.text(max_size=8), value=GARBAGE)
def test_unknown_fields_are_ignored(saved, kind, data, key, value):
    text = saved.text[kind]
    records = [(), ("segments", 0), ("timeline",), ("nodes", 1), ("storages", 0)]
    at = data.draw(st.sampled_from([p for p in _paths(json.loads(text)) if p in records]))
    original = LOADERS[kind][0](saved.root / f"{kind}.json")
    assert _load(saved, kind, _edit(text, (*at, f"x-{key}"), value)) == original


@pytest.mark.parametrize("kind,at,value,says", [
    ("profile", ("nodes", 1, "fwd_ms"), float("nan"), "profile.nodes[1].fwd_ms is nan, expected a finite number"),
    ("profile", ("storages", 0, "nbytes"), 10**30, "profile.storages[0].nbytes is"),
    ("profile", ("nodes", 1, "scope"), "abc", "profile.nodes[1].scope is 'abc', expected a list"),
    ("profile", ("version",), 2, "profile schema version 2"),
    ("plan", ("segments", 0, "nodes"), [1], "plan.segments[0].nodes[0] is 1, expected a string"),
    ("plan", ("budget_bytes",), -1, "plan.budget_bytes is -1"),
    ("plan", ("solver_status",), "GREAT", "'GREAT' is not a valid SolverStatus"),
    ("plan", ("version",), "1", "plan version '1', this ckplan reads version 2"),
])
def test_the_message_names_the_field(saved, kind, at, value, says):
    assert says in str(_load(saved, kind, _edit(saved.text[kind], at, value)))


@pytest.mark.parametrize("kind", sorted(LOADERS))
@pytest.mark.parametrize("content", [b"", b"[" * 100_000, b"1" * 5000, b"NaN", b"null", b"[]", b"\xff\xfe{", "pickle"])
def test_other_files_are_refused(saved, kind, content):
    if content == "pickle":  # a pickle renamed .json (of the profile itself, or of the plan's dict)
        content = pickle.dumps(saved.profile if kind == "profile" else json.loads(saved.text[kind]))
    assert isinstance(_load(saved, kind, content), PlannerError)


def test_files_of_another_model_are_refused_and_the_model_untouched(saved):
    other = Tower(depth=3)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(PlanMismatch, match="fingerprint"):
        load_plan(saved.root / "plan.json").apply(other, inputs=tower_inputs())
    with pytest.raises(ProfileMismatch, match="fingerprint"):
        optimize(other, "60%", inputs=tower_inputs(), profile=load_profile(saved.root / "profile.json"))
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())
    renamed = _load(saved, "profile", _edit(saved.text["profile"], ("nodes", 3, "name"), "x"))  # same graph
    with pytest.raises(ProfileMismatch, match="node 3 is 'x' in the profile"):
        optimize(tower(), "60%", inputs=tower_inputs(), profile=renamed)


INDICES = {"inputs", "outputs", "saves", "mutates"}
NUMBERS = st.integers(-1, 2**50) | st.floats(0, 1e12) | st.sampled_from([0, 1, 2**48, 2**48 + 1, 1e9, 1e6])


@settings(max_examples=25, deadline=None, derandomize=True)
@given(data=st.data())
def test_a_profile_that_loads_plans_or_is_refused(saved, data):
    """Any number, string or null in place of one: the loaded profile plans, or planning says why it cannot
    (storage indices: ``test_a_rewired_profile_plans_or_is_refused``)."""
    doc = json.loads(saved.text["profile"])
    leaves = [p for p in _paths(doc) if p and not isinstance(_at(doc, p), (list, dict)) and not INDICES & set(p)]
    at = data.draw(st.sampled_from(leaves))
    value = data.draw(st.text(max_size=4) if isinstance(_at(doc, at), str) else NUMBERS | LEAVES)
    result = _load(saved, "profile", _edit(saved.text["profile"], at, value))
    if not isinstance(result, PlannerError):
        with contextlib.suppress(PlannerError):
            optimize(tower(), "60%", inputs=tower_inputs(), profile=result, selective=False, time_limit_s=5)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(data=st.data())
def test_a_rewired_profile_plans_or_is_refused(saved, data):
    """Storage indices rewired to other valid storages, or a producer moved: the profile is refused as
    inconsistent, or it plans (a consistent graph, if not the model's), never an internal error."""
    doc = json.loads(saved.text["profile"])
    n_storages, n_nodes = len(doc["storages"]), len(doc["nodes"])
    lists = [("nodes", i, key) for i, node in enumerate(doc["nodes"]) for key in sorted(INDICES) if node[key]]
    edits = data.draw(st.lists(st.one_of(
        st.tuples(st.sampled_from(lists), st.integers(0, n_storages - 1)),
        st.tuples(st.integers(0, n_storages - 1).map(lambda i: ("storages", i, "producer")),
                  st.integers(-1, n_nodes - 1))), min_size=1, max_size=3))
    text = saved.text["profile"]
    for path, value in edits:
        current = json.loads(text)
        old = _at(current, path)
        new = value if not isinstance(old, list) else [value, *old[1:]]
        text = _edit(text, path, new)
    result = _load(saved, "profile", text)
    if not isinstance(result, PlannerError):
        with contextlib.suppress(PlannerError):
            optimize(tower(), "60%", inputs=tower_inputs(), profile=result, selective=False, time_limit_s=5)


def test_loading_runs_no_code(saved, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a loader tried to run code from the file")

    # A first load reads ckplan's own annotations (typing evaluates them once per class); then nothing runs.
    expected = {k: LOADERS[k][0](saved.root / f"{k}.json") for k in LOADERS}
    for owner, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load"),
                        (builtins, "eval"), (builtins, "exec"), (builtins, "compile")):
        monkeypatch.setattr(owner, name, refuse)
    for kind, (loader, error) in LOADERS.items():
        assert loader(saved.root / f"{kind}.json") == expected[kind]
        assert isinstance(_load(saved, kind, saved.text[kind][:100]), error)
