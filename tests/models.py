"""Small models for fast tests of the API (each plans in about a second)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.bn = nn.BatchNorm1d(4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(F.gelu(self.bn(self.fc1(x)))))


class Tower(nn.Module):
    """Residual MLP blocks with BatchNorm and dropout."""

    def __init__(self, width: int = 64, depth: int = 4, block: type[Block] = Block) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def tower(seed: int = 0) -> Tower:
    torch.manual_seed(seed)
    return Tower()


def tower_inputs() -> tuple[torch.Tensor]:
    return (torch.randn(512, 64, generator=torch.Generator().manual_seed(1)),)


class DictModel(nn.Module):
    """Keyword inputs with a default, a dict output holding a tuple: outputs stay referenced."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
        self.head = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None, mask: torch.Tensor | None = None):
        h = self.trunk(x)
        if scale is not None:
            h = h * scale
        return {"h": h, "pair": (self.head(h).relu(), h.sum())}


def dict_loss(out) -> torch.Tensor:
    return out["pair"][0].mean() + out["h"].square().mean()
