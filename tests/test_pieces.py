"""Timing a step in pieces (planner.profiling.pieces): every node timed, backward attributed as in a
whole step, the model left as found, and memory bounded by one piece instead of the whole step."""

import runpy

import pytest
import torch
from conftest import EXAMPLES
from torch import nn
from torch.utils._pytree import tree_leaves

from planner.capture.api import Captured, capture
from planner.capture.inputs import Inputs, as_inputs
from planner.capture.method import CaptureMethod
from planner.capture.step import default_loss, untouched
from planner.errors import ProfileError
from planner.profiling.memtrack import LiveStorages
from planner.profiling.pieces import check_pieces, even_pieces, node_count, time_in_pieces
from planner.profiling.timing import Timer


class Gated(nn.Module):
    """``a``'s output is only compared (``h > 0``): a whole step never runs ``a``'s backward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        y = self.b(x)
        return self.c(y * (h > 0))


def _example(name: str) -> dict:
    return runpy.run_path(str(EXAMPLES / f"{name}.py"))


def _resnet():
    """Tiny ResNet: BatchNorm, ReLU(inplace=True) and ``out += identity`` on values crossing pieces."""
    torch.manual_seed(0)
    model = _example("resnet")["ResNet"](widths=(8, 16), blocks_per_stage=1)
    return model, as_inputs(model, (torch.randn(4, 3, 16, 16),))


def _gpt():
    """Tiny GPT with dropout: the RNG must be put back."""
    ns = _example("gpt")
    torch.manual_seed(0)
    model = ns["GPT"](ns["Config"](vocab=64, context=16, width=32, heads=2, layers=2, dropout=0.1))
    return model, as_inputs(model, (torch.randint(0, 64, (2, 16)),))


def _gated():
    torch.manual_seed(0)
    return Gated(), as_inputs(None, (torch.randn(4, 8),))


def _mlp(depth: int = 32, width: int = 64, batch: int = 2048):
    """Activations (half a MiB per layer) dwarf the parameters (16 KiB per layer)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])
    return model, as_inputs(model, (torch.randn(batch, width),))


MODELS = {"resnet": _resnet, "gpt": _gpt, "gated": _gated}


@pytest.fixture
def quick(monkeypatch):
    """Skips measuring the checkpoint overhead (about a second of tiny steps) where it is not checked."""
    monkeypatch.setattr("planner.profiling.pieces.checkpoint_overhead_ms", lambda device: 0.1)


def _backward_nodes(captured, model, inputs: Inputs) -> set[int]:
    """Nodes whose backward runs in one whole step (the full-step ``Timer``)."""
    timer = Timer(captured.graph_module, torch.device("cpu"))
    with untouched(model):
        timer.step(inputs, default_loss)
    return {i for i in range(timer.loss_index + 1) if timer.bwd_ms(i) > 0}


def test_even_pieces_cover_the_graph():
    assert even_pieces(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert even_pieces(3, 8) == [(0, 1), (1, 2), (2, 3)]
    assert even_pieces(5, 0) == [(0, 5)]
    for n, k in [(7, 2), (100, 9), (5, 5)]:
        check_pieces(even_pieces(n, k), n)


@pytest.mark.parametrize("pieces", [[], [(1, 5)], [(0, 2), (3, 5)], [(0, 3), (2, 5)], [(0, 0), (0, 5)],
                                    [(0, 4)], [(0, 7)]])
def test_rejects_pieces_that_do_not_cover_the_graph(pieces):
    with pytest.raises(ValueError, match="contiguous"):
        check_pieces(pieces, 5)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("k", [1, 3, 1000])
def test_every_node_timed_and_backward_attributed_as_in_a_whole_step(name, k, quick):
    model, inputs = MODELS[name]()
    captured = capture(model, inputs)
    n = node_count(captured.graph_module)
    times = time_in_pieces(captured, model, inputs, pieces=even_pieces(n, k), runs=1)
    assert len(times.fwd_ms) == len(times.bwd_ms) == n + 1
    assert all(t > 0 for t in times.fwd_ms)
    assert {i for i, t in enumerate(times.bwd_ms) if t > 0} == _backward_nodes(captured, model, inputs)
    assert times.step_fwd_ms == pytest.approx(sum(times.fwd_ms))
    assert times.step_bwd_ms == pytest.approx(sum(times.bwd_ms))
    assert times.sac_op_us is None


def test_checkpoint_overhead_measured_on_the_device():
    model, inputs = _gated()
    captured = capture(model, inputs)
    times = time_in_pieces(captured, model, inputs, pieces=[(0, 1), (1, node_count(captured.graph_module))])
    assert times.checkpoint_overhead_ms >= 0 and times.sac_op_us is None


def test_gated_branch_gets_no_backward(quick):
    """``h`` crosses into the next piece but is only compared there: its producer gets no backward."""
    model, inputs = _gated()
    captured = capture(model, inputs)
    names = [n.target for n in captured.graph_module.graph.nodes if n.op not in ("placeholder", "output")]
    times = time_in_pieces(captured, model, inputs, pieces=even_pieces(len(names), len(names)), runs=1)
    assert times.bwd_ms[names.index("a")] == 0 and times.bwd_ms[names.index("b")] > 0


def test_loss_alone_in_the_last_piece(quick):
    model, inputs = _gated()
    captured = capture(model, inputs)
    n = node_count(captured.graph_module)
    times = time_in_pieces(captured, model, inputs, pieces=[(0, 2), (2, n), (n, n + 1)], runs=1)
    assert times.fwd_ms[n] > 0 and times.bwd_ms[n] > 0


@pytest.mark.parametrize("name", list(MODELS))
def test_model_left_as_found(name, quick):
    model, inputs = MODELS[name]()
    captured = capture(model, inputs)
    model.eval()
    grads = [torch.full_like(p, 0.5) for p in model.parameters()]
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    time_in_pieces(captured, model, inputs, pieces=even_pieces(node_count(captured.graph_module), 4), runs=2)
    assert not any(m.training for m in model.modules())
    assert all(p.grad is g and bool((g == 0.5).all()) for p, g in zip(model.parameters(), grads))
    for key, value in model.state_dict().items():  # BatchNorm statistics and every parameter
        assert torch.equal(value, state[key]), key
    assert torch.equal(torch.get_rng_state(), rng)


def _peak_bytes(captured, model, inputs: Inputs, k: int) -> int:
    with LiveStorages() as tracker:
        for tensor in [*model.parameters(), *tree_leaves(inputs.args)]:
            tracker.track(tensor)
        time_in_pieces(captured, model, inputs, pieces=even_pieces(node_count(captured.graph_module), k), runs=1)
    return tracker.peak_bytes


def test_memory_held_is_one_piece_not_the_whole_step(quick):
    model, inputs = _mlp()
    captured = capture(model, inputs)
    whole, eight = _peak_bytes(captured, model, inputs, 1), _peak_bytes(captured, model, inputs, 8)
    params_and_grads = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    assert params_and_grads < eight < 0.5 * whole


def test_exported_graph_takes_flattened_inputs(quick):
    """torch.export graphs (the tier for meta models) take flattened inputs; keyword inputs reach them."""
    from planner.capture.export import export_graph

    model, inputs = _gpt()
    kwargs = Inputs(args=(), kwargs={"idx": inputs.args[0]})
    captured = Captured(graph_module=export_graph(model, (), kwargs.kwargs), method=CaptureMethod.EXPORT,
                        fingerprint="")
    n = node_count(captured.graph_module)
    times = time_in_pieces(captured, model, kwargs, pieces=even_pieces(n, 5), runs=1)
    assert {i for i, t in enumerate(times.bwd_ms) if t > 0} == _backward_nodes(captured, model, kwargs)


def test_rejects_the_meta_device():
    model, inputs = _gated()
    captured = capture(model, inputs)
    with pytest.raises(ProfileError, match="meta"):
        time_in_pieces(captured, model, inputs, pieces=[(0, 1)], device=torch.device("meta"))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_hugging_face_model_captured_by_the_aten_tier(family, quick):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "qwen2":
        config = transformers.Qwen2Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=256, n_positions=64)
        model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(1, 256, (2, 16))
    inputs = as_inputs(model, {"input_ids": ids, "labels": ids})
    captured = capture(model, inputs)
    assert captured.method is CaptureMethod.ATEN
    state = {k: v.clone() for k, v in model.state_dict().items()}
    n = node_count(captured.graph_module)
    times = time_in_pieces(captured, model, inputs, pieces=even_pieces(n, 6), runs=1)
    assert all(t > 0 for t in times.fwd_ms)
    assert {i for i, t in enumerate(times.bwd_ms) if t > 0} == _backward_nodes(captured, model, inputs)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
