"""An MLP-Mixer (Tolstikhin et al., 2021) for ckplan: patch embedding, then blocks that mix tokens and
channels with two MLPs each, as in the paper's Mixer-S/16 at a smaller depth: 8 blocks of 512
channels over 196 patches of 16x16 pixels, batch 8. ``ckplan examples/mixer.py --budget 60%``."""

import torch
import torch.nn as nn
import torch.nn.functional as F

PATCHES, CHANNELS, TOKEN_HIDDEN, CHANNEL_HIDDEN, DEPTH, CLASSES = 196, 512, 256, 2048, 8, 100


class MlpBlock(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MixerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.tokens = nn.LayerNorm(CHANNELS), MlpBlock(PATCHES, TOKEN_HIDDEN)
        self.norm2, self.channels = nn.LayerNorm(CHANNELS), MlpBlock(CHANNELS, CHANNEL_HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channels(self.norm2(x))


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, CHANNELS, kernel_size=16, stride=16)
        self.blocks = nn.ModuleList(MixerBlock() for _ in range(DEPTH))
        self.norm = nn.LayerNorm(CHANNELS)
        self.head = nn.Linear(CHANNELS, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images).flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))


torch.manual_seed(0)
model = Mixer()
inputs = (torch.randn(8, 3, 224, 224),)
_labels = torch.randint(0, CLASSES, (8,))


def loss_fn(logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, _labels)
