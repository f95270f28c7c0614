"""Saved profiles, device specs and meta-tensor estimates (issue 6).

Profile once, save, plan later from the file (same plans, checked against the model);
estimate a step for a device that is not here from meta tensors and a roofline, and check
those memory estimates against what a real CPU step measures.
"""

from __future__ import annotations

import json
import re
import resource

import pytest
import torch
from conftest import EXAMPLES, assert_plan_is_exact, load_example
from models import tower, tower_inputs
from torch import nn

import planner
from planner import ProfileFileError, ProfileMismatch, load_profile, optimize, sweep
from planner.capture.inputs import as_inputs
from planner.capture.step import default_loss
from planner.profiling.devices import SPEC_DIR, device_names, load_device
from planner.profiling.estimate import Roofline
from planner.profiling.measure import measure_peak


@pytest.fixture(scope="module")
def measured():
    """A measured profile of the test tower (BatchNorm and dropout) and the model it came from."""
    model = tower(seed=5)
    return model, planner.profile(model, inputs=tower_inputs())


def _segments(plan):
    return [s.nodes for s in plan.segments]


def test_saved_profile_reads_back_equal_and_documents_its_run(measured, tmp_path):
    _model, prof = measured
    prof.save(tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == prof
    data = json.loads((tmp_path / "p.json").read_text())
    assert (data["schema"], data["version"]) == ("ckplan.profile", 1)
    assert data["fingerprint"] == prof.fingerprint and len(prof.fingerprint) == 16
    assert data["input_shapes"] == ["arg0: float32[512, 64]"]
    assert data["device"] == "cpu" and data["torch_version"] == torch.__version__ and data["estimated_for"] == ""
    assert len(data["nodes"]) == len(prof.nodes) and data["nodes"][0]["name"] == prof.nodes[0].name


def test_planning_from_a_saved_profile_does_not_profile_and_is_deterministic(measured, tmp_path, monkeypatch,
                                                                              restore_buffers):
    model, prof = measured
    restore_buffers(model)
    prof.save(tmp_path / "p.json")
    fresh = optimize(model, "60%", inputs=tower_inputs(), profile=prof)

    def no_profiling(*args, **kwargs):
        raise AssertionError("profiled again")
    monkeypatch.setattr("planner.profiling.api.measure", no_profiling)
    monkeypatch.setattr("planner.profiling.api.estimate", no_profiling)
    first = optimize(model, "60%", inputs=tower_inputs(), profile=load_profile(tmp_path / "p.json"))
    second = optimize(model, "60%", inputs=tower_inputs(), profile=load_profile(tmp_path / "p.json"))
    assert first.segments and _segments(first) == _segments(second) == _segments(fresh)
    assert first.predicted_peak_bytes == second.predicted_peak_bytes == fresh.predicted_peak_bytes
    monkeypatch.undo()
    assert_plan_is_exact(model, first, tower_inputs(), default_loss, restore_buffers)  # real module, exact grads


def test_sweep_takes_a_saved_profile(measured):
    model, prof = measured
    result = sweep(model, ["100%", "60%"], inputs=tower_inputs(), profile=prof)
    assert result.prepared.profile is prof and result.rows[1].n_segments > 0


def test_profile_of_another_architecture_is_refused_naming_the_fingerprint(measured):
    _, prof = measured
    other = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    with pytest.raises(ProfileMismatch, match="graph fingerprint .* another architecture") as info:
        optimize(other, "60%", inputs=tower_inputs(), profile=prof)
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)


def test_profile_of_other_inputs_is_refused_naming_the_input(measured):
    model, prof = measured
    with pytest.raises(ProfileMismatch, match=r"inputs arg0: float32\[512, 64\] vs arg0: float32\[256, 64\]"):
        optimize(model, "60%", inputs=(torch.randn(256, 64),), profile=prof)
    with pytest.raises(ProfileMismatch, match=r"float32\[512, 64\] vs arg0: float64\[512, 64\]"):
        optimize(model, "60%", inputs=(torch.randn(512, 64, dtype=torch.float64),), profile=prof)


@pytest.mark.parametrize("damage, message", [
    (lambda text: text[: len(text) // 2], "is not valid JSON"),
    (lambda text: text.replace('"version": 1', '"version": 99'), "schema version 99; this ckplan reads version 1"),
    (lambda text: text.replace('"ckplan.profile"', '"ckplan.plan"'), "is not a ckplan profile"),
    (lambda text: text.replace('"param_bytes"', '"param_byte"'), "lacks the field 'param_bytes'"),
    (lambda text: re.sub(r'"saves":\[(\d)', r'"saves":[999999,\1', text, count=1), "storage 999999, but the profile"),
], ids=["truncated", "version", "schema", "field", "index"])
def test_a_damaged_profile_file_is_one_clear_line(measured, tmp_path, damage, message):
    _, prof = measured
    path = tmp_path / "p.json"
    prof.save(path)
    path.write_text(damage(path.read_text()))
    with pytest.raises(ProfileFileError, match=message) as info:
        load_profile(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ProfileFileError, match="cannot read profile"):
        load_profile(tmp_path / "missing.json")


def test_bundled_device_specs_cite_their_source():
    assert {"h100", "h200", "gh200", "a100-80gb", "a100-40gb", "l4", "rtx4090", "generic-cpu"} <= set(device_names())
    for name in device_names():
        spec = load_device(name)
        assert spec.name == name and spec.memory_bytes > 2**30 and spec.bytes_per_s > 1e9
        assert spec.flops_per_s("float32") > 1e10 and spec.flops_per_s("bfloat16") >= spec.flops_per_s("float32")
        assert ("datasheet" in spec.source or "whitepaper" in spec.source) if spec.kind == "gpu" else spec.source
    assert load_device("h100").flops_per_s("bfloat16") == pytest.approx(989.4e12)
    for name in ("h100", "h200", "gh200"):  # a host link to offload activations over, its figures cited
        spec, raw = load_device(name), json.loads((SPEC_DIR / f"{name}.json").read_text())
        assert spec.device_to_host_gb_per_s > 0 and spec.host_to_device_gb_per_s > 0 and raw["host_link_source"]
    assert load_device("gh200").host_to_device_gb_per_s > load_device("h100").host_to_device_gb_per_s
    assert load_device("generic-cpu").device_to_host_gb_per_s is None


def test_unknown_device_and_bad_spec_file_say_what_to_use(tmp_path):
    with pytest.raises(ValueError, match="unknown device 'tpu9'.*h100"):
        optimize(tower(), "60%", inputs=tower_inputs(), device="tpu9")
    with pytest.raises(ValueError, match="model is on cpu.*move the model"):
        planner.profile(tower(), inputs=tower_inputs(), device="cuda")
    (tmp_path / "mine.json").write_text('{"schema": "ckplan.device", "version": 1, "name": "x"}')
    with pytest.raises(ProfileFileError, match="lacks the field 'description'"):
        load_device(tmp_path / "mine.json")
    one_way = {**json.loads((SPEC_DIR / "h100.json").read_text()), "host_to_device_gb_per_s": None}
    (tmp_path / "one_way.json").write_text(json.dumps(one_way))
    with pytest.raises(ProfileFileError, match="needs both device_to_host_gb_per_s and host_to_device_gb_per_s"):
        load_device(tmp_path / "one_way.json")
    with pytest.raises(ValueError, match="profile= or device=, not both"):
        optimize(tower(), "60%", inputs=tower_inputs(), device="h100",
                 profile=planner.profile(tower(), inputs=tower_inputs(), device="h100"))


def test_roofline_is_compute_bound_for_matmuls_and_memory_bound_for_the_rest():
    spec = load_device("h100")
    roof, overhead_ms = Roofline(spec), spec.op_overhead_us / 1e3
    a = torch.empty(4096, 4096, device="meta")
    mm = torch.ops.aten.mm.default
    assert roof.op_ms(mm, (a, a), a) == pytest.approx(overhead_ms + 2 * 4096**3 / 67e12 * 1e3)
    add = torch.ops.aten.add.Tensor
    assert roof.op_ms(add, (a, a), a) == pytest.approx(overhead_ms + 3 * 4096**2 * 4 / 3350e9 * 1e3)
    assert roof.op_ms(torch.ops.aten.t.default, (a,), a.t()) == pytest.approx(overhead_ms)  # a view moves nothing
    half = a.to(torch.bfloat16)
    assert roof.op_ms(mm, (half, half), half) == pytest.approx(overhead_ms + 2 * 4096**3 / 989.4e12 * 1e3)


@pytest.mark.parametrize("name", ["seed_cnn", pytest.param("resnet", marks=pytest.mark.slow)])
def test_meta_estimates_match_measured_cpu_memory(name, restore_buffers):
    """Memory from meta tensors agrees with a real CPU step within 5%, un-checkpointed and planned."""
    example = load_example(name)
    model, inputs, loss_fn = example["model"], example["inputs"], example["loss_fn"]
    restore_buffers(model)
    before = [p.detach().clone() for p in model.parameters()]
    prof = planner.profile(model, inputs=inputs, loss_fn=loss_fn, device="generic-cpu")
    assert prof.estimated_for == "generic-cpu" and prof.step_ms > 0
    assert all(p.device.type == "cpu" and torch.equal(p, b) for p, b in zip(model.parameters(), before))
    measured_peak = measure_peak(model, as_inputs(model, inputs), loss_fn)
    assert abs(prof.baseline_peak_bytes - measured_peak) <= 0.05 * measured_peak
    try:
        plan = optimize(model, "70%", inputs=inputs, loss_fn=loss_fn, profile=prof)
    except planner.InfeasibleBudget as exc:  # seed_cnn: its smallest plan is above 70%
        plan = optimize(model, exc.min_peak_bytes, inputs=inputs, loss_fn=loss_fn, profile=prof)
    assert plan.segments
    planned_peak = measure_peak(plan.module, as_inputs(model, inputs), loss_fn)
    assert abs(plan.predicted_peak_bytes - planned_peak) <= 0.05 * planned_peak
    assert_plan_is_exact(model, plan, inputs, loss_fn, restore_buffers)  # BatchNorm restores found on meta too


def test_a_meta_model_plans_for_a_gpu_without_allocating():
    """A step of about 40 GB on the meta device: planning must never materialise any of it."""
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Sequential(nn.Linear(8192, 8192), nn.GELU()) for _ in range(8)])
        x = torch.randn(65536, 8192)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with pytest.raises(ValueError, match="meta device.*device="):
        optimize(model, "50%", inputs=(x,))
    plan = optimize(model, "60%", inputs=(x,), device="h100")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before < 2**30
    activation = 65536 * 8192 * 4
    assert plan.baseline_peak_bytes > 16 * activation  # every layer's matmul and GELU outputs are counted
    assert plan.segments and plan.predicted_peak_bytes <= plan.budget_bytes and plan.device == "h100"
    assert all(p.is_meta for p in model.parameters())
    # roofline: 3 matmuls of 2*65536*8192^2 FLOPs per layer (forward, two in backward) at 67 TFLOP/s
    assert plan.step_ms == pytest.approx(8 * 3 * 2 * 65536 * 8192**2 / 67e12 * 1e3, rel=0.25)


def test_cli_saves_a_profile_and_plans_from_it(tmp_path, capsys):
    from planner.report.cli import main

    seed, path = str(EXAMPLES / "seed_cnn.py"), str(tmp_path / "seed.json")
    assert main([seed, "--budget", "100%", "--json", "--save-profile", path]) == 0
    made = json.loads(capsys.readouterr().out)
    assert load_profile(path).baseline_peak_bytes > 0
    assert main([seed, "--budget", "100%", "--json", "--profile", path]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["baseline_peak_bytes"] == made["baseline_peak_bytes"] and again["segments"] == made["segments"]
    for args, message in [
        (["--profile", str(tmp_path / "none.json")], "cannot read profile"),
        (["--profile", path, "--save-profile", str(tmp_path / "b.json")], "give one of them"),
    ]:
        assert main([seed, *args]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
    assert main([str(EXAMPLES / "gpt.py"), "--profile", path]) == 2  # captured, refused, never profiled
    assert "does not match this model" in capsys.readouterr().err


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(64, 192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(8, 512, 3, 4, 16).permute(2, 0, 3, 1, 4)
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_attention_on_meta_is_estimated_as_the_fused_kernel():
    """On meta SDPA would materialise batch x heads x 512 x 512 scores; CPUs and GPUs run a fused kernel."""
    prof = planner.profile(_Attention(), inputs=(torch.randn(8, 512, 64),), device="h100")
    scores = 8 * 4 * 512 * 512 * 4
    assert max(s.nbytes for s in prof.storages) < scores / 8
    measured = planner.profile(_Attention(), inputs=(torch.randn(8, 512, 64),))
    assert prof.baseline_peak_bytes == pytest.approx(_dispatched_peak(measured), rel=0.05)
    assert measured.baseline_peak_bytes > _dispatched_peak(measured)  # the CPU kernel's own buffers, at the allocator


def _dispatched_peak(prof) -> int:
    """The un-checkpointed peak a profile measured as the dispatcher sees it (what a meta replay counts), without
    what ops allocate inside themselves."""
    return max(max(n.fwd_peak_bytes, n.bwd_peak_bytes or 0) for n in prof.nodes)


@pytest.mark.slow
def test_hugging_face_decoder_on_meta_plans_for_h100():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(vocab_size=1000, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(config)
        ids = torch.randint(0, 1000, (4, 256))
    plan = optimize(model, "50%", inputs={"input_ids": ids, "labels": ids, "use_cache": False}, device="h100",
                    budget_bounds="allocated")  # at 30 MiB the allocator's 20 MiB segments are most of what it reserves
    assert plan.capture_method == "export" and plan.segments
    assert plan.predicted_peak_bytes <= plan.budget_bytes and plan.step_ms > 0


_calls = iter(range(10**6))


@torch.fx.wrap
def _shape_changing(y: torch.Tensor) -> torch.Tensor:
    return y[: 1 + next(_calls) % 3]  # another shape on every call: a re-run cannot match its forward


class _ReRunMismatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _shape_changing(self.linear(x)).relu()


def test_sac_calibration_measures_and_survives_a_graph_checkpoint_rejects():
    """sac_op_us is measured on a graph that runs as one checkpointed segment, and is "not measured"
    (-1), not an error, on one whose re-run checkpoint rejects."""
    from planner.profiling.timing import sac_op_overhead_us

    model = tower()
    gm = torch.fx.symbolic_trace(model)
    assert sac_op_overhead_us(gm, as_inputs(model, tower_inputs()), default_loss, torch.device("cpu"), 10) >= 0
    bad = _ReRunMismatch()
    gm = torch.fx.symbolic_trace(bad)
    assert sac_op_overhead_us(gm, as_inputs(bad, (torch.randn(8, 4),)), default_loss, torch.device("cpu"), 5) is None


def test_a_forward_that_reads_mask_values_replays_on_meta_along_the_path_it_took():
    """GPT-2 with a padded attention mask reads the mask's values (``bool(mask.all())``) to pick its path:
    the meta replay answers those reads with what the real forward read, and its memory is the measured one."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_positions=64, use_cache=False)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 1000, (2, 48))
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    on_meta = planner.profile(model, inputs=inputs, device="generic-cpu")
    measured = planner.profile(model, inputs=inputs)
    assert on_meta.baseline_peak_bytes == _dispatched_peak(measured)
    assert [n.fwd_peak_bytes for n in on_meta.nodes] == [n.fwd_peak_bytes for n in measured.nodes]


class _UnreadValues(nn.Module):
    """SD3's joint attention and a VAE's posterior in miniature: a slice nothing reads keeps the concatenation it
    views alive while ``forward`` runs, and an ``exp`` nothing reads saves its own output for a backward that
    never runs. Both are freed when ``forward`` returns."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        joint = torch.cat([self.fc1(x), x], dim=1)
        image, context = joint[:, :64], joint[:, 64:]  # noqa: F841  # context: read by nothing
        std = self.fc1(x).exp()  # noqa: F841  # read by nothing; ExpBackward saves its result
        return self.fc2(image.relu())


def test_values_nothing_reads_are_freed_in_the_profile_as_in_the_step():
    """The profiled step frees a value no node reads once it is computed, as fx's generated code does (an
    ``fx.Interpreter`` holds it, and the concatenation the slice views, to the step's end), and a tensor an autograd
    node saves of its own output does not hold that node (a node off the loss's path dies with the forward, and its
    output with it): measured and replayed on meta, the profiled peak is the step's, to the byte."""
    torch.manual_seed(0)
    model, x = _UnreadValues(), torch.randn(512, 64)

    def loss_fn(out):
        return out.square().mean()

    measured = measure_peak(model, as_inputs(model, (x,)), loss_fn)
    assert planner.profile(model, inputs=(x,), loss_fn=loss_fn).baseline_peak_bytes == measured
    assert planner.profile(model, inputs=(x,), loss_fn=loss_fn, device="generic-cpu").baseline_peak_bytes == measured


@pytest.mark.slow
def test_a_hugging_face_decoder_on_meta_estimates_what_its_real_twin_does():
    """On meta the model is exported, where Hugging Face's mask code cannot read values: it would hand every
    attention call a tokens x tokens mask (and repeat grouped key/value heads) that eager code, which the real
    model's estimate captures, never makes. Both take the eager path: no mask, the same peak but for the int64
    positions export keeps."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                                      attn_implementation="sdpa")
    tokens = 1024
    real = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 320, (1, tokens))
    twin = planner.profile(real, inputs={"input_ids": ids, "labels": ids}, device="h100")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    on_meta = planner.profile(model, inputs={"input_ids": ids.to("meta"), "labels": ids.to("meta")}, device="h100")
    assert on_meta.capture_method == "export"
    masks = (tokens * tokens, 4 * tokens * tokens)  # the boolean mask, its additive copy
    assert not [s.nbytes for s in on_meta.storages if s.nbytes in masks]
    assert abs(on_meta.baseline_peak_bytes - twin.baseline_peak_bytes) <= 8 * tokens  # export's int64 positions
