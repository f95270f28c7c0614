"""Where chunks are cut (``memory.regions``): every module call gets its best inner cut before any gets two."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from planner.memory.regions import find_regions
from planner.pipeline import prepare


class Layer(nn.Module):
    """A residual MLP: x + fc2(tanh(fc1(x)))."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(width, 4 * width), nn.Tanh(), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class Narrowing(nn.Module):
    """Named, not numbered, layers (no repeated blocks: DenseNet's ``denselayer1``...), each narrower:
    the small layers' cuts all cross fewer bytes than the wide layer's best one."""

    def __init__(self) -> None:
        super().__init__()
        widths = (256, 128, 64, 32)
        self.first, self.second, self.third, self.fourth = (Layer(w) for w in widths)
        self.down1, self.down2, self.down3 = (nn.Linear(a, b) for a, b in itertools.pairwise(widths))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.down1(self.first(x))
        x = self.down2(self.second(x))
        return self.fourth(self.down3(self.third(x)))


def test_every_module_call_is_cut_inside_before_any_is_cut_twice():
    torch.manual_seed(0)
    prepared = prepare(Narrowing(), inputs=(torch.randn(64, 256),))
    profile = prepared.profile
    every = find_regions(profile, max_chunks=10_000)
    nodes = profile.nodes

    def inner(starts):  # layer name -> cuts strictly inside one of its calls
        found: dict[str, list[int]] = {}
        for b in starts[1:]:
            depth = profile.calls.common_depth(b - 1, b)
            if depth >= 1 and nodes[b].module_path.split(".")[0] in ("first", "second", "third", "fourth"):
                found.setdefault(nodes[b].module_path.split(".")[0], []).append(b)
        return found

    assert all(len(cuts) >= 2 for cuts in inner(every.starts).values())  # each layer has several positions
    outer = every.n_chunks - sum(len(c) for c in inner(every.starts).values())
    regions = find_regions(profile, max_chunks=outer + 4)  # room for one inner cut per layer
    assert regions.capped
    assert {name: len(cuts) for name, cuts in inner(regions.starts).items()} == {
        "first": 1, "second": 1, "third": 1, "fourth": 1}
